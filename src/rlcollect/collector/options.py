"""The collector's keyword arguments, defined once.

Each keyword argument of :class:`~rlcollect.AsyncBatchedCollector` is one field of
:class:`Options`: its type, its default, the check its value alone must pass, a one-line
help and whether a ``RayCollector`` keeps it in the driver. Everything else derives from
it:

* the collector's signature repeats the fields for editors and type checkers, and
  ``tests/collector/test_options.py`` holds the two together (names, order, defaults,
  types);
* the plan (``plan.py``) reads a checked :class:`Options` and checks what only several
  values together, the env or the policy can tell;
* ``RayCollector`` keeps the fields marked ``driver`` and hands the rest to its actors;
* ``docs/arguments.md`` is :func:`arguments_table`, written by ``python docs/arguments.py``
  and held to it by the same test.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlcollect.collector import checks, values
from rlcollect.inference.backend import BACKENDS
from rlcollect.inference.policy import exploration_type_of
from rlcollect.replay.sink import SupportsExtend
from rlcollect.transports.base import Transport

__all__ = ["Options", "arguments_table", "driver_options"]


def _option(
    default: Any, text: str, *, check: Callable[[Any], Any] | None = None, driver: bool = False
) -> Any:
    """A field: its default, its one-line help, the check of its value alone, and whether
    a ``RayCollector`` keeps it in the driver."""
    return field(default=default, metadata={"help": text, "check": check, "driver": driver})


# ------------------------------------------------------------------ checks of one value
# Each returns the value as the plan uses it (Python ints and floats: ``values.py`` has
# the one rule they follow); the messages name the argument.


def _count(name: str, *, minimum: int = 1, extra: str = "") -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        return values.check_int(name, value, minimum=minimum, extra=extra)

    return check


def _total_frames(value: Any) -> Any:
    if values.is_int(value) and value == -1:
        return -1
    return values.check_int("total_frames", value, minimum=1, extra="or -1 (endless)")


def _auto_or_count(name: str, extra: str, *, none: bool = False) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if (none and value is None) or values.is_auto(value):
            return value
        return values.check_int(name, value, minimum=1, extra=extra)

    return check


def _max_batch_size(value: Any) -> Any:
    return None if value is None else values.batch_size_of("max_batch_size", value)


def _flag(name: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not values.is_flag(value):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return bool(value)

    return check


def _compile(value: Any) -> Any:
    return bool(value) if values.is_flag(value) else value  # a dict: checks.py's


def _backend(value: Any) -> Any:
    if not values.is_auto(value) and value not in BACKENDS:
        raise ValueError(
            f'inference_backend must be one of {list(BACKENDS)} or "auto", got {value!r}'
        )
    return value


def _replay_buffer(value: Any) -> Any:
    if value is not None and not callable(getattr(value, "extend", None)):
        raise TypeError(
            f"replay_buffer must have an extend(tensordict) method; got {type(value).__name__}"
        )
    return value


def _train_ratio(value: Any) -> Any:
    # Checked with its buffer by checks.throttle_of (RayCollector's driver too).
    return float(value) if values.is_real(value) else value


# ------------------------------------------------------------------ the options


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every keyword argument of the collector (all but ``env_fns`` and ``policy``)."""

    policy_factory: Callable[..., torch.nn.Module] | None = _option(
        None,
        "instead of `policy`, a callable that builds it: with no argument, or from "
        "`(observation_space, action_space)` (one env's)",
    )
    frames_per_batch: int = field(
        metadata={
            "help": "transitions per yielded batch",
            "check": _count("frames_per_batch"),
            "driver": False,
        }
    )
    total_frames: int = _option(
        -1, "transitions in all, or -1 to collect until `shutdown()`", check=_total_frames
    )
    transport: Literal["auto", "thread", "process_slots"] | Transport = _option(
        "auto",
        '`"process_slots"`, `"thread"`, or a `Transport` instance (for this collector only); '
        '`"auto"`: chosen with the other layout arguments (`describe()`)',
    )
    envs_per_worker: int | Literal["auto"] = _option(
        "auto",
        "env factories per worker, a divisor of `len(env_fns)`; "
        '`"auto"`: chosen with the other layout arguments (`describe()`)',
        check=_auto_or_count("envs_per_worker", 'or "auto"'),
    )
    worker_splits: int | Literal["auto"] | None = _option(
        "auto",
        "request splits per worker (double buffering), a divisor of `envs_per_worker`; "
        'None: 1 (vector envs: one per vector env); `"auto"`: the fewest above one with '
        "the policy on a GPU",
        check=_auto_or_count("worker_splits", 'or None, or "auto"', none=True),
    )
    transition_chunk_size: int | str = _option(
        "auto",
        "transitions per worker message, a multiple of the envs a worker steps; "
        '`"auto"`: a batch\'s steps of each env (`frames_per_batch // num_envs`, fewer where '
        "`total_frames` is smaller), 1 to 64 (worker threads: up to 8 MiB a chunk)",
        check=values.transition_chunk_size_of,
    )
    max_batch_size: int | None = _option(
        None, "most observations per policy call (None: every env)", check=_max_batch_size
    )
    min_batch_size: int = _option(
        1,
        "observations the server waits for before a call ...",
        check=functools.partial(values.batch_size_of, "min_batch_size"),
    )
    batch_timeout: float = _option(
        1e-3, "... but never longer than this many seconds", check=values.batch_timeout_of
    )
    policy_device: str | torch.device | None = _option(
        None,
        'where the policy runs; None: `"cuda"` when available, else `"cpu"` '
        '(`"cpu"` with `inference_backend="worker"`)',
    )
    compile: bool | Mapping[str, Any] = _option(
        False, "True, or a dict of `torch.compile` options (CUDA only)", check=_compile
    )
    cuda_graph: bool = _option(
        False,
        "capture the action step as a CUDA graph per padded batch size (CUDA only)",
        check=_flag("cuda_graph"),
    )
    inference_backend: Literal["auto", "thread", "process", "worker"] = _option(
        "auto",
        '`"thread"` (a thread of this process), `"process"` (a process of its own), '
        '`"worker"` (each env worker runs the policy on its own envs), or `"auto"`: '
        "chosen with the other layout arguments (`describe()`)",
        check=_backend,
    )
    replay_buffer: SupportsExtend | None = _option(
        None,
        "anything with `.extend(tensordict)`: every batch goes there once, before it is "
        "yielded; needed by `start()`",
        check=_replay_buffer,
        driver=True,
    )
    train_ratio: float | None = _option(
        None,
        "rows the learner samples per row collected: collection waits for the learner",
        check=_train_ratio,
        driver=True,
    )
    learning_starts: int = _option(
        0,
        "rows collected before the `train_ratio` wait begins",
        check=_count("learning_starts", minimum=0),
        driver=True,
    )
    seed: int | None = _option(
        0,
        "env `i` is first reset with `seed + i`, and the policy's random stream is seeded "
        "with it; None: unseeded",
        check=values.seed_of,
        driver=True,
    )
    max_worker_restarts: int = _option(
        0,
        "failed workers restarted in all before an error is raised",
        check=_count("max_worker_restarts", minimum=0),
    )
    stall_timeout: float | None = _option(
        60.0,
        "seconds an env call or a policy call may run, or a worker process stay stopped, "
        "before a `WorkerError` (`InferenceError` for the server's policy call); None (or "
        "`inf`): no bound",
        check=values.check_stall_timeout,
    )
    store_recurrent_state: bool = _option(
        True,
        "a recurrent policy's transitions carry `recurrent_state`, the state each action "
        "was computed from",
        check=_flag("store_recurrent_state"),
    )
    on_policy: bool = _option(
        False,
        "batches of `[num_envs, T]`, every action computed with the weights current when "
        "the batch was asked for",
        check=_flag("on_policy"),
    )
    info_keys: Sequence[str] = _option(
        (),
        'numeric `info` entries carried as `("next", "info", name)`',
        check=checks.info_keys_of,
    )
    policy_lag: int = _option(
        0,
        "with `on_policy=True`, 1 collects the next batch while the learner learns on this one",
        check=values.policy_lag_of,
    )
    time_major: bool = _option(
        False,
        "with `on_policy=True`, batches of `[T, num_envs]` (CleanRL's layout) instead of "
        "`[num_envs, T]`",
        check=_flag("time_major"),
    )
    exploration_type: str = _option(
        "random",
        'what a `TensorDictModule` policy acts under: `"random"` (samples, as TorchRL\'s '
        'collectors), or `"deterministic"`, `"mode"`, `"mean"` for evaluation',
        check=exploration_type_of,
    )

    def checked(self) -> Options:
        """These options with every value's own check passed, in field order (the value
        as the plan uses it: ``info_keys`` a tuple, counts Python ints, ``stall_timeout``
        a float or None)."""
        checked = {}
        for f in dataclasses.fields(self):
            check = f.metadata["check"]
            value = getattr(self, f.name)
            checked[f.name] = value if check is None else check(value)
        return dataclasses.replace(self, **checked)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Options:
        """The options among ``arguments`` (a call's ``locals()``: other names are left)."""
        return cls(**{name: arguments[name] for name in _names() if name in arguments})


def _names() -> Iterator[str]:
    return (f.name for f in dataclasses.fields(Options))


def driver_options() -> frozenset[str]:
    """The options a ``RayCollector`` keeps in the driver rather than handing to its
    actors: the replay buffer and its throttle, and the seed (each actor gets its own)."""
    return frozenset(f.name for f in dataclasses.fields(Options) if f.metadata["driver"])


def arguments_table() -> str:
    """The Markdown table of ``docs/arguments.md``: each option, its default, its help."""
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Options):
        default = "required" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
        if isinstance(f.default, str):
            default = f'`"{f.default}"`'
        text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default} | {text} |")
    return "\n".join(rows) + "\n"
