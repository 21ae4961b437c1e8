"""The one error vocabulary of rlcollect.

Every failure that reaches the caller is a :class:`CollectorError`. A failure that
happened somewhere else (a worker process, the inference thread) carries the remote
traceback as its ``__cause__``, in the manner of ``concurrent.futures``.

Which exception types rlcollect raises, by one rule:

* Something failed while running (an env, a worker, the policy, the inference server):
  :class:`WorkerError` or :class:`InferenceError` (:class:`CollectorError` itself where
  no collector is involved: an env failing in ``rlcollect.envspeed.env_throughput``).
* An object used in the wrong state (a transport started twice or restarted once
  closed, a replay buffer given two writers, a collector iterated after shutdown or
  while it collects in the background): :class:`CollectorError` itself. It subclasses
  ``RuntimeError``, so ``except RuntimeError`` still catches it.
* A bad argument, found by looking at the argument alone (a size that is not a
  positive int, an unpicklable env factory, weights with missing keys or another
  shape): the standard ``TypeError``, ``ValueError`` or ``KeyError``, whose message
  names the argument and what is wrong with it; nothing has changed when it is raised.

Two exceptions to the rule, by design: :class:`ChannelClosed` is a transport's internal
signal to its workers and never reaches a collector's caller, and the conformance
checks of :mod:`rlcollect.testing` fail with ``AssertionError``, as test code does.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ChannelClosed",
    "CollectorError",
    "EnvError",
    "InferenceError",
    "RemoteTraceback",
    "TrailingDimensionWarning",
    "WorkerError",
    "WorkerFailure",
    "WorkerRestartWarning",
]


class CollectorError(RuntimeError):
    """Base class of every error rlcollect raises while collecting.

    Raised as itself for an object used in the wrong state: a collector iterated or
    given weights after shutdown, iterated while paused or collecting in the
    background, a pause that is not reached in time; a transport started twice, or
    restarting a worker when it is not running; a :class:`~rlcollect.ReplayBuffer`
    written from two threads at once. Its subclasses :class:`WorkerError` and
    :class:`InferenceError` say where a failure happened. Arguments that are wrong from
    the start are ``TypeError``, ``ValueError`` or ``KeyError`` instead (see the rule in
    this module's documentation).

    Examples:
        >>> from rlcollect.errors import CollectorError, InferenceError, WorkerError
        >>> issubclass(WorkerError, CollectorError), issubclass(InferenceError, CollectorError)
        (True, True)
        >>> issubclass(CollectorError, RuntimeError)
        True
    """


class RemoteTraceback(Exception):
    """Holds a traceback formatted in another thread or process; used as ``__cause__``.

    Args:
        tb: the formatted traceback (``traceback.format_exception`` joined).

    Examples:
        >>> from rlcollect.errors import RemoteTraceback
        >>> cause = RemoteTraceback("Traceback (most recent call last): ...")
        >>> cause.tb
        'Traceback (most recent call last): ...'
        >>> cause.tb in str(cause)  # shown below the error it caused, as a quoted block
        True
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


@dataclass(frozen=True, kw_only=True)
class WorkerFailure:
    """What a worker reports when it fails; plain strings so it crosses any process boundary.

    ``env_index`` is the collector-wide index of the env that raised, or -1 when the
    failure was not inside one env (the worker itself, or an env factory that could not
    be unpickled). A transport carries it from the worker to the driver, where
    :meth:`WorkerError.from_failure` turns it into the error the caller sees.

    Args:
        worker_index: the worker that failed.
        env_index: the env that raised, or -1.
        exc_type: the exception's class name.
        message: the exception's message.
        traceback: the formatted remote traceback.

    Examples:
        >>> from rlcollect.errors import WorkerFailure
        >>> failure = WorkerFailure(
        ...     worker_index=0,
        ...     env_index=3,
        ...     exc_type="ValueError",
        ...     message="bad action",
        ...     traceback="Traceback ...",
        ... )
        >>> failure.env_index, failure.exc_type
        (3, 'ValueError')
    """

    worker_index: int
    env_index: int
    exc_type: str
    message: str
    traceback: str


class WorkerError(CollectorError):
    """A worker failed: an env raised, or the worker process died.

    ``worker_index`` and ``env_index`` name where (``env_index`` is -1 when no single
    env was at fault); the remote traceback is the ``__cause__``.

    Args:
        message: what happened, naming the env or worker.
        worker_index: the worker that failed.
        env_index: the env that raised, or -1 when no single env was at fault.

    Examples:
        How a collector reports an env that raised (see
        :class:`~rlcollect.collector.collector.AsyncBatchedCollector` for one caught
        from a live collector):

        >>> from rlcollect.errors import WorkerError, WorkerFailure
        >>> failure = WorkerFailure(
        ...     worker_index=1,
        ...     env_index=3,
        ...     exc_type="ValueError",
        ...     message="bad action",
        ...     traceback="Traceback ...",
        ... )
        >>> error = WorkerError.from_failure(failure)
        >>> print(error)
        env 3 (worker 1) raised ValueError: bad action
        >>> error.worker_index, error.env_index, type(error.__cause__).__name__
        (1, 3, 'RemoteTraceback')
    """

    def __init__(self, message: str, *, worker_index: int, env_index: int = -1) -> None:
        super().__init__(message)
        self.worker_index = worker_index
        self.env_index = env_index

    @classmethod
    def from_failure(cls, failure: WorkerFailure) -> WorkerError:
        """The error the caller sees for ``failure``, its traceback as ``__cause__``.

        Args:
            failure: what the worker reported.

        Returns:
            A :class:`WorkerError` whose message names the env (or only the worker when
            ``env_index`` is -1) and the remote exception.

        Examples:
            >>> from rlcollect.errors import WorkerError, WorkerFailure
            >>> failure = WorkerFailure(
            ...     worker_index=2,
            ...     env_index=-1,
            ...     exc_type="EOFError",
            ...     message="pipe closed",
            ...     traceback="",
            ... )
            >>> print(WorkerError.from_failure(failure))
            worker 2 raised EOFError: pipe closed
        """
        where = f"worker {failure.worker_index}"
        if failure.env_index >= 0:
            where = f"env {failure.env_index} (worker {failure.worker_index})"
        err = cls(
            f"{where} raised {failure.exc_type}: {failure.message}",
            worker_index=failure.worker_index,
            env_index=failure.env_index,
        )
        err.__cause__ = RemoteTraceback(failure.traceback)
        return err


class WorkerRestartWarning(RuntimeWarning):
    """A crashed worker was restarted (``max_worker_restarts``); the message names the
    worker, its envs, the cause and how many restarts the collector has made.

    Examples:
        >>> import warnings
        >>> from rlcollect.errors import WorkerRestartWarning
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("worker 1 (envs [1]) restarted", WorkerRestartWarning)
        >>> issubclass(caught[0].category, RuntimeWarning)
        True
    """


class TrailingDimensionWarning(UserWarning):
    """An on-policy policy output holds one value per env step in a trailing dimension
    of 1 (a ``[B, 1]`` value head): batches hold it as ``[num_envs, T, 1]``, which
    broadcasts silently against the ``[num_envs, T]`` rewards and done flags of a
    hand-written GAE (``[num_envs, T, T]`` advantages). Raised at construction, for a
    plain ``nn.Module`` (a ``TensorDictModule`` keeps TorchRL's ``[*, 1]`` convention);
    the message names the output. Squeeze it in ``forward`` (``value.squeeze(-1)``), or
    filter the warning where the dimension is meant.

    Examples:
        >>> import warnings
        >>> from rlcollect.errors import TrailingDimensionWarning
        >>> warnings.filterwarnings("ignore", category=TrailingDimensionWarning)  # meant
        >>> issubclass(TrailingDimensionWarning, UserWarning)
        True
    """


class InferenceError(CollectorError):
    """The inference server failed: the policy raised or returned something unusable.

    The exception the policy raised is the ``__cause__``. A policy that fails on the
    collector's probe batch at construction is a ``ValueError`` instead.

    Examples:
        >>> import functools
        >>> import gymnasium as gym
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector, InferenceError
        >>> class Policy(torch.nn.Module):  # raises once its "broken" buffer is set
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("broken", torch.tensor(False))
        ...     def forward(self, observation):
        ...         if self.broken:
        ...             raise RuntimeError("NaN in the logits")
        ...         return torch.zeros(len(observation), dtype=torch.int64)
        >>> try:
        ...     with AsyncBatchedCollector(
        ...         [functools.partial(gym.make, "CartPole-v1")] * 2,
        ...         Policy(),
        ...         frames_per_batch=16,
        ...         transport="thread",
        ...         inference_backend="thread",  # the server (not the envs' workers) runs it
        ...         policy_device="cpu",
        ...     ) as collector:
        ...         _ = collector.update_policy_weights_({"broken": torch.tensor(True)})
        ...         for batch in collector:
        ...             pass
        ... except InferenceError as error:
        ...     print(error, "|", type(error.__cause__).__name__)
        the inference server failed: RuntimeError: NaN in the logits | RuntimeError
    """


class ChannelClosed(Exception):
    """A transport endpoint was closed (shutdown, or the other side died).

    Raised by transport waits so that no wait can outlive the collector; the worker loop
    treats it as the signal to exit quietly. It never reaches the caller of a collector.

    Examples:
        >>> from rlcollect.errors import ChannelClosed
        >>> from rlcollect.testing import counting_layout, counting_programs
        >>> from rlcollect.transports import ThreadQueueTransport
        >>> layout = counting_layout(num_workers=1, columns=1, chunk_steps=2, slots=2)
        >>> transport = ThreadQueueTransport()
        >>> end = transport.start(layout, counting_programs(layout))
        >>> end.abort()
        >>> try:
        ...     end.wait_requests(10.0)
        ... except ChannelClosed:
        ...     print("closed")
        closed
        >>> transport.close()
    """


class EnvError(Exception):
    """Raised inside a worker when the env ``env_index`` raised; the original is ``__cause__``.

    Transports turn it into a :class:`WorkerFailure` that names the env and carries the
    env's own exception and traceback.

    Args:
        env_index: the collector-wide index of the env that raised.
        during: what the worker was doing with it (``"step"``, ``"reset"``, ...).

    Examples:
        >>> from rlcollect.errors import EnvError
        >>> from rlcollect.transports import failure_from_exception
        >>> try:
        ...     try:
        ...         raise ValueError("bad action")
        ...     except ValueError as exc:
        ...         raise EnvError(5, "step") from exc
        ... except EnvError as error:
        ...     failure = failure_from_exception(2, error)
        >>> failure.env_index, failure.exc_type, failure.message
        (5, 'ValueError', 'bad action (during step)')
    """

    def __init__(self, env_index: int, during: str) -> None:
        super().__init__(f"env {env_index} raised during {during}")
        self.env_index = env_index
        self.during = during
