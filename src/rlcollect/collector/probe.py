"""What the collector learns before it starts anything: the envs' spaces and the policy's
outputs.

It builds env 0 once in the driver (``worker/source.py`` says what it finds there), serves a
copy of the policy on its device and runs it once on two sampled observations; the ring
is then laid out from both. With ``info_keys`` env 0 is also reset and stepped once
(a sampled action), and each entry's dtype and per-env shape are read from that step's
``info``. A ``policy_factory`` is called with env 0's spaces where its signature asks for
them (``factory_takes_spaces``), and an on-policy output that would broadcast is named
(``warn_of_trailing_ones``).

Where the layout is left to the collector (``choice.py``), the probe also times what the
choice reads, within a budget of its own: a few steps of env 0 (a plain env, sampled
actions) and the policy's forward at two batch sizes, on its device, with the caller's
random streams left as they were.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from rlcollect.errors import TrailingDimensionWarning
from rlcollect.inference.policy import PolicyRunner
from rlcollect.transports.layout import Field, Path
from rlcollect.worker.env_probe import ProbedEnv, build_stalled, factory_failed, probe_built
from rlcollect.worker.source import Source
from rlcollect.worker.spec import observation_key

__all__ = [
    "ProbedEnv",
    "build_policy",
    "factory_takes_spaces",
    "observation_fields",
    "probe_env",
    "probe_policy",
    "probe_runner",
    "probe_source",
    "served_policy",
    "time_forward",
    "warn_of_trailing_ones",
]

_MOST_CALLS = 5  # timed forwards per batch size at most: a median of a few


def probe_source(env_fn: Callable[[], Any], timeout: float | None = None) -> Source:
    """Build env 0 once in the driver to learn what every factory must build."""
    return probe_env(env_fn, (), timeout).source


def probe_env(
    env_fn: Callable[[], Any],
    info_keys: tuple[str, ...],
    timeout: float | None = None,
    *,
    time_steps: float = 0.0,
) -> ProbedEnv:
    """Build env 0 once in the driver: what every factory must build, and the ring fields
    of the ``info_keys`` entries (none without ``info_keys``: the env is not stepped).

    With a ``timeout`` (the collector's ``stall_timeout``) the factory, and env 0's probe
    (its reset and steps, for ``info_keys`` and the timing), run in a thread of their
    own, so that an env that never returns is a ``WorkerError`` after that long rather
    than a constructor that never returns (the thread is left behind: a thread cannot be
    stopped).

    With ``time_steps`` (seconds) a plain env is also timed (``worker/env_probe.py``).
    """
    if timeout is None:
        return _build_and_probe(env_fn, info_keys, time_steps)
    return _within(lambda: _build_and_probe(env_fn, info_keys, time_steps), timeout)


def _build_and_probe(
    env_fn: Callable[[], Any], info_keys: tuple[str, ...], time_steps: float
) -> ProbedEnv:
    try:
        env = env_fn()
    except Exception as exc:
        raise factory_failed(exc) from exc
    try:
        return probe_built(env, info_keys, time_steps)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def _within(probe: Callable[[], ProbedEnv], timeout: float) -> ProbedEnv:
    done = threading.Event()
    result: list[ProbedEnv] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(probe())
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="rlcollect-probe-env", daemon=True).start()
    if not done.wait(timeout):
        raise build_stalled(timeout)
    if failure:
        raise failure[0]
    return result[0]


def observation_fields(space: Any) -> tuple[tuple[Path, ...], tuple[Field, ...]]:
    """The observation's leaves: their paths and their ring fields, in the same order."""
    leaves: list[tuple[Path, Any]] = []

    def walk(path: Path, sub: Any) -> None:
        if isinstance(sub, spaces.Dict):
            for name, child in sub.spaces.items():
                walk((*path, str(name)), child)
        elif isinstance(
            sub, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
        ):
            leaves.append((path, sub))
        else:
            where = "observation" + "".join(f"[{n!r}]" for n in path)
            raise TypeError(
                f"{where} space {sub} is not supported; use Box, Discrete, MultiDiscrete, "
                "MultiBinary or a Dict of those"
            )

    walk((), space)
    if not leaves:
        raise TypeError(f"observation_space {space} holds no array leaves")
    paths = tuple(path for path, _ in leaves)
    fields = tuple(
        Field(observation_key(path), tuple(sub.shape), np.dtype(sub.dtype)) for path, sub in leaves
    )
    return paths, fields


def build_policy(factory: Any) -> Any:
    try:
        return factory()
    except Exception as exc:
        raise ValueError(f"policy_factory raised: {type(exc).__name__}: {exc}") from exc


def factory_takes_spaces(factory: Callable[..., Any]) -> bool:
    """True when ``policy_factory`` builds the policy from ``(observation_space,
    action_space)``: its signature asks for two positional arguments; False when it asks
    for none (a signature that cannot be read counts as none).

    Raises:
        TypeError: it asks for another number of arguments, or for keyword-only ones.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and (p.kind in positional or p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]
    if not required:
        return False
    keyword_only = any(
        p.kind is inspect.Parameter.KEYWORD_ONLY
        for p in signature.parameters.values()
        if p.name in required
    )
    if len(required) != 2 or keyword_only:
        raise TypeError(
            "policy_factory must take no argument, or two positional ones "
            f"(observation_space, action_space); it requires {required}"
        )
    return True


def served_policy(policy: Any, device: torch.device, *, own: bool) -> torch.nn.Module:
    """The policy to serve on ``device``: a deep copy of the caller's, or ``policy``
    itself when the collector built it (``own``)."""
    what = "policy_factory() returned" if own else "policy must be"
    if not isinstance(policy, torch.nn.Module):
        raise TypeError(
            f"{what} a torch.nn.Module or a TensorDictModule, got {type(policy).__name__}"
        )
    if not own:
        try:
            policy = copy.deepcopy(policy)
        except Exception as exc:
            raise TypeError(
                f"the policy cannot be copied for serving ({type(exc).__name__}: {exc}); "
                "pass policy_factory= instead"
            ) from exc
    served: torch.nn.Module = policy.to(device)
    served.requires_grad_(False)
    return served


def probe_runner(
    policy: torch.nn.Module,
    device: torch.device,
    paths: tuple[Path, ...],
    exploration_type: str = "random",
) -> PolicyRunner:
    """The runner of the served policy; a recurrent one's ``initial_state()`` is called
    and checked here (a ``TypeError`` or ``ValueError`` naming what is wrong), and an
    exploration type for evaluation is refused for a plain module, which would ignore it."""
    runner = PolicyRunner(
        policy, device=device, observation_paths=paths, exploration_type=exploration_type
    )
    if runner.exploration_type != "random" and not runner.tensordict_policy:
        raise ValueError(
            f"exploration_type={runner.exploration_type!r} sets how a TensorDictModule "
            f"acts; this policy is a plain {type(policy).__name__}, which draws its own "
            "noise: make its forward deterministic instead (and leave exploration_type "
            "at 'random')"
        )
    return runner


def probe_policy(
    runner: PolicyRunner, space: Any, paths: tuple[Path, ...]
) -> dict[tuple[str, ...], torch.Tensor]:
    """Run the policy once on two sampled observations to learn its outputs (a recurrent
    one from its initial state, its new state checked against it)."""
    space.seed(0)
    samples = [space.sample(), space.sample()]
    batch: dict[Path, np.ndarray] = {}
    for path in paths:
        leaves = []
        for sample in samples:
            value = sample
            for name in path:
                value = value[name]
            leaves.append(np.asarray(value))
        batch[path] = np.stack(leaves)
    try:
        return runner(batch)
    except Exception as exc:
        shapes = ", ".join(
            f"{observation_key(path)}: {tuple(arr.shape)} {arr.dtype}"
            for path, arr in batch.items()
        )
        raise ValueError(
            f"the policy failed on a batch of 2 sampled observations ({shapes}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def warn_of_trailing_ones(outputs: Sequence[Field]) -> None:
    """A :class:`~rlcollect.errors.TrailingDimensionWarning` for each on-policy output
    of one value per step held in a trailing dimension of 1 (the action excepted: its
    shape is the action space's)."""
    for f in outputs:
        if f.shape == (1,):
            name = "/".join(f.key)
            warnings.warn(
                f"policy output {name!r} has shape [B, 1]: on-policy batches hold it as "
                f"[num_envs, T, 1], which broadcasts against [num_envs, T] rewards and done "
                f"flags (a GAE of [num_envs, T, T]); return {name}.squeeze(-1) from forward, "
                "or filter rlcollect.errors.TrailingDimensionWarning if the dimension is meant",
                TrailingDimensionWarning,
                stacklevel=5,
            )


def time_forward(
    runner: PolicyRunner, space: Any, paths: tuple[Path, ...], batch: int, budget: float
) -> float | None:
    """The policy's forward at ``batch`` rows on its device: the median of a few timed
    calls (at most ``_MOST_CALLS``, for about ``budget`` seconds) after one untimed call
    at that size; a CUDA device is synchronised after each. The caller's random streams
    (this device's and the CPU's) are left as they were; None if a call raises (the
    probe's own call has checked the policy already)."""
    space.seed(1)
    sample = space.sample()
    observations: dict[Path, np.ndarray] = {}
    for path in paths:
        value = sample
        for name in path:
            value = value[name]
        leaf = np.asarray(value)
        observations[path] = np.repeat(leaf[None], batch, axis=0)
    cuda = runner.device.type == "cuda"
    devices = [runner.device] if cuda else []
    calls: list[float] = []
    with torch.random.fork_rng(devices=devices):
        try:
            runner(observations)
            deadline = time.perf_counter() + budget
            while len(calls) < _MOST_CALLS and time.perf_counter() < deadline:
                start = time.perf_counter()
                runner(observations)
                if cuda:
                    torch.cuda.synchronize(runner.device)
                calls.append(time.perf_counter() - start)
        except Exception:
            return None
    return statistics.median(calls) if calls else None
