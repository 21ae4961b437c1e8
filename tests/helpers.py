"""Policies, env factories and stream checks shared by the tests."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from envs import counting_vector
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector
from rlcollect.inference.policy import PolicyRunner
from rlcollect.testing import EPISODE, LAST_ACTION, STEP, CountingEnv, episode_length
from rlcollect.transports.layout import Field


class CountingPolicy(torch.nn.Module):
    """Deterministic: the action is a function of the row's own observation."""

    def __init__(self, num_actions: int = 5) -> None:
        super().__init__()
        self.num_actions = num_actions
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        action = (obs[:, 0] * 7 + obs[:, 1] * 3 + obs[:, 2]) % self.num_actions
        return {"action": action, "value": obs[:, 2].float() * self.scale}


class ConstantPolicy(torch.nn.Module):
    """Always the action ``round(value)``: a weight update shows in every action."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor(float(value)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value.expand(obs.shape[0]).round().long()


def check_weight_update(
    make: Callable[[torch.nn.Module], AsyncBatchedCollector], before: int = 3, after: int = 30
) -> None:
    """Actions switch from 1 to 4 exactly where the stamped version goes from 0 to 1."""
    policy = ConstantPolicy(1)
    with make(policy) as c:
        assert c.policy_version == 0
        first = [next(c) for _ in range(before)]
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1
        later = [next(c) for _ in range(after)]
    data = torch.cat([*first, *later])
    version = data["policy_version"]
    assert set(version.unique().tolist()) == {0, 1}
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    for rows in streams(data).values():  # per env, versions never go back
        assert bool((rows["policy_version"].diff() >= 0).all())


def hold_first_batch(collector: Any) -> tuple[TensorDict, TensorDict, list[TensorDict], Any]:
    """Iterate ``collector`` to its end holding its first batch all along and dropping
    every other one once copied: (the first batch, a copy of it made at once, the copies
    of the others, the collector's stats at the end, taken inside ``with``)."""
    with collector as c:
        batches = iter(c)
        first = next(batches)
        first_copy = first.clone()
        rest = [b.clone() for b in batches]
        stats = c.stats()
    return first, first_copy, rest, stats


# The layout the collector's mechanism tests (errors, restarts, stalls, background
# collection, pause) were written for, the defaults before the layout was chosen by
# measurement (issue 63): the server thread, one env per worker. What the defaults
# choose, and the in-process path, are tested in tests/collector/test_choice.py.
SERVER_LAYOUT: dict[str, Any] = {
    "inference_backend": "thread",
    "envs_per_worker": 1,
    "worker_splits": None,
}


def with_server_layout(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each knob of :data:`SERVER_LAYOUT` they leave out set to it."""
    return {**SERVER_LAYOUT, **kwargs}


def counting_envs(n: int, **kwargs: Any) -> list[Callable[[], CountingEnv]]:
    return [functools.partial(CountingEnv, i, **kwargs) for i in range(n)]


def counting_collector(
    transport: str, policy: torch.nn.Module | None = None, n: int = 4, **kwargs: Any
) -> AsyncBatchedCollector:
    """A collector over ``n`` CountingEnvs in the server layout unless ``kwargs`` (the
    constructor's) say otherwise."""
    kwargs.setdefault("frames_per_batch", 32)
    kwargs.setdefault("total_frames", 320)
    kwargs.setdefault("policy_device", "cpu")
    return AsyncBatchedCollector(
        counting_envs(n),
        policy or CountingPolicy(),
        transport=transport,
        **with_server_layout(kwargs),
    )


def collect(collector: Iterable[TensorDict]) -> TensorDict:
    return torch.cat(list(collector))


def streams(data: TensorDict) -> dict[int, TensorDict]:
    """Rows of each env, in (episode, step) order."""
    out = {}
    env = data["env_index"]
    for i in env.unique().tolist():
        rows = data[env == i]
        order = np.lexsort((rows["step"].numpy(), rows["episode"].numpy()))
        out[i] = rows[torch.from_numpy(order)]
    return out


def check_counting_streams(data: TensorDict, num_actions: int = 5) -> None:
    """Invariants 1 and 2 on CountingEnv data, plus terminal/truncated semantics."""
    obs, nxt = data["observation"], data[("next", "observation")]
    expected_action = (obs[:, 0] * 7 + obs[:, 1] * 3 + obs[:, 2]) % num_actions
    assert torch.equal(data["action"], expected_action), "an action came from another obs"
    assert torch.equal(nxt[:, LAST_ACTION], data["action"]), "an env received another action"
    assert torch.equal(data["env_index"], obs[:, 0])
    assert torch.equal(data["episode"], obs[:, EPISODE])
    assert torch.equal(data["step"], obs[:, STEP])
    assert torch.equal(data[("next", "reward")], (obs[:, STEP] + 1).float())
    for i, rows in streams(data).items():
        ep, st = rows["episode"], rows["step"]
        # contiguous from the very first step, no gap, no duplicate
        assert ep[0] == 0 and st[0] == 0, f"env {i} starts at {ep[0]}/{st[0]}"
        lengths = torch.tensor([episode_length(i, int(e)) for e in ep])
        last = st + 1 == lengths
        follows = torch.where(
            last[:-1],
            (ep[1:] == ep[:-1] + 1) & (st[1:] == 0),
            (ep[1:] == ep[:-1]) & (st[1:] == st[:-1] + 1),
        )
        assert bool(follows.all()), f"env {i} stream has a gap or duplicate"
        term, trunc = rows[("next", "terminated")], rows[("next", "truncated")]
        assert torch.equal(term, last & (ep % 2 == 0)), f"env {i}: terminated is wrong"
        assert torch.equal(trunc, last & (ep % 2 == 1)), f"env {i}: truncated is wrong"
        assert torch.equal(rows[("next", "done")], term | trunc)
        o, n = rows["observation"], rows[("next", "observation")]
        # within an episode next.observation is the following observation ...
        inner = ~last[:-1]
        assert torch.equal(n[:-1][inner][:, :3], o[1:][inner][:, :3])
        # ... and at its end the true final one (same episode, one step on), never a reset
        assert torch.equal(n[last][:, EPISODE], o[last][:, EPISODE])
        assert torch.equal(n[last][:, STEP], o[last][:, STEP] + 1)


def check_restarted_streams(data: TensorDict, *, counting_policy: bool = True) -> dict[int, int]:
    """Per env: routed, whole (no gap, no duplicate), every episode ending with done,
    numbered on across rebuilds (worker restarts, or a RayCollector's collector restarts).
    With ``counting_policy`` each action is also checked to be CountingPolicy's for its
    row's own observation (False: the caller checks the actions of its own policy).

    Returns, per env, how many times it was rebuilt (its own episode count, column
    EPISODE of its observation, starts again at 0) — each preceded by a done row.
    """
    obs, nxt = data["observation"], data[("next", "observation")]
    if counting_policy:
        expected = (obs[:, 0] * 7 + obs[:, 1] * 3 + obs[:, 2]) % 5
        assert torch.equal(data["action"], expected), "an action came from another obs"
    assert torch.equal(nxt[:, LAST_ACTION], data["action"]), "an env received another action"
    assert torch.equal(data["env_index"], obs[:, 0])
    assert torch.equal(data["step"], obs[:, STEP])
    assert torch.equal(data[("next", "reward")], (obs[:, STEP] + 1).float())
    term, trunc = data[("next", "terminated")], data[("next", "truncated")]
    assert torch.equal(data[("next", "done")], term | trunc)
    rebuilt = {}
    for i, rows in streams(data).items():
        ep, st, done = rows["episode"], rows["step"], rows[("next", "done")]
        assert ep[0] == 0 and st[0] == 0, f"env {i} starts at {ep[0]}/{st[0]}"
        follows = torch.where(
            done[:-1],
            (ep[1:] == ep[:-1] + 1) & (st[1:] == 0),
            (ep[1:] == ep[:-1]) & (st[1:] == st[:-1] + 1),
        )
        assert bool(follows.all()), f"env {i} stream has a gap, a duplicate or an unended episode"
        o, n = rows["observation"], rows[("next", "observation")]
        inner = ~done[:-1]
        assert torch.equal(n[:-1][inner][:, :3], o[1:][inner][:, :3]), f"env {i} is not continuous"
        # where the env was rebuilt, its own episode count starts again at 0
        # (the collector numbers episodes on; the rebuilt env counts from 0 again)
        offset = ep - o[:, EPISODE]
        restart = offset[1:] != offset[:-1]
        assert bool((o[1:][restart][:, EPISODE] == 0).all()), f"env {i}: no rebuild there"
        rebuilt[i] = int(restart.sum())
        own_ep, own_len = o[:, EPISODE], o[:, STEP] + 1
        natural = torch.tensor(
            [
                s == episode_length(i, int(e))
                for s, e in zip(own_len.tolist(), own_ep.tolist(), strict=True)
            ]
        )
        t, u = rows[("next", "terminated")], rows[("next", "truncated")]
        assert torch.equal(t, natural & (own_ep % 2 == 0)), f"env {i}: terminated is wrong"
        # truncated: a natural odd-episode end, or the cut before a rebuild
        cut = torch.zeros_like(u)
        cut[:-1] = restart & ~t[:-1]
        assert torch.equal(u, (natural & (own_ep % 2 == 1)) | cut), f"env {i}: truncated is wrong"
    return rebuilt


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds (a hang guard)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" in line.split()[1]
    except (FileNotFoundError, ProcessLookupError):
        # ProcessLookupError: the file opened, then the process was reaped before the read
        return True
    return False


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


class FailingPolicy(torch.nn.Module):
    """Raises on its ``fail_on_call``-th call; the action is always 0."""

    def __init__(self, fail_on_call: int) -> None:
        super().__init__()
        self.calls = 0
        self.fail_on_call = fail_on_call

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("policy failed on purpose")
        return torch.zeros(obs.shape[0], dtype=torch.long)


class ListBuffer:
    """A replay buffer in its simplest form: keeps every batch it is given."""

    def __init__(self) -> None:
        self.parts: list[TensorDict] = []

    def extend(self, td: TensorDict) -> None:
        self.parts.append(td)

    def rows(self) -> int:
        return sum(p.batch_size[0] for p in list(self.parts))


def check_clean(c: AsyncBatchedCollector) -> None:
    """No worker process, thread or segment of ``c`` is left."""
    t = c.transport
    if hasattr(t, "pids"):
        wait_until(lambda: all(process_gone(p) for p in t.pids), what="worker processes")
        assert not shm_exists(t.shm_name)
    else:
        wait_until(
            lambda: (
                not any(
                    th.name.startswith("rlcollect-worker")
                    for th in threading.enumerate()
                    if th.is_alive() and th in t._threads
                )
            ),
            what="worker threads",
        )


class UnpicklablePolicy(CountingPolicy):
    """A CountingPolicy holding a lock, which no pickler can send to another process."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def slow_policy_in_child(marker: str, driver_pid: int) -> CountingPolicy:
    """A policy factory that is quick in the driver (the probe) and, in the inference
    process, marks ``marker`` and then takes two minutes: a policy still being built."""
    if os.getpid() != driver_pid:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait(120)
    return CountingPolicy()


def forking_policy_in_child(pidfile: str, driver_pid: int) -> CountingPolicy:
    """A policy factory that, in the inference process, starts a process inheriting
    every inheritable descriptor (the status pipe's write end among them) that outlives
    it, and writes that process's pid to ``pidfile``."""
    import subprocess

    if os.getpid() != driver_pid:
        child = subprocess.Popen(
            ["sleep", "120"],
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(pidfile, "w") as f:
            f.write(str(child.pid))
    return CountingPolicy()


class RecurrentCountingPolicy(torch.nn.Module):
    """Recurrent: its state counts the steps since the episode began (``count``) and
    remembers the env whose observation it last saw (``env``, -1 at first).

    Its action is CountingPolicy's with the step read from the state instead of the
    observation, so it is right, and every counting-stream check passes, exactly when
    the state the server fed it is the right one for the row. The output ``count``
    reveals the state too (also where ``store_recurrent_state=False``).
    """

    def __init__(self, num_actions: int = 5, *, tensor_state: bool = False) -> None:
        super().__init__()
        self.num_actions = num_actions
        self.tensor_state = tensor_state
        self.scale = torch.nn.Parameter(torch.ones(()))

    def initial_state(self) -> Any:
        if self.tensor_state:  # [count, env] in one tensor
            return torch.tensor([0, -1], dtype=torch.int64)
        return {"count": torch.zeros((), dtype=torch.int64), "env": torch.tensor(-1)}

    def forward(self, obs: torch.Tensor, state: Any) -> tuple[dict[str, torch.Tensor], Any]:
        count = state[:, 0] if self.tensor_state else state["count"]
        action = (obs[:, 0] * 7 + obs[:, 1] * 3 + count) % self.num_actions
        out = {"action": action, "value": obs[:, 2].float() * self.scale, "count": count.clone()}
        if self.tensor_state:
            return out, torch.stack([count + 1, obs[:, 0]], dim=1)
        return out, {"count": count + 1, "env": obs[:, 0].clone()}


def check_recurrent_streams(data: TensorDict, *, stored: bool = True) -> None:
    """Row by row, the recurrent contract on RecurrentCountingPolicy data: the state an
    action was computed from is the initial one at step 0 and, after that, the one the
    same env's previous step returned; ``is_init`` is ``step == 0``."""
    step, env = data["step"], data["env_index"]
    assert torch.equal(data["is_init"], step == 0), "is_init is not step == 0"
    wrong = (data["count"] != step).nonzero().flatten()
    assert not len(wrong), "the state fed to these rows is not their env's: " + ", ".join(
        f"env {int(env[i])} ep {int(data['episode'][i])} step {int(step[i])} got count "
        f"{int(data['count'][i])}"
        for i in wrong[:5]
    )
    if not stored:
        assert "recurrent_state" not in data.keys()  # noqa: SIM118 (a TensorDict)
        return
    state = data["recurrent_state"]
    if isinstance(state, torch.Tensor):  # the tensor form, [count, env]
        count, seen = state[:, 0], state[:, 1]
    else:
        count, seen = state["count"], state["env"]
    assert torch.equal(count, step), "recurrent_state is not the state the action came from"
    assert torch.equal(seen, torch.where(step == 0, -1, env)), "a state came from another env"


def check_state_kept_across_updates(
    collector: AsyncBatchedCollector,
    policy: RecurrentCountingPolicy,
    *,
    batches: int,
    min_version: int,
) -> TensorDict:
    """``batches`` batches of ``collector`` (shut down after), the policy's ``scale`` raised
    by one and pushed after each: every state and stream holds through the version
    changes, and each row's ``value`` shows the weights of its version. Returns the rows."""
    with collector as c:
        taken = []
        for i in range(batches):
            taken.append(next(c))
            with torch.no_grad():
                policy.scale.add_(1.0)
            assert c.update_policy_weights_(policy) == i + 1
    data = collect(taken)
    check_counting_streams(data)
    check_recurrent_streams(data)  # counts go on through every version change
    versions = data["policy_version"]
    assert int(versions.max()) >= min_version
    assert torch.equal(data["value"], data["observation"][:, STEP].float() * (versions + 1))
    return data


def check_vector_sub_envs_own_their_state(
    transport: str, autoreset_mode: str, **kwargs: Any
) -> None:
    """Two SyncVectorEnvs of three CountingEnvs each (``autoreset_mode``), a
    RecurrentCountingPolicy: every sub-env's stream and state is its own. ``kwargs``
    (the policy's device and path) go to the collector."""
    fns = [functools.partial(counting_vector, 3 * i, 3, autoreset_mode) for i in range(2)]
    with AsyncBatchedCollector(
        fns,
        RecurrentCountingPolicy(),
        frames_per_batch=30,
        total_frames=900,
        transport=transport,
        **kwargs,
    ) as c:
        data = collect(c)
    check_counting_streams(data)
    check_recurrent_streams(data)


class TaggedPolicy(CountingPolicy):
    """A CountingPolicy that also outputs its weight ``tag`` on every row: a row's ``tag``
    says which weights computed its action, independently of ``policy_version``."""

    def __init__(self, tag: float = 0.0) -> None:
        super().__init__()
        self.tag = torch.nn.Parameter(torch.tensor(float(tag)))

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(obs)
        out["tag"] = self.tag.expand(obs.shape[0])
        return out


def check_episode_figures(data: TensorDict) -> None:
    """CountingEnv rows: the running return (reward step + 1) and length of each row."""
    steps = data["step"]
    length = steps + 1
    assert torch.equal(data[("next", "episode_length")], length)
    expected = (length * (length + 1) // 2).to(torch.float32)
    assert torch.equal(data[("next", "episode_return")], expected)


# ---------------------------------------------------------------- the GPU tests' set-up

# The pytestmark of a module whose every test needs a GPU: ``-m cuda`` selects them, and
# they are skipped where CUDA is absent.
CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# The ways a policy can run on the GPU: collector keyword arguments, by name.
CUDA_MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "graph": {"cuda_graph": True},
    "compiled": {"compile": True},
    "compiled+graph": {"compile": True, "cuda_graph": True},
}


def cuda_collector(
    transport: str = "process_slots",
    policy: torch.nn.Module | None = None,
    n: int = 6,
    **kwargs: Any,
) -> AsyncBatchedCollector:
    """A counting_collector with its policy on the GPU: 1200 frames in batches of 60
    unless ``kwargs`` say otherwise."""
    kwargs.setdefault("frames_per_batch", 60)
    kwargs.setdefault("total_frames", 1200)
    return counting_collector(transport, policy, n, policy_device="cuda", **kwargs)


def plain_runner(policy: torch.nn.Module, device: torch.device) -> PolicyRunner:
    """A runner of ``policy``, moved to ``device``, that is called with the observation
    tensor itself (a plain, not a dict, observation)."""
    return PolicyRunner(policy.to(device), device=device, observation_paths=((),))


def step_fields(
    observation: tuple[tuple[int, ...], Any],
    outputs: dict[tuple[str, ...], tuple[tuple[int, ...], Any]],
) -> tuple[dict[tuple[str, ...], Field], dict[tuple[str, ...], Field]]:
    """The fields of an action step (a ``DeviceStep`` or ``build_action_step``) over a
    plain observation of ``(shape, dtype)``: the observation, and as outputs ``action``
    (int64 scalars) and ``outputs`` (key: ``(shape, dtype)``)."""
    shape, dtype = observation
    inputs = {(): Field(("observation",), shape, np.dtype(dtype))}
    fields = {("action",): Field(("action",), (), np.dtype(np.int64))}
    fields.update({key: Field(key, s, np.dtype(d)) for key, (s, d) in outputs.items()})
    return inputs, fields


def respond_raising_after(base: type, calls: int) -> Any:
    """A transport whose server end's respond() raises on its ``calls``-th call."""

    class Failing(base):
        def start(self, layout, programs):
            end = super().start(layout, programs)
            respond = end.respond
            count = [0]

            def failing(workers):
                count[0] += 1
                if count[0] >= calls:
                    raise OSError("respond failed on purpose")
                respond(workers)

            end.respond = failing
            return end

    return Failing()


def first_error_within_bound(c: Any, bound: float = 10.0) -> BaseException:
    """Iterate ``c`` in a thread; the error it raised, failing if none came within
    ``bound`` seconds (far above the ~0.1 s an error takes; only a hang reaches it)."""
    out: dict[str, Any] = {}

    def consume():
        try:
            for _ in c:
                pass
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=consume, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"no error within {bound} s: the collector hangs"
    out["seconds"] = time.monotonic() - t0
    return out["error"]


def may_lower_niceness(nice: int) -> bool:
    """Whether this process may lower a thread's niceness to ``nice`` (root, or
    ``CAP_SYS_NICE``, or a high enough ``RLIMIT_NICE``), as its child processes may.
    Tried in a thread of its own, which ends with it: a niceness is a thread's own."""
    allowed: list[bool] = []

    def attempt() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            allowed.append(False)
        else:
            allowed.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(timeout=10)
    return allowed[0]


def lowest_niceness_allowed(lowest: int) -> int:
    """The lowest niceness from ``lowest`` up that this process may give a thread (its
    child processes may as well), found by trying each in a thread of its own; the
    thread's own niceness where none lower is allowed."""
    found: list[int] = []

    def attempt() -> None:
        me = threading.get_native_id()
        own = os.getpriority(os.PRIO_PROCESS, me)
        for nice in range(lowest, own):
            try:
                os.setpriority(os.PRIO_PROCESS, me, nice)
            except OSError:
                continue
            found.append(nice)
            return
        found.append(own)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(timeout=10)
    return found[0]


def biased_actor() -> torch.nn.Module:
    """A TorchRL ``ProbabilisticActor`` over CartPole observations with logits (0, 1)
    whatever the observation: action 1 is the argmax, and a sampled action is 0 with
    probability 1 / (1 + e) ~ 0.27. It writes ``action`` and ``action_log_prob``."""
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor

    net = torch.nn.Linear(4, 2)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.copy_(torch.tensor([0.0, 1.0]))
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )


def sampled_share(actions: torch.Tensor) -> float:
    """The share of ``biased_actor``'s actions that are not its argmax."""
    return (actions == 0).float().mean().item()


# Released by tests whose StuckPolicy blocks a thread of this process, so that none stays;
# STUCK is set once one blocks (in this process).
RELEASE_STUCK = threading.Event()
STUCK = threading.Event()


class StuckPolicy(CountingPolicy):
    """A CountingPolicy whose forward, from its ``after + 1``-th call while collecting,
    never returns (a deadlock, a stuck device call: it waits five minutes, or until
    RELEASE_STUCK is set). The driver's probe (its main thread) is served at once."""

    def __init__(self, after: int, driver_pid: int) -> None:
        super().__init__()
        self.after = after
        self.driver_pid = driver_pid
        self.served = 0

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        probe = os.getpid() == self.driver_pid and threading.current_thread().name == "MainThread"
        if not probe:
            self.served += 1
            if self.served > self.after:
                STUCK.set()
                RELEASE_STUCK.wait(300)
        return super().forward(obs)


TESTS = str(Path(__file__).resolve().parent)


def start_driver(template: str, **values: str) -> subprocess.Popen[str]:
    """A driver script in a Python process of its own, its output piped as text:
    ``template`` formatted with ``tests`` (this folder, for its imports) and ``values``."""
    script = template.format(tests=TESTS, **values)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def interrupt(driver: subprocess.Popen[str]) -> None:
    """Ctrl-C to a driver from :func:`start_driver`: it must end with KeyboardInterrupt
    (bounded: 60 s; the caller kills it in any case)."""
    os.kill(driver.pid, signal.SIGINT)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in err, err[-2000:]
