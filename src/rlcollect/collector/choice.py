"""The layout the defaults choose: where the envs and the policy run.

Four arguments of the collector say where the work runs: ``transport``,
``inference_backend``, ``envs_per_worker`` and ``worker_splits``. Each defaults to
``"auto"``; the plan measures what it needs (``probe.py``: env 0's step time, the
policy's forward at batch 1 and at the env count on its device) and :func:`choose` picks
the layout from those :class:`Figures` with a short table of rules (:data:`RULES`): the
first rule that applies sets every knob the caller left at ``"auto"``; an argument the
caller gave always wins. The :class:`Choice` says what was chosen, from which figures,
by which rule, and how to ask for the same layout explicitly.

What each rule stands on is measured on the pages of ``docs/decisions/``:

* a policy the env workers cannot run (recurrent, batched by the server's arguments, or
  one that cannot be pickled) is served by the server thread;
* with the policy on a GPU: a native vector env driven with send/recv runs the policy in
  its own worker (``vector-env-layouts.md``); other vector envs are served by the
  server thread, one per worker process; many plain envs (as many as cores or more) by
  the server in a process of its own with about one worker per core and two splits
  each (``server-process.md``, ``worker-splits.md``); fewer by the server thread;
* with the policy on the CPU each env worker runs the policy for its own envs
  (``in-worker-policy.md``), in worker processes where they pay for themselves, and
  otherwise in one worker thread of this process: the *in-process* path. The cost
  model behind that choice is :func:`process_speedup`; with ``policy_lag=1``, worker
  processes with a core left to the learner (``policy-lag.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcollect.collector import checks

__all__ = [
    "KNOBS",
    "RULES",
    "Choice",
    "Figures",
    "Rule",
    "choose",
    "process_margin",
    "process_speedup",
]

#: The layout arguments the rules choose, in the order a choice shows them.
KNOBS = ("transport", "inference_backend", "envs_per_worker", "worker_splits")

# The in-process cost model's constants: the worker loop's own time per step of a worker
# and per env step (the request's bookkeeping, writing each transition into the ring),
# the driver's time per frame besides copying it, the copy's cost per byte, and the time
# a worker process takes to start (it imports torch to run the policy). Where each comes
# from: docs/decisions/defaults.md.
STEP_OVERHEAD_S = 12e-6
ENV_OVERHEAD_S = 4e-6
FRAME_OVERHEAD_S = 1e-6
COPY_S_PER_BYTE = 0.2e-9
PROCESS_START_S = 1.5
#: The least CPU the model counts on, in cores, however busy the machine.
MIN_CORES = 0.25
#: Worker processes are chosen over one worker thread where the model predicts them at
#: least this much faster (``process_margin``).
ON_POLICY_MARGIN = 1.25
OFF_POLICY_MARGIN = 1.0


@dataclass(frozen=True)
class Figures:
    """What a choice is made from: the machine, the envs, the policy, the features.

    Attributes:
        cores: cores this process may use (``checks.usable_cores``).
        free_cores: of those, what the programs of other scheduling groups left free
            while the probe ran (``checks.free_cores``; None where unknown).
        busy_beside: cores kept busy meanwhile by the other programs of this process's
            own scheduling group, which share the cores with it thread by thread.
        device: the policy's device type (``"cpu"``, ``"cuda"``, ...).
        factories: env factories (``len(env_fns)``).
        num_envs: envs in all (a vector env's sub-envs counted one by one).
        sub_envs: sub-envs of each vector env; 0 for plain envs.
        asynchronous: vector envs driven with send/recv (``batch_size < sub_envs``).
        observation_bytes: one env's observation.
        env_step_s: env 0's step, the median of a few timed steps (None: not timed,
            as for vector envs).
        forward_1_s: the policy's forward at batch 1 on its device (None: not timed).
        forward_n_s: the same at ``num_envs`` rows.
        recurrent: the policy has ``initial_state()``.
        on_policy: ``on_policy=True``.
        policy_lag: as given.
        total_frames: as given (-1: endless).
        policy_picklable: the policy (or its factory) pickles, so another process can
            run it (asked only where a rule would send it to one).
        envs_picklable: every env factory pickles, so worker processes can build them.
        server_batching: ``max_batch_size`` or ``min_batch_size`` given: batching that
            only a server does.
        replay_buffer: a replay buffer is given: a learner samples from it while the
            collection runs (in the background, with ``start()``).
        probe_seconds: what timing the env and the policy added to start-up.
    """

    cores: int
    device: str
    factories: int
    num_envs: int
    free_cores: float | None = None
    busy_beside: float | None = None
    sub_envs: int = 0
    asynchronous: bool = False
    observation_bytes: int = 0
    env_step_s: float | None = None
    forward_1_s: float | None = None
    forward_n_s: float | None = None
    recurrent: bool = False
    on_policy: bool = False
    policy_lag: int = 0
    total_frames: int = -1
    policy_picklable: bool = True
    envs_picklable: bool = True
    server_batching: bool = False
    replay_buffer: bool = False
    probe_seconds: float = 0.0

    @property
    def vector(self) -> bool:
        """The factories build vector envs."""
        return self.sub_envs > 0

    def __str__(self) -> str:
        parts = [f"{self.cores} usable cores"]
        if self.free_cores is not None:
            beside = f", {self.busy_beside:.1f} busy beside" if self.busy_beside else ""
            parts[0] += f" ({self.free_cores:.1f} free{beside})"
        parts.append(f"policy on {self.device}")
        kind = "plain"
        if self.vector:
            how = "send/recv" if self.asynchronous else "stepped whole"
            kind = f"in {self.factories} vector envs of {self.sub_envs}, {how}"
        parts.append(f"{self.num_envs} env{'s' * (self.num_envs > 1)} ({kind})")
        if self.env_step_s is not None:
            parts.append(f"env step {_us(self.env_step_s)}")
        parts.append(f"observation {self.observation_bytes:,} B")
        if self.forward_1_s is not None and self.forward_n_s is not None:
            parts.append(
                f"forward {_us(self.forward_1_s)} at batch 1, "
                f"{_us(self.forward_n_s)} at {self.num_envs}"
            )
        parts.append("recurrent" if self.recurrent else "feed-forward")
        if self.on_policy:
            parts.append(f"on-policy, policy_lag={self.policy_lag}")
        if self.total_frames != -1:
            parts.append(f"total_frames={self.total_frames:,}")
        if not self.policy_picklable:
            parts.append("the policy does not pickle")
        if not self.envs_picklable:
            parts.append("an env factory does not pickle")
        if self.server_batching:
            parts.append("server batching asked for")
        if self.replay_buffer:
            parts.append("a replay buffer")
        return ", ".join(parts)


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:,.0f} us" if seconds < 1e-2 else f"{1e3 * seconds:,.1f} ms"


# ------------------------------------------------------------------ the cost model


def _step_cost(f: Figures, envs: int) -> float:
    """Seconds one worker takes per step of ``envs`` envs: their steps, one forward
    over all of them (interpolated between the two timed batch sizes) and the loop's
    own bookkeeping."""
    assert f.env_step_s is not None and f.forward_1_s is not None and f.forward_n_s is not None
    slope = (f.forward_n_s - f.forward_1_s) / max(1, f.num_envs - 1)
    forward = f.forward_1_s + slope * (envs - 1)
    return forward + envs * (f.env_step_s + ENV_OVERHEAD_S) + STEP_OVERHEAD_S


def process_speedup(f: Figures) -> float | None:
    """How much faster worker processes (one per core, each running the policy for its
    own envs) are predicted to collect than one worker thread of this process stepping
    every env; None where the figures to say it were not measured.

    One thread steps all ``E`` envs and runs one forward over them per step, on one
    core at most, and the driver's work per frame (copying it out of the ring) shares
    its interpreter. ``W`` processes of ``E / W`` envs step in parallel, but each pays a
    forward per step: where the forward's fixed cost dominates (cheap envs, a small
    policy) they spend more CPU per frame than the one thread, which only parallel
    cores make up for. The cores that count are what the scheduler gives each
    (:func:`_share`). For a run of known length, the processes' start-up (each imports
    torch) counts too.
    """
    if f.env_step_s is None or f.forward_1_s is None or f.forward_n_s is None:
        return None
    driver = FRAME_OVERHEAD_S + COPY_S_PER_BYTE * 2 * f.observation_bytes
    one_thread = _share(f, 1) / (_step_cost(f, f.num_envs) / f.num_envs + driver)
    workers = f.factories // checks.envs_per_worker_of("auto", f.factories, f.cores)
    each = f.num_envs // workers
    processes = _share(f, workers) / (_step_cost(f, each) / each + driver)
    if f.total_frames == -1:
        return processes / one_thread
    start = PROCESS_START_S * math.ceil(workers / max(1.0, _share(f, workers)))
    return (f.total_frames / one_thread) / (f.total_frames / processes + start)


def _share(f: Figures, busy: int) -> float:
    """The cores ``busy`` CPU-bound threads of the collector get. The programs of other
    scheduling groups keep their group's time whatever the collector runs, so it has
    the cores they leave free (``free_cores``, at least ``MIN_CORES``): on a machine
    that other sessions keep busy, more processes only share the same CPU time. Within
    its own group the scheduler shares those cores thread by thread, so ``busy``
    threads beside the ``busy_beside`` cores' worth of its group's other programs get
    ``busy`` parts in ``busy + busy_beside``, and at most a core each."""
    free = f.cores if f.free_cores is None else f.free_cores
    available = min(float(f.cores), max(MIN_CORES, free))
    beside = f.busy_beside or 0.0
    return busy * min(1.0, available / (busy + beside))


def process_margin(f: Figures) -> float:
    """How much faster the processes must be predicted for the rules to take them: with
    on-policy rounds the envs wait while the learner learns, so processes gain only the
    rollout's speed and must clearly beat the one thread's instant start; off-policy
    they also step beside a learner in this process, which one thread would contend
    with for the interpreter, so a tie goes to them."""
    return ON_POLICY_MARGIN if f.on_policy else OFF_POLICY_MARGIN


# ------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Rule:
    """One row of the table: when it applies, the layout it gives, why.

    Attributes:
        name: how :class:`Choice` names it.
        applies: whether the figures call for it.
        layout: the four knobs' values (``envs_per_worker`` and ``worker_splits`` may be
            ``"auto"``, resolved by the collector's own rules for them).
        defines: the knobs the rule stands on: it applies only where the caller left
            each at ``"auto"`` or gave the rule's own value; the others it only fills.
        why: one sentence, from the figures.
    """

    name: str
    applies: Callable[[Figures], bool]
    layout: Callable[[Figures], dict[str, Any]]
    defines: tuple[str, ...]
    why: Callable[[Figures], str]


def _server(f: Figures) -> dict[str, Any]:
    transport = "process_slots" if f.envs_picklable else "thread"
    return {"transport": transport, "inference_backend": "thread", "envs_per_worker": "auto"}


def _with(backend: str, transport: str, envs_per_worker: int | str) -> Callable[[Figures], Any]:
    def layout(f: Figures) -> dict[str, Any]:
        epw = f.factories if envs_per_worker == "all" else envs_per_worker
        return {
            "transport": transport,
            "inference_backend": backend,
            "envs_per_worker": epw,
        }

    return layout


def _one_thread_pays(f: Figures) -> bool:
    # A learner sampling a replay buffer beside the collection would contend with one
    # thread for the interpreter: processes step beside it instead.
    speedup = process_speedup(f)
    plain = not f.vector and not f.replay_buffer
    return plain and speedup is not None and speedup < process_margin(f)


def _speedup_text(f: Figures) -> str:
    speedup = process_speedup(f)
    return "not measured" if speedup is None else f"{speedup:.2f}x"


RULES: tuple[Rule, ...] = (
    Rule(
        "recurrent",
        lambda f: f.recurrent,
        _server,
        ("inference_backend",),
        lambda f: (
            "a recurrent policy keeps each env's state in the server (the in-worker "
            "policy serves feed-forward policies)"
        ),
    ),
    Rule(
        "server-batching",
        lambda f: f.server_batching,
        _server,
        ("inference_backend",),
        lambda f: "max_batch_size or min_batch_size shape a server's batches",
    ),
    Rule(
        "policy-stays",
        lambda f: not f.policy_picklable,
        _server,
        ("inference_backend",),
        lambda f: "the policy cannot be pickled, so it is served in this process",
    ),
    Rule(
        "gpu-vector-send-recv",
        lambda f: f.device == "cuda" and f.asynchronous and f.envs_picklable,
        _with("worker", "process_slots", 1),
        ("inference_backend", "transport"),
        lambda f: (
            "a vector env driven with send/recv hands over batches already: its "
            "worker runs the policy on the GPU itself, as a hand-written loop would, with no "
            "hop to a server (docs/decisions/vector-env-layouts.md)"
        ),
    ),
    Rule(
        "gpu-vector",
        lambda f: f.device == "cuda" and f.vector,
        lambda f: {**_server(f), "envs_per_worker": 1},
        ("inference_backend",),
        lambda f: (
            "vector envs stepped whole: one per worker process, the server thread "
            "batching their requests (docs/decisions/vector-env-layouts.md)"
        ),
    ),
    Rule(
        "gpu-many-envs",
        lambda f: (
            f.device == "cuda" and f.num_envs >= f.cores and f.envs_picklable and f.policy_picklable
        ),
        _with("process", "process_slots", "auto"),
        ("inference_backend", "transport"),
        lambda f: (
            f"{f.num_envs} envs on {f.cores} cores: about one worker per core (two "
            "splits each where a worker has several envs), and the server in a process "
            "of its own, off this process's interpreter "
            "(docs/decisions/server-process.md)"
        ),
    ),
    Rule(
        "gpu",
        lambda f: f.device == "cuda",
        _server,
        ("inference_backend",),
        lambda f: "the server thread batches every worker's requests for the GPU",
    ),
    Rule(
        "cpu-policy-lag",
        lambda f: f.device == "cpu" and f.policy_lag == 1 and f.envs_picklable,
        lambda f: {
            "transport": "process_slots",
            "inference_backend": "worker",
            "envs_per_worker": checks.envs_per_worker_of("auto", f.factories, max(1, f.cores - 1)),
        },
        ("inference_backend", "transport"),
        lambda f: (
            "policy_lag=1 steps the envs while the learner learns: worker processes "
            "running the policy, one core fewer than there are, the learner's "
            "(docs/decisions/policy-lag.md)"
        ),
    ),
    Rule(
        "cpu-envs-stay",
        lambda f: f.device == "cpu" and not f.envs_picklable,
        _with("worker", "thread", "all"),
        ("inference_backend", "transport"),
        lambda f: (
            "an env factory cannot be pickled, so the envs step in one worker thread "
            "of this process, which runs the policy for them"
        ),
    ),
    Rule(
        "cpu-one-thread",
        lambda f: f.device == "cpu" and _one_thread_pays(f),
        _with("worker", "thread", "all"),
        ("inference_backend", "transport"),
        lambda f: (
            f"worker processes were predicted only {_speedup_text(f)} as fast as one "
            "worker thread that steps every env and runs the policy once per step for all of "
            f"them (below {process_margin(f)}x: the envs are too cheap, or the cores too "
            "busy, for a process boundary to pay)"
        ),
    ),
    Rule(
        "cpu-processes",
        lambda f: f.device == "cpu",
        _with("worker", "process_slots", "auto"),
        ("inference_backend",),
        lambda f: (
            "worker processes, about one per core, each running the policy for its own "
            f"envs (predicted {_speedup_text(f)} as fast as one worker thread; "
            "docs/decisions/in-worker-policy.md)"
        ),
    ),
    Rule(
        "server",
        lambda f: True,
        _server,
        (),
        lambda f: f"the policy runs on {f.device}: the server thread batches the requests",
    ),
)


# ------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class Choice:
    """The layout a collector runs with: what was chosen, from what, and why.

    ``str(choice)`` reads as a short report whose last line is the explicit arguments
    that ask for the same layout; :meth:`arguments` gives them as a dict.

    Attributes:
        transport: ``"process_slots"``, ``"thread"``, or the name of the given
            transport's class.
        inference_backend: ``"thread"``, ``"process"`` or ``"worker"``.
        envs_per_worker: env factories per worker.
        worker_splits: request splits per worker.
        rule: the name of the rule that chose (``"given"`` where every knob was given).
        reason: why, in one sentence.
        given: the knobs the caller set (those the rule did not choose).
        figures: what the rule read.
    """

    transport: str
    inference_backend: str
    envs_per_worker: int
    worker_splits: int
    rule: str
    reason: str
    given: tuple[str, ...]
    figures: Figures = field(repr=False)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments that ask for this layout explicitly."""
        return {knob: getattr(self, knob) for knob in KNOBS}

    def __str__(self) -> str:
        chosen = [k for k in KNOBS if k not in self.given]
        given = f"; given: {', '.join(self.given)}" if self.given else ""
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.arguments().items())
        return "\n".join(
            [
                f"layout chosen by rule {self.rule!r} ({', '.join(chosen) or 'nothing'} "
                f"chosen{given})",
                f"  why:  {self.reason}",
                f"  from: {self.figures}"
                + (f"; probing took {self.figures.probe_seconds:.2f} s" if chosen else ""),
                f"  as explicit arguments: {arguments}",
            ]
        )


def choose(f: Figures, given: Mapping[str, Any]) -> tuple[Rule, dict[str, Any]]:
    """The first rule of :data:`RULES` that applies to ``f`` and agrees with the knobs
    the caller ``given`` (a knob's value, or absent where it is ``"auto"``), and the
    layout it gives with every given knob in place. ``envs_per_worker`` and
    ``worker_splits`` may still be ``"auto"`` (the collector resolves them)."""
    if all(knob in given for knob in KNOBS):
        return _GIVEN, dict(given)
    for rule in RULES:
        if not rule.applies(f):
            continue
        layout = rule.layout(f)
        if any(knob in given and given[knob] != layout[knob] for knob in rule.defines):
            continue
        layout.setdefault("worker_splits", "auto")
        return rule, {**layout, **given}
    raise AssertionError("the last rule applies to everything")  # pragma: no cover


_GIVEN = Rule(
    "given", lambda f: True, lambda f: {}, (), lambda f: "every layout argument was given"
)
