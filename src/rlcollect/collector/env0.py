"""Where the plan builds env 0 for its probe: in the driver, or in worker 0's process.

The probe learns what every factory builds from env 0 (``probe.py``). An env that is
cheap to build is built in the driver and closed (its worker builds its own). A vector
env may take seconds to build (ale-py's ``AtariVectorEnv`` of 64 games, say): where
``env_fns[0]`` declares one (``worker/source.py``: ``declares_vector``) and worker 0
will be a process of a transport that adopts it, worker 0's process is started first
and builds env 0 where it will run (``transports/first_worker.py``), so that it is built
once. The plan owns that process until the transport adopts it as it starts
(``start.py``), and ends it if the plan fails or the layout chosen has no worker
processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlcollect.collector.choice import KNOBS
from rlcollect.collector.figures import ENV_TIMING_S, pickles
from rlcollect.collector.options import Options
from rlcollect.collector.probe import ProbedEnv, probe_env
from rlcollect.transports.base import Transport
from rlcollect.transports.first_worker import FirstWorker
from rlcollect.worker.built import BuiltFirst
from rlcollect.worker.source import declares_vector

__all__ = ["adopted", "env0_probed", "first_worker", "timing"]


def timing(given: Mapping[str, Any]) -> float:
    """Seconds of env 0's steps to time: only where a layout knob is left to the rules."""
    return ENV_TIMING_S if len(given) < len(KNOBS) else 0.0


def first_worker(
    env_fns: list[Callable[[], Any]], given: Transport | None, o: Options, time_steps: float
) -> FirstWorker | None:
    """Worker 0's process, started to build env 0, where env 0 is a declared vector env
    and worker 0 will be a process of a transport that adopts it: the ``given`` one, or
    the one the rules choose for vector envs whose factories pickle (``choice.py``)."""
    if not declares_vector(env_fns[0]):
        return None
    if not (given.adopts_first_worker if given is not None else pickles(env_fns)):
        return None
    return FirstWorker(env_fns[0], tuple(o.info_keys), time_steps)


def env0_probed(
    env_fn: Callable[[], Any], first: FirstWorker | None, o: Options, time_steps: float
) -> ProbedEnv:
    """What env 0 told: ``first``'s report, or env 0 built in the driver and closed."""
    if first is not None:
        return first.report(o.stall_timeout)
    return probe_env(env_fn, tuple(o.info_keys), o.stall_timeout, time_steps=time_steps)


def adopted(
    first: FirstWorker | None, transport: Transport, env_fns: list[Callable[[], Any]]
) -> tuple[FirstWorker | None, list[Callable[[], Any]]]:
    """``first`` and the factories worker 0 is given (its first one taking the env its
    process built: ``worker/built.py``) where ``transport`` will adopt it; else ``first``
    ended (the layout chosen has no worker processes: env 0 is built again) and the
    factories as they are."""
    if first is None:
        return None, env_fns
    if not transport.adopts_first_worker:
        first.close()
        return None, env_fns
    return first, [BuiltFirst(env_fns[0]), *env_fns[1:]]
