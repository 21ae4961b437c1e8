"""What an env factory builds, and how a worker drives it.

A factory in ``env_fns`` returns either one ``gymnasium.Env`` or a
``gymnasium.vector.VectorEnv`` of ``n`` sub-envs, each of which is a collector env.
:func:`describe` reads what a worker needs to know from the object itself, once, when
it is built (in the driver for ``env_fns[0]``, and in each worker for its own), so that
the worker loop never asks again:

* the single-env observation and action spaces;
* for a vector env: its number of sub-envs, its autoreset mode (gymnasium's
  ``metadata["autoreset_mode"]``; ``NextStep`` where absent, gymnasium 1.0's only mode),
  and its ``batch_size``: a vector env with ``send``/``recv`` and
  ``batch_size < num_envs`` (ale-py's ``AtariVectorEnv``, EnvPool's pools) is driven
  asynchronously — each ``recv`` returns the first ``batch_size`` sub-envs to finish,
  named by ``info["env_id"]``. Any other vector env is stepped whole;
* whether it follows EnvPool's protocol (:func:`envpool_batch_size`): its batch size is
  ``config["batch_size"]`` (0: every sub-env), it resets with ``async_reset`` and
  ``recv``, and ``send`` is given the sub-envs its actions are for.

:func:`declares_vector` tells, without calling a factory, whether it says it builds a
vector env: the plan then builds env 0 where it will run, in worker 0's process
(``transports/first_worker.py``), rather than once in the driver and again in the worker.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

__all__ = ["Source", "declares_vector", "describe", "envpool_batch_size"]


@dataclass(frozen=True)
class Source:
    """What one env factory contributes to a collector.

    ``sub_envs`` is 0 for a plain env and ``n`` for a vector env of ``n`` sub-envs;
    ``batch_size`` is how many sub-envs one result holds (``n`` unless it is driven
    asynchronously); ``autoreset`` is the vector env's ``AutoresetMode`` (None for a
    plain env); ``envpool``: the vector env follows EnvPool's protocol.
    """

    observation_space: Any
    action_space: Any
    sub_envs: int = 0
    batch_size: int = 1
    autoreset: AutoresetMode | None = None
    envpool: bool = False

    @property
    def vector(self) -> bool:
        """True for a vector env."""
        return self.sub_envs > 0

    @property
    def envs(self) -> int:
        """Collector envs this factory contributes."""
        return max(1, self.sub_envs)

    @property
    def asynchronous(self) -> bool:
        """True when driven with ``send``/``recv``, ``batch_size`` sub-envs at a time."""
        return self.batch_size < self.sub_envs


def describe(env: Any, name: str) -> Source:
    """Describe ``env`` (built by the factory called ``name`` in messages).

    Raises:
        TypeError: ``env`` is neither a gymnasium env nor a vector env.
        ValueError: a vector env that cannot be driven as it is configured.
    """
    if isinstance(env, VectorEnv):
        return _describe_vector(env, name)
    obs_space = getattr(env, "observation_space", None)
    act_space = getattr(env, "action_space", None)
    if not isinstance(obs_space, spaces.Space) or not isinstance(act_space, spaces.Space):
        raise TypeError(
            f"{name} returned an object without gymnasium observation_space and "
            f"action_space: {type(env).__name__}"
        )
    return Source(obs_space, act_space)


def _describe_vector(env: VectorEnv, name: str) -> Source:
    n = env.num_envs
    if not isinstance(n, int) or n < 1:
        raise TypeError(f"{name} returned a vector env with num_envs={n!r}")
    obs_space = env.single_observation_space
    act_space = env.single_action_space
    if not isinstance(obs_space, spaces.Space) or not isinstance(act_space, spaces.Space):
        raise TypeError(
            f"{name} returned a vector env without gymnasium single_observation_space and "
            f"single_action_space: {type(env).__name__}"
        )
    mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
    pool_batch = envpool_batch_size(env)
    batch = getattr(env, "batch_size", n) if pool_batch is None else pool_batch
    if not isinstance(batch, int) or not 1 <= batch <= n:
        raise ValueError(
            f"{name} returned a vector env with batch_size={batch!r}; it must be an int "
            f"from 1 to num_envs={n}"
        )
    if batch < n:
        if not (callable(getattr(env, "send", None)) and callable(getattr(env, "recv", None))):
            raise ValueError(
                f"{name} returned a vector env with batch_size={batch} < num_envs={n} but "
                "without send() and recv(); rlcollect drives such envs with send/recv"
            )
        if mode is AutoresetMode.DISABLED:
            raise ValueError(
                f"{name} returned a vector env driven asynchronously (batch_size={batch} < "
                f"num_envs={n}) with autoreset mode {mode.value}: its finished sub-envs "
                "cannot be reset while the others step; use NextStep or SameStep"
            )
    return Source(
        obs_space,
        act_space,
        sub_envs=n,
        batch_size=batch,
        autoreset=mode,
        envpool=pool_batch is not None,
    )


def envpool_batch_size(env: Any) -> int | None:
    """The batch size of a vector env that follows EnvPool's protocol, else None.

    EnvPool's pools (``envpool.make(..., env_type="gymnasium")``) hold their batch size
    in ``config["batch_size"]`` (0: every sub-env), not in an attribute; they reset with
    ``async_reset`` followed by ``recv`` (their ``reset`` takes no seed: a pool's seeds
    are fixed when it is built), and their ``send`` must be given the sub-envs the
    actions are for (without them it sends to every sub-env). Recognised by that
    protocol, not by type, so that rlcollect needs no EnvPool to run.
    """
    config = getattr(env, "config", None)
    if not (isinstance(config, dict) and callable(getattr(env, "async_reset", None))):
        return None
    batch = config.get("batch_size")
    if not isinstance(batch, int) or isinstance(batch, bool):
        return None
    return batch if batch != 0 else int(env.num_envs)


def declares_vector(fn: Any) -> bool:
    """Whether the factory ``fn`` says, without being called, that it builds a vector env:
    it is a ``VectorEnv`` class (ale-py's ``AtariVectorEnv``, gymnasium's
    ``SyncVectorEnv``), or a function whose return annotation names one
    (``gymnasium.make_vec``, a ``def make() -> gym.vector.VectorEnv``), or a
    ``functools.partial`` of either. An annotation that cannot be evaluated counts by
    its name's last part (``"...VectorEnv"``). Only where the env is built depends on
    it, never what the collector does with it: a factory that says so wrongly still
    works (``describe`` reads what it built).
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, type):
        return issubclass(fn, VectorEnv)
    try:
        annotation = inspect.signature(fn, eval_str=True).return_annotation
    except Exception:  # a name the annotation's module does not define, say
        try:
            annotation = inspect.signature(fn).return_annotation
        except (TypeError, ValueError):
            return False
    if isinstance(annotation, str):
        return annotation.strip("'\" ").rsplit(".", 1)[-1].endswith("VectorEnv")
    return isinstance(annotation, type) and issubclass(annotation, VectorEnv)
