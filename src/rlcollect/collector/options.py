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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlcollect.collector import checks
from rlcollect.inference.backend import BACKENDS
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
# Each returns the value as the plan uses it; the messages name the argument.


def _positive_int(name: str, extra: str = "") -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        checks.check_int(name, value, minimum=1, extra=extra)
        return value

    return check


def _total_frames(value: Any) -> Any:
    if value != -1:
        checks.check_int("total_frames", value, minimum=1, extra="or -1 (endless)")
    return value


def _worker_splits(value: Any) -> Any:
    if value is not None and not checks.is_auto(value):
        checks.check_int("worker_splits", value, minimum=1, extra='or None, or "auto"')
    return value


def _flag(name: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return value

    return check


def _backend(value: Any) -> Any:
    if not checks.is_auto(value) and value not in BACKENDS:
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


def _seed(value: Any) -> Any:
    if value is not None:
        checks.check_int("seed", value, minimum=0, extra="or None")
    return value


def _max_worker_restarts(value: Any) -> Any:
    checks.check_int("max_worker_restarts", value, minimum=0)
    return value


# ------------------------------------------------------------------ the options


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every keyword argument of the collector (all but ``env_fns`` and ``policy``)."""

    policy_factory: Callable[[], torch.nn.Module] | None = _option(
        None, "instead of `policy`, a zero-argument callable that builds it"
    )
    frames_per_batch: int = field(
        metadata={
            "help": "transitions per yielded batch",
            "check": _positive_int("frames_per_batch"),
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
    )
    worker_splits: int | Literal["auto"] | None = _option(
        "auto",
        "request splits per worker (double buffering), a divisor of `envs_per_worker`; "
        'None: 1 (vector envs: one per vector env); `"auto"`: the fewest above one with '
        "the policy on a GPU",
        check=_worker_splits,
    )
    transition_chunk_size: int | str = _option(
        "auto",
        "transitions per worker message, a multiple of the envs a worker steps; "
        '`"auto"`: `frames_per_batch // num_envs` steps of each env, 1 to 64',
    )
    max_batch_size: int | None = _option(
        None, "most observations per policy call (None: every env)"
    )
    min_batch_size: int = _option(1, "observations the server waits for before a call ...")
    batch_timeout: float = _option(1e-3, "... but never longer than this many seconds")
    policy_device: str | torch.device | None = _option(
        None,
        'where the policy runs; None: `"cuda"` when available, else `"cpu"` '
        '(`"cpu"` with `inference_backend="worker"`)',
    )
    compile: bool | Mapping[str, Any] = _option(
        False, "True, or a dict of `torch.compile` options (CUDA only)"
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
        driver=True,
    )
    learning_starts: int = _option(
        0, "rows collected before the `train_ratio` wait begins", driver=True
    )
    seed: int | None = _option(
        0,
        "env `i` is first reset with `seed + i`, and the policy's random stream is seeded "
        "with it; None: unseeded",
        check=_seed,
        driver=True,
    )
    max_worker_restarts: int = _option(
        0,
        "failed workers restarted in all before an error is raised",
        check=_max_worker_restarts,
    )
    stall_timeout: float | None = _option(
        60.0,
        "seconds an env call may run, or a worker process stay stopped, before a "
        "`WorkerError`; None: no bound",
        check=checks.check_stall_timeout,
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
        check=checks.policy_lag_of,
    )

    def checked(self) -> Options:
        """These options with every value's own check passed, in field order (the value
        as the plan uses it: ``info_keys`` a tuple, ``stall_timeout`` a float)."""
        values = {}
        for f in dataclasses.fields(self):
            check = f.metadata["check"]
            value = getattr(self, f.name)
            values[f.name] = value if check is None else check(value)
        return dataclasses.replace(self, **values)

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
