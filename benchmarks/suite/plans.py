"""What each suite runs: the series, their configurations and their time budgets.

A series is a set of named runs measured in the same invocation, interleaved repeat by
repeat, so that ratios between its runs come from one run of the machine. Every run's
configuration is recorded in the JSON as given here.

Sizes per machine (:class:`Machine`): the CPU suite fits a 2-core development machine in
under 15 minutes; the GPU suite assumes a CUDA device and about 16 cores, and each of
its parts (``GPU_PARTS``) fits one 9-minute device call, or continues in another with
``--resume``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Machine:
    """Per-suite sizes."""

    device: str  # where policies and learners run
    policy: str  # the pixel series' acting policy (benchmarks.suite.acting.POLICIES)
    graph: bool  # serve the policy as a CUDA graph (collector and hand loops alike)
    num_envs: int  # envs in the pixel series
    envs_per_worker: tuple[int, ...]  # the values the pixel matrix covers
    #: the throughput series' hand-tuned layouts: (num_envs, envs_per_worker, worker_splits)
    tuned: tuple[tuple[int, int, int], ...]
    dqn_envs: tuple[int, ...]  # num_envs points of the DQN-loop series
    async_envs: int  # envs of the async-training series
    warmup_s: float
    measure_s: float
    replay_capacity: int
    torchrl_chunk1: bool  # TorchRL at chunk 1 too (its start-up costs ~30 s a run)
    quick: bool = False


CPU = Machine(
    device="cpu",
    policy="small_cnn",
    graph=False,
    num_envs=4,
    envs_per_worker=(1, 2),
    tuned=((8, 4, 2), (16, 8, 2)),
    dqn_envs=(1, 2, 4, 8),
    async_envs=8,
    warmup_s=0.5,
    measure_s=2.0,
    replay_capacity=4_000,
    torchrl_chunk1=False,
)
GPU = Machine(
    device="cuda",
    policy="nature_cnn",
    graph=True,
    num_envs=16,
    envs_per_worker=(1, 4),
    # issue 18's table: the best layouts measured by hand on the H200's 16 cores
    tuned=((16, 2, 2), (32, 2, 2), (48, 3, 3), (64, 4, 2)),
    dqn_envs=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    async_envs=8,
    warmup_s=0.5,
    measure_s=2.5,
    replay_capacity=50_000,
    torchrl_chunk1=True,
)
QUICK = replace(
    CPU,
    num_envs=2,
    tuned=((4, 2, 2),),
    dqn_envs=(2,),
    async_envs=2,
    warmup_s=0.2,
    measure_s=0.5,
    replay_capacity=512,
    quick=True,
)
# The GPU suite in device calls of under 9 minutes each: part 1 took 8 minutes on the H200,
# part 2 about 5; part 3 about 17 (256 worker processes start slowly), so it takes two
# calls, `--part 3` and then `--part 3 --resume DIR`, each stopping at the deadline. Part 4
# took 6.5 minutes before its twelfth run was added; part 5 took 8.3 minutes on the H200
# with its 5 AtariVectorEnv runs (20-40 s each, most of it start-up); with the 4 EnvPool
# runs added (issue 59) it takes two calls, `--part 5` and then `--part 5 --resume DIR`.
# Part 8 (Sample Factory beside rlcollect, issue 59) is 7 runs a repeat, each a fresh
# process of 10-20 s (Sample Factory's workers start in 5-7 s on 2 CPU cores): about 5
# minutes for three repeats (not measured on a GPU host yet).
GPU_PARTS = {
    "1": ("peers",),
    "2": ("pixels", "async_training"),
    "3": ("dqn_loop",),
    "4": ("throughput",),
    "5": ("vector_throughput",),
    "6": ("vector_layouts",),
    "7": ("defaults",),
    "8": ("sample_factory",),
}
LEARNING_STARTS = 32  # one learner batch: the loops train from their first seconds on
ASYNC_WINDOW = 1.5  # the async-training runs measure longer: few frames per second


@dataclass(frozen=True)
class Series:
    """Runs measured together; ``ratios``: (numerator, denominator) run names."""

    name: str
    title: str
    runs: dict[str, dict[str, Any]]
    ratios: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()


def _execution(graph: bool) -> str:
    return "graph" if graph else "eager"


def _base(m: Machine, kind: str, **extra: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "device": m.device,
        "warmup_s": m.warmup_s,
        "measure_s": m.measure_s,
        **extra,
    }


def _pixel(m: Machine, kind: str, **extra: Any) -> dict[str, Any]:
    # 16 steps per env and batch: rlcollect's "auto" chunk then resolves to 16, a point
    # of its own between 1 and 64.
    config = _base(
        m,
        kind,
        num_envs=m.num_envs,
        frames_per_batch=16 * m.num_envs,
        graph=m.graph,
        policy=m.policy,
    )
    config.update(extra)
    return config


def _rlcollect(
    m: Machine,
    transport: str,
    chunk: int | str,
    epw: int | str = 1,
    *,
    splits: int | str | None = None,
    min_batch: int = 1,
    timeout: float = 1e-3,
    graph: bool | None = None,
    backend: str = "thread",
    prefix: str = "rlcollect",
) -> tuple[str, dict[str, Any]]:
    graph = m.graph if graph is None else graph
    # A chunk holds the same number of steps of each of a worker's envs, so it is at
    # least envs_per_worker transitions: "1" becomes one step of each env.
    size = chunk if chunk == "auto" or epw == "auto" else max(int(chunk), int(epw))
    name = f"{transport}-chunk{size}" + (f"-epw{epw}" if epw != 1 else "")
    name += f"-splits{splits}" if splits else ""
    name += f"-{_execution(graph)}" + ("-process_server" if backend == "process" else "")
    config = _pixel(
        m,
        "rlcollect",
        transport=transport,
        chunk=size,
        envs_per_worker=epw,
        worker_splits=splits,
        min_batch_size=min_batch,
        batch_timeout=timeout,
        graph=graph,
        inference_backend=backend,
    )
    return f"{prefix}[{name}]", config


def _torchrl(m: Machine, chunk: int) -> tuple[str, dict[str, Any]]:
    name = f"torchrl[process_slots-chunk{chunk}-eager]"
    return name, _pixel(m, "torchrl", chunk=chunk, graph=False)


def peers(m: Machine) -> Series:
    """The headline: rlcollect, the envs alone and every peer, same task, same run.

    It also holds the chunking comparison (chunk 1 vs 64 with the inference server in
    a process of its own, on both collectors), so that TorchRL's slow start is paid once
    per configuration.
    """
    env_only = f"env_only[{m.num_envs} procs]"
    ex = _execution(m.graph)
    head = dict([_rlcollect(m, "process_slots", 64)])
    if m.graph:  # like for like with TorchRL's documented (eager) settings
        head.update([_rlcollect(m, "process_slots", 64, graph=False)])
    peer_runs = {
        f"async_vector_loop[{ex}]": _pixel(m, "async_vector"),
        f"atari_vector_loop[batch{max(1, m.num_envs // 2)}-{ex}]": _pixel(m, "atari_vector"),
        **dict([_torchrl(m, 64)]),
    }
    chunking = dict(
        [
            _rlcollect(m, "process_slots", 1, graph=False, backend="process"),
            _rlcollect(m, "process_slots", 64, graph=False, backend="process"),
        ]
    )
    if m.torchrl_chunk1:
        chunking.update([_torchrl(m, 1)])
    if m.quick:  # one of each kind (the throughput series runs a server process)
        head = dict([_rlcollect(m, "process_slots", "auto")])
        chunking = {}
    for config in chunking.values():
        config["role"] = "chunking"  # left out of the headline plot and ratios
    runs = {env_only: _pixel(m, "env_only"), **head, **peer_runs, **chunking}
    ratios = tuple((h, other) for h in head for other in (env_only, *peer_runs))
    return Series(
        "peers",
        "rlcollect and its peers on the pixel task, same run",
        runs,
        ratios,
        notes=(
            f"Pong 4x105x80 uint8, {m.num_envs} envs; every run serves the same policy "
            f"({m.policy}, Gumbel-max sampling), frames_per_batch = 16 x num_envs.",
            "rlcollect and the hand loops use the same execution (eager on CPU, a CUDA graph "
            "on GPU); TorchRL runs its documented fast settings (eager). TorchRL's chunk "
            "'auto' is at least 64 by its rule, so here it is the chunk-64 run.",
            "On the CPU, rlcollect's server and the hand loops run the policy on one intra-op "
            "thread; TorchRL's inference process keeps torch's default, as documented.",
            "atari_vector_loop steps ale-py's C++ Pong (same shape; resize and max-pool "
            "preprocessing, frame skip 4, no sticky actions, no no-op starts); every other "
            "run steps the Python gymnasium Pong.",
            "The process_server runs (rlcollect inference_backend='process') and the "
            "TorchRL runs serve the policy from a process of their own: their driver CPU "
            "time per frame is the driver's own work (the chunking comparison).",
        ),
    )


def pixels(m: Machine) -> Series:
    runs: dict[str, dict[str, Any]] = {}
    chunks: tuple[int | str, ...] = (1, "auto", 64)
    if m.quick:
        runs.update(
            [
                _rlcollect(m, "thread", 1, prefix="pixels"),
                _rlcollect(m, "process_slots", 64, 2, prefix="pixels"),
            ]
        )
    else:
        # The thread transport (debugging, GIL-releasing envs): the two ends of the range.
        runs.update(_rlcollect(m, "thread", c, prefix="pixels") for c in (1, 64))
        # Grouped workers: one step of each env, and 64; "auto" only for one env each.
        runs.update(
            _rlcollect(m, "process_slots", c, e, prefix="pixels")
            for e in m.envs_per_worker
            for c in (chunks if e == 1 else (1, 64))
        )
    return Series(
        "pixels",
        "Pixel collection: transports x transition_chunk_size x envs_per_worker",
        runs,
        notes=(
            f"{m.num_envs} Pong envs, {m.policy} policy, {_execution(m.graph)}; "
            "frames_per_batch = 16 x num_envs, so chunk 'auto' resolves to 16 steps per env.",
            "Driver CPU ms/frame is the whole driver process, the in-process inference "
            "server thread included.",
        ),
    )


def dqn_loop(m: Machine) -> Series:
    runs: dict[str, dict[str, Any]] = {}
    for n in m.dqn_envs:
        config = _base(
            m,
            "",
            num_envs=n,
            graph=m.graph,
            capacity=m.replay_capacity,
            learning_starts=LEARNING_STARTS,
        )
        runs[f"blocking[{n} envs]"] = {**config, "kind": "dqn_blocking"}
        runs[f"rlcollect[{n} envs]"] = {**config, "kind": "dqn_rlcollect"}
    ratios = tuple((f"rlcollect[{n} envs]", f"blocking[{n} envs]") for n in m.dqn_envs)
    return Series(
        "dqn_loop",
        "DQN training loop: blocking step() vs the same loop fed by rlcollect",
        runs,
        ratios,
        notes=(
            "Nature CNN Q-network, epsilon-greedy (0.05) acting, one update on a batch of 32 "
            "every 4 steps (num_envs frames each) from an rlcollect.ReplayBuffer on "
            f"{m.device}; env frames/s with the learning included; 95% t-intervals over "
            "the repeats.",
            "blocking: gymnasium AsyncVectorEnv, act -> step() -> store -> train. rlcollect: "
            "AsyncBatchedCollector(frames_per_batch=num_envs, replay_buffer=rb), "
            f"{_execution(m.graph)} policy, new weights pushed after each update.",
        ),
    )


def async_training(m: Machine) -> Series:
    runs = {}
    for ratio in (2,) if m.quick else (2, 16):
        runs[f"train_ratio{ratio}[{m.async_envs} envs]"] = _base(
            m,
            "async_training",
            num_envs=m.async_envs,
            graph=m.graph,
            train_ratio=ratio,
            frames_per_batch=m.async_envs,
            capacity=m.replay_capacity,
            learning_starts=8 * m.async_envs,
            push_every=16,
            warmup_s=ASYNC_WINDOW * m.warmup_s,
            measure_s=ASYNC_WINDOW * m.measure_s,
        )
    return Series(
        "async_training",
        "Async training at train ratio 2 and 16",
        runs,
        notes=(
            "collector.start() into an rlcollect.ReplayBuffer, max_batch_size=1 (one "
            "request per inference call), frames_per_batch = num_envs (the throttle's step), "
            "a DQN learner (Nature CNN, batch 32) sampling "
            "from the buffer in the driver; train_ratio throttles collection to the learner.",
            "Published analogue (DreamerV3, 8 envs, inference batch 1, a world-model "
            "learner): 85.2 (ratio 2) and 53.1 (ratio 16) frames/s.",
        ),
    )


def throughput(m: Machine) -> Series:
    """The collector against the envs' own speed: defaults, ``"auto"`` and the best
    layouts measured by hand, as envs outnumber the cores (issue 18)."""
    fpb = 64 * m.num_envs  # 1024 on the GPU machine, as in the table
    env_only = f"env_only[{m.num_envs} procs]"
    runs: dict[str, dict[str, Any]] = {env_only: _pixel(m, "env_only")}

    def add(
        name: str,
        n: int,
        epw: int | str,
        splits: int | str | None = None,
        min_batch: int = 1,
        backend: str = "thread",
    ) -> None:
        # a batch waits at most 200 us for min_batch rows (the default waits for none)
        timeout = 2e-4 if min_batch > 1 else 1e-3
        _, config = _rlcollect(
            m,
            "process_slots",
            "auto",
            epw,
            splits=splits,
            min_batch=min_batch,
            timeout=timeout,
            backend=backend,
        )
        runs[f"rlcollect[{n} envs, {name}]"] = {**config, "num_envs": n, "frames_per_batch": fpb}

    most = 4 * m.num_envs
    add("defaults", m.num_envs, 1)
    # The server in a process of its own, apart from the driver's consuming thread: the
    # driver's CPU per frame (issue 18, item 3) is then the consumer's alone.
    process = 'inference_backend="process"'
    add(process, m.num_envs, 1, backend="process")
    for n, epw, splits in m.tuned:
        add(f"envs_per_worker={epw}, worker_splits={splits}", n, epw, splits)
    n, epw, splits = m.tuned[-1]
    tuned = f"envs_per_worker={epw}, worker_splits={splits}"
    add(f"{tuned}, {process}", n, epw, splits, backend="process")
    add("defaults", most, 1)
    # The defaults' layout (a worker process per env) with the server in a process of its
    # own: what an inference_backend chosen from the policy's device would give them.
    add(process, most, 1, backend="process")
    # twice as many worker processes as cores, each alternating between two envs
    add("envs_per_worker=2, worker_splits=2", most, 2, 2)
    add('envs_per_worker="auto"', most, "auto")
    both = 'envs_per_worker="auto", worker_splits="auto"'
    add(both, most, "auto", "auto")
    # Fuller batches: the GPU step costs about the same for 8 rows as for 32, and split
    # workers have a group's step time of slack to wait in. (A quarter of the envs, run
    # as well until 2026-12-05, measured level with half: 0.73x and 0.72x on the H200.)
    rows = most // 2
    add(f"{both}, min_batch_size={rows}", most, "auto", "auto", min_batch=rows)
    if m.quick:  # each kind of argument once: the smoke test's budget
        kept = (
            env_only,
            f"rlcollect[{m.num_envs} envs, defaults]",
            f"rlcollect[{n} envs, {tuned}, {process}]",
            f"rlcollect[{most} envs, {both}, min_batch_size={most // 2}]",
        )
        runs = {name: runs[name] for name in kept}
    ratios = tuple((name, env_only) for name in runs if name != env_only)
    return Series(
        "throughput",
        "Throughput against the envs' own speed: defaults, auto and hand-tuned layouts",
        runs,
        ratios,
        notes=(
            f"Pong 4x105x80 uint8, {m.policy} ({_execution(m.graph)}), process_slots, "
            f"frames_per_batch = {fpb}, transition_chunk_size 'auto'.",
            f"{env_only}: each of {m.num_envs} envs in a process of its own, random actions, "
            "no policy (rlcollect.envspeed.env_throughput): the CPU ceiling of this machine.",
            'envs_per_worker="auto" groups the envs into about one worker per core; '
            'worker_splits="auto" splits each worker in two (the fewest groups above one) '
            "where the policy runs on a GPU.",
        ),
    )


def _divisor_at_most(n: int, most: int) -> int:
    return max(d for d in range(1, max(1, most) + 1) if n % d == 0)


def _vector_sizes(m: Machine) -> tuple[int, int, list[int], list[list[int]]]:
    """The vector series' sizes: envs in all, frames per batch, one vector env with a
    thread per core, and several vector envs in processes with half the cores' worth of
    threads each (while one worker waits for its actions, the other vector envs'
    threads take its cores: docs/tuning.md, Native vector envs), a recv taking half of
    each or all of it. A layout: [vector envs, sub-envs each, sub-envs per recv, C++
    threads each]."""
    cores = len(os.sched_getaffinity(0))
    n = 4 * m.num_envs  # 64 on the GPU machine
    v = _divisor_at_most(n // 2, max(2, cores // 2))
    each = max(1, cores // 2)
    one = [1, n, n // 2, cores]
    many = [[v, n // v, n // (2 * v), each], [v, n // v, n // v, each]]
    return n, 16 * n, one, many


def _vector_name(layout: list[int]) -> str:
    vector_envs, envs, batch, threads = layout
    plural = "s" * (threads > 1)
    return f"{vector_envs} x {envs} envs, batch {batch}, {threads} thread{plural} each"


def _vector_series(
    m: Machine,
    name: str,
    title: str,
    layouts: list[tuple[str, list[int], str]],
    hand: bool,
    pools: tuple[tuple[str, list[int], str], ...] = (),
) -> Series:
    """A vector series: the env alone with a thread per core, (``hand``) the hand loop,
    and the collector over ``layouts`` of (transport, layout, inference_backend), each
    against the env alone, the hand loop and, where a layout's vector envs hold another
    number of threads in all than there are cores, the env alone with that many.

    With ``pools`` (layouts as ``layouts``'), the same over EnvPool's pool of the same
    game: EnvPool alone, EnvPool's own asynchronous loop with the same policy, and the
    collector driving EnvPool, each collector run against the runs of its own env."""
    cores = len(os.sched_getaffinity(0))
    n, fpb, one, _ = _vector_sizes(m)

    def config(kind: str, layout: list[int], **extra: Any) -> dict[str, Any]:
        return _base(
            m,
            kind,
            layout=layout,
            num_envs=n,
            graph=m.graph,
            policy=m.policy,
            frames_per_batch=fpb,
            **extra,
        )

    env_only = f"env_only[{_vector_name(one)}]"
    runs: dict[str, dict[str, Any]] = {env_only: config("vector_env_only", one)}
    threads = {layout[0] * layout[3] for _, layout, _ in layouts} - {cores}
    for total in sorted(threads):  # the env alone with as many threads as the layout's
        more = [1, n, n // 2, total]
        runs[f"env_only[{_vector_name(more)}]"] = config("vector_env_only", more)
    if hand:
        runs[f"hand_loop[{_vector_name(one)}]"] = config("atari_vector", one)
    for transport, layout, backend in layouts:
        how = f"{transport}, " + (f'inference_backend="{backend}", ' if backend != "thread" else "")
        runs[f"rlcollect[{how}{_vector_name(layout)}]"] = config(
            "vector_rlcollect", layout, transport=transport, backend=backend
        )
    if pools:
        runs[f"envpool_only[{_vector_name(one)}]"] = config(
            "vector_env_only", one, vector_source="envpool"
        )
        runs[f"envpool_loop[{_vector_name(one)}]"] = config("envpool_loop", one)
    for transport, layout, backend in pools:
        how = f"envpool, {transport}, "
        how += f'inference_backend="{backend}", ' if backend != "thread" else ""
        runs[f"rlcollect[{how}{_vector_name(layout)}]"] = config(
            "vector_rlcollect",
            layout,
            transport=transport,
            backend=backend,
            vector_source="envpool",
        )

    def env(run: str) -> str:  # the vector env a run steps
        kind = runs[run]["kind"]
        return "envpool" if kind == "envpool_loop" else str(runs[run].get("vector_source", "ale"))

    mine = [r for r in runs if r.startswith("rlcollect")]
    others = [r for r in runs if not r.startswith("rlcollect")]
    ratios = tuple((r, o) for r in mine for o in others if env(r) == env(o))
    return Series(
        name,
        title,
        runs,
        ratios,
        notes=(
            f"ale-py AtariVectorEnv Pong, 4x105x80 grayscale, frame skip 4, {n} envs in all; "
            f"{m.policy} ({_execution(m.graph)}), frames_per_batch = {fpb} for the collector. "
            "A layout: vector envs x sub-envs each, sub-envs per recv (batch), C++ threads "
            f"each; {cores} cores.",
            "env_only: one vector env in one process, send/recv with random actions, no "
            "policy."
            + (
                " hand_loop: the same vector env, a loop that acts on each recv's batch "
                "(same policy and execution) and sends the actions back."
                if hand
                else ""
            ),
            "rlcollect: one worker per vector env (a thread, or a process with "
            "process_slots), defaults otherwise"
            + (
                '; inference_backend="process" serves the policy from a process of its own'
                if any(backend == "process" for _, _, backend in layouts)
                else ""
            )
            + (
                '; inference_backend="worker" runs the policy in each vector env\'s own '
                "worker" + (", as the hand loop does." if hand else ".")
                if any(backend == "worker" for _, _, backend in layouts)
                else "."
            ),
            *(_POOL_NOTE,) * bool(pools),
        ),
    )


_POOL_NOTE = (
    "envpool_*, rlcollect[envpool, ...]: EnvPool's pool of the same Pong (envpool 1.2.5: "
    "C++ area resize and max-pooling of the last two frames, as ale-py's), the layout "
    "alike. envpool_only: send/recv with random actions, no policy; envpool_loop: "
    "EnvPool's own asynchronous loop (recv the first batch to finish, act with the same "
    "policy and execution, send to those sub-envs). Each rlcollect run is compared with "
    "the runs of its own env; skipped where envpool does not import."
)


def vector_throughput(m: Machine) -> Series:
    """ale-py's ``AtariVectorEnv`` Pong against its own speed: one vector env with a
    thread per core, driven by the collector (a worker thread, a worker process, the
    policy in that process) and by a hand loop (issue 18, item 4); and EnvPool's pool
    of the same Pong, alone, in its own asynchronous loop and driven by the collector
    (issue 59, item 3)."""
    _, _, one, _ = _vector_sizes(m)
    # (transport, layout, inference_backend): "worker" runs the policy in the vector
    # env's own worker, as the hand loop does, with no server and no hop between them.
    layouts = [("thread", one, "thread"), ("process_slots", one, "thread")]
    layouts += [("process_slots", one, "worker")]
    # The same over EnvPool's pool (issue 59, item 3): the collector's two fastest ways.
    pools = (("process_slots", one, "thread"), ("process_slots", one, "worker"))
    if m.quick:  # each kind of run once: the smoke test's budget
        layouts, pools = layouts[2:], pools[1:]
    return _vector_series(
        m,
        "vector_throughput",
        "AtariVectorEnv Pong against its own speed: the collector, a hand loop, the env "
        "alone; and the same over EnvPool's Pong",
        layouts,
        hand=True,
        pools=pools,
    )


def vector_layouts(m: Machine) -> Series:
    """The same envs as ``vector_throughput`` split over several vector envs, each in a
    worker process with half the cores' worth of threads, against the env alone with a
    thread per core and with as many threads as the layout holds. A series of its own so
    that each fits one device call (every run starts a fresh process: 20-40 s each on
    the H200, most of it building the vector envs)."""
    _, _, _, many = _vector_sizes(m)
    layouts = [("process_slots", layout, "thread") for layout in many]
    # Where the policy runs, for the first layout: a server process of its own, and a
    # copy in each vector env's worker (a CUDA context per worker on a GPU).
    layouts += [("process_slots", many[0], backend) for backend in ("process", "worker")]
    if m.quick:
        layouts = layouts[:1]
    return _vector_series(
        m,
        "vector_layouts",
        "AtariVectorEnv Pong over several vector envs in processes against the env alone",
        layouts,
        hand=False,
    )


def defaults(m: Machine) -> Series:
    """The collector with no layout arguments against the best documented layout and the
    loops a user would write, workload by workload (``benchmarks/suite/defaults.py``)."""
    from benchmarks.suite.defaults import series

    return series(m)


def sample_factory(m: Machine) -> Series:
    """Sample Factory's sampler beside rlcollect, same Pong, same network, same run
    (``benchmarks/suite/sf_series.py``, issue 59)."""
    from benchmarks.suite.sf_series import series

    return series(m)


SERIES = {
    "peers": peers,
    "pixels": pixels,
    "dqn_loop": dqn_loop,
    "async_training": async_training,
    "throughput": throughput,
    "vector_throughput": vector_throughput,
    "vector_layouts": vector_layouts,
    "defaults": defaults,
    "sample_factory": sample_factory,
}


def machine(suite: str, quick: bool, scale: float) -> Machine:
    """The sizes for ``suite`` ("cpu" or "gpu"), time windows multiplied by ``scale``."""
    m = {"cpu": CPU, "gpu": GPU}[suite]
    if quick:
        m = replace(QUICK, device=m.device, policy=m.policy, graph=m.graph)
    return replace(m, warmup_s=m.warmup_s * scale, measure_s=m.measure_s * scale)
