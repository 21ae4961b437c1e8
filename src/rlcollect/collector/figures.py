"""The figures a layout is chosen from, measured, and the choice resolved.

The plan (``plan.py``) builds env 0 and calls the policy once whatever the layout; where
a layout knob is left at ``"auto"`` it also times them (``probe.py``: env 0's steps
while it is built, the policy's forward here), reads what else the rules ask for (the
cores, what pickles) and hands the :class:`~rlcollect.collector.choice.Figures` to the
rule table (``choice.py``). :func:`choose_layout` returns the
:class:`~rlcollect.collector.choice.Choice` with every knob a number or a name: what the
collector runs with and what ``describe()`` shows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle
import numpy as np
import torch

from rlcollect.collector import checks, values
from rlcollect.collector.choice import KNOBS, Choice, Figures, choose
from rlcollect.collector.options import Options
from rlcollect.collector.probe import ProbedEnv, observation_fields, time_forward
from rlcollect.inference.backend import backend_kind
from rlcollect.inference.policy import PolicyRunner
from rlcollect.transports.base import Transport
from rlcollect.transports.layout import Path

__all__ = ["ENV_TIMING_S", "FORWARD_TIMING_S", "choose_layout", "pickles"]

#: Seconds of start-up the probe spends stepping env 0 to time it (its reset included).
ENV_TIMING_S = 0.1
#: Seconds it may spend timing the policy's forward, at each of two batch sizes (after
#: one untimed call at each).
FORWARD_TIMING_S = 0.05


def choose_layout(
    env_fns: list[Callable[[], Any]],
    policy_source: Any,
    o: Options,
    given: Mapping[str, Any],
    device: torch.device,
    env0: ProbedEnv,
    runner: PolicyRunner,
    paths: tuple[Path, ...],
    load: checks.CpuSample | None,
) -> Choice:
    """The layout the collector runs with: the knobs ``given`` (checked, a transport
    given as an instance among them), the others chosen by the rules from the figures
    measured here and by the probe; ``load`` is a ``checks.cpu_sample`` taken before the
    probe, so that the cores other programs keep busy are measured over it.

    Raises:
        ValueError: a given ``worker_splits`` that does not divide the
            ``envs_per_worker`` chosen for it.
    """
    started = time.perf_counter()
    source = env0.source
    num_envs = len(env_fns) * source.envs
    choosing = len(given) < len(KNOBS)
    forward_1 = forward_n = None
    if choosing and runner.initial_state is None:  # a recurrent policy is never timed
        space = source.observation_space
        forward_1 = time_forward(runner, space, paths, 1, FORWARD_TIMING_S)
        forward_n = forward_1
        if num_envs > 1:
            forward_n = time_forward(runner, space, paths, num_envs, FORWARD_TIMING_S)
    cores = checks.usable_cores()
    free, beside = checks.free_cores(load, cores) if choosing else (None, None)
    named = dict(given)
    if isinstance(named.get("transport"), Transport):
        named["transport"] = checks.transport_name(named["transport"])
    _, obs_fields = observation_fields(source.observation_space)
    figures = Figures(
        cores=cores,
        free_cores=free,
        busy_beside=beside,
        device=device.type,
        factories=len(env_fns),
        num_envs=num_envs,
        sub_envs=source.sub_envs,
        asynchronous=source.asynchronous,
        observation_bytes=sum(int(np.prod(f.shape)) * f.dtype.itemsize for f in obs_fields),
        env_step_s=env0.step_seconds,
        forward_1_s=forward_1,
        forward_n_s=forward_n,
        recurrent=runner.initial_state is not None,
        on_policy=o.on_policy,
        policy_lag=o.policy_lag,
        total_frames=o.total_frames,
        # Only what a rule could still choose is asked: a given backend or transport
        # was checked against its needs before the probe. Whether the policy pickles
        # is asked only of a choice that sends it to another process (below): pickling
        # a policy copies its weights.
        envs_picklable="transport" in named or pickles(env_fns),
        server_batching=o.max_batch_size is not None or o.min_batch_size != 1,
        replay_buffer=o.replay_buffer is not None,
    )
    rule, layout = choose(figures, named)
    travels = backend_kind(layout["inference_backend"]).policy_travels_to is not None
    if travels and "inference_backend" not in named and not pickles(policy_source):
        figures = dataclasses.replace(figures, policy_picklable=False)
        rule, layout = choose(figures, named)
    splits = layout["worker_splits"]
    envs_per_worker = layout["envs_per_worker"]
    if "envs_per_worker" not in named:
        envs_per_worker = _fitting(envs_per_worker, figures, o, source.envs, splits)
    if values.is_auto(splits) and backend_kind(layout["inference_backend"]).in_workers:
        splits = None  # a worker's own forward has no server's latency to hide
    if splits is not None and not values.is_auto(splits) and envs_per_worker % int(splits):
        raise ValueError(
            f"worker_splits={splits} does not divide envs_per_worker={envs_per_worker}: "
            "a worker's envs split into equal groups"
        )
    spent = env0.timing_seconds + time.perf_counter() - started if choosing else 0.0
    return Choice(
        transport=layout["transport"],
        inference_backend=layout["inference_backend"],
        envs_per_worker=envs_per_worker,
        worker_splits=checks.splits_of(splits, envs_per_worker, source, device),
        rule=rule.name,
        reason=rule.why(figures),
        given=tuple(knob for knob in KNOBS if knob in named),
        figures=dataclasses.replace(figures, probe_seconds=spent),
    )


def _fitting(
    preferred: int | str, f: Figures, o: Options, envs: int, splits: int | str | None
) -> int:
    """The envs per worker nearest the rule's ``preferred`` (by ratio; a tie to fewer
    workers) that the given ``transition_chunk_size`` and ``worker_splits`` allow: a
    chunk holds whole steps of a worker's ``envs`` each, and splits divide a worker's
    envs. Where none fits, the rule's own value (the checks then name the conflict)."""
    wanted = checks.envs_per_worker_of(preferred, f.factories, f.cores)
    chunk = o.transition_chunk_size

    def fits(k: int) -> bool:
        if isinstance(chunk, int) and not o.on_policy and chunk % (k * envs):
            return False
        return not isinstance(splits, int) or k % splits == 0

    options = [k for k in range(1, f.factories + 1) if f.factories % k == 0 and fits(k)]
    if not options or wanted in options:
        return wanted
    return min(options, key=lambda k: (abs(math.log(k / wanted)), -k))


def pickles(obj: Any) -> bool:
    """Whether ``obj`` pickles with cloudpickle (as worker processes are sent it)."""
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True
