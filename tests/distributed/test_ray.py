"""RayCollector on a real local Ray cluster of two simulated nodes (ray.cluster_utils).

One cluster serves the whole module (starting one takes about 10 s): a head node with
no CPUs for the driver, and two worker nodes of 2 CPUs each, so that each collector
actor runs on a node of its own. Actors are real processes; faults are real
(``ray.kill``). Every wait is bounded.
"""

import functools
import sys
import threading
import time

import gymnasium as gym
import pytest
import torch

ray = pytest.importorskip("ray")
import helpers  # noqa: E402
from helpers import (  # noqa: E402
    ConstantPolicy,
    CountingPolicy,
    ListBuffer,
    check_counting_streams,
    check_restarted_streams,
    counting_envs,
    shm_exists,
    streams,
    wait_until,
)
from ray.cluster_utils import Cluster  # noqa: E402

from rlcollect import AsyncBatchedCollector, ReplayBuffer  # noqa: E402
from rlcollect.distributed import RayCollector  # noqa: E402
from rlcollect.errors import CollectorError, WorkerError, WorkerRestartWarning  # noqa: E402
from rlcollect.testing import EPISODE, CountingEnv  # noqa: E402

NODE_CPUS = 2
STORE = 100 * 2**20  # bytes of object store per node: batches here are kilobytes


@pytest.fixture(scope="module")
def cluster():
    # Ray runs its workers (the collector actors, and so their env workers) at niceness
    # 15, below everything else on the machine: beside two busy processes they get a
    # few percent of a core, and a restarted actor takes minutes to import torch. These
    # tests are about the collector's behaviour, not Ray's priorities: the nodes started
    # here pass this variable on to the workers they start, which then stay at 0.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "object_store_memory": STORE,
            },
        )
        try:
            for _ in range(2):
                c.add_node(num_cpus=NODE_CPUS, object_store_memory=STORE)
        except BaseException:
            c.shutdown()
            raise
    try:
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        # Every node registered, before a collector sizes its actors from the cluster
        wait_until(
            lambda: ray.cluster_resources().get("CPU", 0) == 2 * NODE_CPUS,
            timeout=60,
            what="both nodes to join",
        )
        # The test helpers are not installed on the "nodes": their classes travel by value.
        ray.cloudpickle.register_pickle_by_value(helpers)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class FloatActions(torch.nn.Module):
    def forward(self, obs):
        return obs[:, 0].float()


def make(n=4, policy=None, **kwargs):
    kwargs.setdefault("num_collectors", 2)
    kwargs.setdefault("frames_per_batch", 32)
    kwargs.setdefault("policy_device", "cpu")
    return RayCollector(counting_envs(n), policy or CountingPolicy(), **kwargs)


def actors_dead(c):
    """True once every actor of ``c`` is gone (a call to it fails)."""
    for m in c.collectors():
        try:
            ray.get(m.actor.ready.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            continue
        return False
    return True


def test_exact_batches_env_index_streams_replay_buffer_and_stats(cluster):
    rb = ListBuffer()
    # 5 envs: groups of 3 and 2, batches of 24 cut from actor batches of 14 and 10
    with make(5, frames_per_batch=24, total_frames=250, replay_buffer=rb) as c:
        assert c.num_envs == 5
        assert len({m.node for m in c.collectors()}) == 2  # one collector per node
        batches = [next(c) for _ in range(5)]
        running = c.stats()
        batches.extend(c)
        stats = c.stats()
    assert [b.batch_size[0] for b in batches] == [24] * 10 + [10]
    data = torch.cat(batches)
    check_counting_streams(data)  # routed, whole, in order, env_index == the env's own id
    # Which envs made the 250 frames is the scheduler's choice: beside busy processes an
    # env's worker process was once starved until the budget was met (busy run 8 of
    # 2026-12-02), so no env is required to appear, only every row to name one of the 5.
    assert set(data["env_index"].unique().tolist()) <= {0, 1, 2, 3, 4}
    assert rb.rows() == 250 and all(a is b for a, b in zip(rb.parts, batches, strict=True))
    assert stats["frames"] == 250 and stats["batches"] == 11
    assert stats["collector_restarts"] == 0 and stats["policy_version"] == 0
    assert [s["envs"] for s in stats["collectors"]] == ["envs 0-2", "envs 3-4"]
    by_collector = {s["collector"]: s for s in stats["collectors"]}
    assert by_collector[0]["envs"] == "envs 0-2" and by_collector[1]["envs"] == "envs 3-4"
    assert all("frames" in s and "server" in s for s in running["collectors"])
    with pytest.raises(StopIteration):  # as a local collector whose budget is met
        next(c)


def test_auto_envs_per_worker_lays_out_each_actor_on_its_own_cores(cluster):
    # 8 envs, 2 collectors of 4 on nodes of 2 CPUs: each actor asks for its node's 2
    # cores and puts 2 envs in each of 2 workers, so its policy calls serve whole
    # requests of 2 envs.
    with make(8, envs_per_worker="auto", frames_per_batch=32, total_frames=-1) as c:
        assert [m.options["num_cpus"] for m in c.collectors()] == [2, 2]
        batches = [next(c)]
        deadline = time.monotonic() + 300
        # until both actors' servers have served (one may start late on a busy machine)
        while not all(s["server"]["batch_sizes"] for s in c.stats()["collectors"]):
            batches.append(next(c))
            assert time.monotonic() < deadline, "an actor's server serves nothing"
        stats = c.stats()  # while the actors run: each one's server statistics
    check_restarted_streams(torch.cat(batches))  # whole and in order, none required
    for s in stats["collectors"]:
        sizes = s["server"]["batch_sizes"]
        assert sizes and all(size % 2 == 0 for size in sizes), sizes


class Greedy(torch.nn.Module):
    """Deterministic: argmax of a fixed random linear map of CartPole's observation."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.3, -0.2, 0.9, 0.4], [-0.1, 0.5, -0.7, 0.2]]))
            self.linear.bias.zero_()

    def forward(self, obs):
        return self.linear(obs).argmax(-1)


def test_streams_are_those_of_the_local_collector(cluster):
    """Reproducibility across nodes: env i is seeded with seed + i wherever it runs."""
    fns = [functools.partial(gym.make, "CartPole-v1")] * 4
    kwargs = {"frames_per_batch": 64, "total_frames": -1, "policy_device": "cpu", "seed": 3}

    def until_every_env_has(c, rows=32, limit=400_000, deadline_s=600.0):
        """Batches until every env delivered ``rows`` rows: on a busy machine some envs
        may deliver nothing for a while (one Ray collector delivered 20,032 rows before
        the other's first, beside two CPU-bound processes), so the wait is bounded by
        time, and the rows kept by a bound far past that (a few tens of MB)."""
        batches, seen = [], torch.zeros(4, dtype=torch.long)
        end = time.monotonic() + deadline_s
        while not bool((seen >= rows).all()):
            batches.append(next(c))
            seen += torch.bincount(batches[-1]["env_index"], minlength=4)
            assert sum(b.batch_size[0] for b in batches) < limit, seen
            assert time.monotonic() < end, seen
        return streams(torch.cat(batches))

    with AsyncBatchedCollector(fns, Greedy(), transport="thread", **kwargs) as c:
        local = until_every_env_has(c)
    with RayCollector(fns, Greedy(), num_collectors=2, **kwargs) as c:
        spread = until_every_env_has(c)
    assert set(local) == set(spread) == {0, 1, 2, 3}
    for i in local:
        n = min(len(local[i]), len(spread[i]))
        assert n >= 32, (i, n)  # every env took part
        for key in ("observation", "action", "episode", "step", ("next", "reward")):
            assert torch.equal(local[i][key][:n], spread[i][key][:n]), (i, key)


def test_policy_in_each_nodes_workers(cluster):
    """inference_backend="worker" through Ray: each node's env workers run the policy
    (no server); streams whole, weight updates reach every node, and each node's weights
    board is among the segments the driver cleans up."""
    policy = ConstantPolicy(1)
    kwargs = {"frames_per_batch": 32, "total_frames": -1, "policy_device": "cpu", "seed": 3}
    with make(4, policy, inference_backend="worker", **kwargs) as c:
        boards = [n for m in c.collectors() for n in m.segments if n.startswith("rlcb_")]
        assert len(boards) == 2 and all(shm_exists(n) for n in boards)  # one per node
        batches = [next(c) for _ in range(4)]
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1
        deadline = time.monotonic() + 300
        updated = torch.zeros(4, dtype=torch.bool)
        while not bool(updated.all()):  # until every env (both nodes) stepped on version 1
            batches.append(next(c))
            new = batches[-1]["policy_version"] == 1
            updated[batches[-1]["env_index"][new]] = True
            assert time.monotonic() < deadline, "the new weights reach no env"  # hang guard
        stats = c.stats()
    assert not any(shm_exists(n) for n in boards)
    assert all(s["server"]["batches"] > 0 for s in stats["collectors"])
    data = torch.cat(batches)
    assert check_restarted_streams(data, counting_policy=False) == {0: 0, 1: 0, 2: 0, 3: 0}
    version = data["policy_version"]
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    for rows in streams(data).values():  # per env, versions never go back
        assert bool((rows["policy_version"].diff() >= 0).all())


def test_background_collection_pause_and_weight_updates(cluster):
    """Paused, no batch is written and no inference batch runs: the server layout, whose
    pause holds the server (the in-worker policy's forwards stop once the ring is full,
    tests/collector/test_background.py)."""
    rb = ListBuffer()
    policy = ConstantPolicy(1)
    layout = helpers.with_server_layout({})
    with make(4, policy, total_frames=-1, replay_buffer=rb, **layout) as c:
        with pytest.raises(CollectorError, match="call start"):
            c.join(1)
        c.start()
        wait_until(lambda: rb.rows() >= 64, timeout=60, what="two batches")
        with c.pause():
            written = rb.rows()
            served = [s["server"]["batches"] for s in c.stats()["collectors"]]
            # a window in which running collectors write many batches
            assert not threading.Event().wait(0.3)
            assert rb.rows() == written
            assert [s["server"]["batches"] for s in c.stats()["collectors"]] == served
            with pytest.raises(CollectorError, match="already paused"), c.pause():
                pass
        with pytest.raises(CollectorError, match="background"):
            next(c)
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1 and c.policy_version == 1
        wait_until(
            lambda: any(bool((p["policy_version"] == 1).any()) for p in list(rb.parts)),
            timeout=60,
            what="rows chosen by the new weights",
        )
        with pytest.raises(KeyError, match="missing"):
            c.update_policy_weights_({})
        assert c.policy_version == 1
    assert c.join(timeout=1) and c.background_done
    data = torch.cat(rb.parts)
    version = data["policy_version"]
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    for rows in streams(data).values():  # per env, versions never go back
        assert bool((rows["policy_version"].diff() >= 0).all())
    assert set(version.unique().tolist()) == {0, 1}


def test_train_ratio_throttles_in_the_driver(cluster):
    rb = ReplayBuffer(4096)
    with make(4, total_frames=320, replay_buffer=rb, train_ratio=1.0) as c:
        c.start()
        sampled = 0
        while c.wait_to_sample(timeout=60):
            rb.sample(32)
            sampled += 32
        assert c.join(timeout=60) and rb.written == 320 and c.background_done
        assert sampled >= 320 - 32  # only the last batch may go unlearned


def test_a_killed_collector_is_restarted_with_exact_accounting(cluster):
    batches = []
    policy = ConstantPolicy(1)
    with make(4, policy, frames_per_batch=16, total_frames=-1, max_collector_restarts=1) as c:
        while not batches or not all(
            bool((torch.cat(batches)["env_index"] == e).any()) for e in (2, 3)
        ):
            batches.append(next(c))  # until collector 1's envs have delivered rows
            assert len(batches) < 500
        with torch.no_grad():
            policy.value.fill_(4)
        assert c.update_policy_weights_(policy) == 1
        old = c.collectors()[1].actor
        left = c.collectors()[1].segments  # its collector's ring, on this machine
        assert left and all(shm_exists(name) for name in left)
        ray.kill(old)
        after = torch.zeros(4, dtype=torch.long)
        deadline = time.monotonic() + 300
        with pytest.warns(WorkerRestartWarning, match=r"restarting collector 1 \(envs 2-3"):
            while not bool((after >= 20).all()):
                batch = next(c)
                batches.append(batch)
                if c.stats()["collector_restarts"] == 1:
                    after += torch.bincount(batch["env_index"], minlength=4)
                # a hang guard, not a speed bound: collector 0 streams on (any number of
                # batches) while the new actor starts, slowly on a busy machine
                assert time.monotonic() < deadline, "the restarted collector delivers nothing"
        assert c.collectors()[1].actor is not old
        assert not any(shm_exists(name) for name in left), "a killed actor's ring is left"
        stats = c.stats()
        assert stats["frames"] == 16 * len(batches)  # every batch exact; only delivered rows
        # past max_collector_restarts: the error names the collector and its envs
        ray.kill(c.collectors()[0].actor)
        deadline = time.monotonic() + 300
        with pytest.raises(WorkerError, match=r"collector 0 \(envs 0-1, on .*\) was lost") as info:
            # a hang guard, not a speed bound: collector 1 streams on (any number of
            # batches) until Ray reports the death, slowly on a busy machine
            while time.monotonic() < deadline:
                batches.append(next(c))
        assert info.value.worker_index == 0
        assert any("max_collector_restarts=1" in note for note in info.value.__notes__)
        wait_until(lambda: actors_dead(c), timeout=30, what="every actor to be stopped")
    assert all(b.batch_size[0] == 16 for b in batches)
    data = torch.cat(batches)
    # ConstantPolicy's actions, checked below
    assert check_restarted_streams(data, counting_policy=False) == {0: 0, 1: 0, 2: 1, 3: 1}
    # the new actor served the newest weights, under their version, from its first step
    version = data["policy_version"]
    assert torch.equal(data["action"], torch.where(version == 0, 1, 4))
    rebuilt = (data["env_index"] >= 2) & (data["episode"] != data["observation"][:, EPISODE])
    assert bool(rebuilt.any()) and bool((version[rebuilt] == 1).all())


def test_an_env_error_names_the_collector_and_the_env(cluster):
    fns = counting_envs(4)
    fns[3] = functools.partial(CountingEnv, 3, fail_at=(0, 1))
    c = RayCollector(
        fns, CountingPolicy(), num_collectors=2, frames_per_batch=16, policy_device="cpu"
    )
    with pytest.raises(
        WorkerError, match=r"collector 1 \(envs 2-3\): env 1 .*failed on purpose"
    ) as info:
        for _ in range(1000):
            next(c)
    assert info.value.env_index == 3  # in env_fns' numbering
    wait_until(lambda: actors_dead(c), timeout=30, what="every actor to be stopped")


def test_interrupt_stops_every_actor(cluster):
    class Interrupting(ListBuffer):
        def extend(self, td):
            raise KeyboardInterrupt

    c = make(4, replay_buffer=Interrupting())
    with pytest.raises(KeyboardInterrupt):
        next(c)
    wait_until(lambda: actors_dead(c), timeout=30, what="every actor to be stopped")
    c.shutdown()  # idempotent


def test_bad_input_fails_at_construction(cluster):
    with pytest.raises(ValueError, match="num_collectors=5, but env_fns has 4"):
        make(4, num_collectors=5)
    with pytest.raises(ValueError, match="frames_per_batch must be an int >= 1"):
        make(4, frames_per_batch=0)
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) \['frames_per_batches'\]"
    ):
        make(4, frames_per_batches=8)
    with pytest.raises(TypeError, match=r"env_fns\[0\] cannot be pickled to send it to a Ray"):
        lock = threading.Lock()
        RayCollector([lambda: (lock, CountingEnv(0))[1]], CountingPolicy(), num_collectors=1,
                     frames_per_batch=8)  # fmt: skip
    with pytest.raises(ValueError, match="asks for 3 CPUs per collector, but the largest node"):
        make(4, resources_per_collector={"num_cpus": 3})
    with pytest.raises(ValueError, match="need 6, but the Ray cluster has 4"):
        make(6, num_collectors=3, resources_per_collector={"num_cpus": 2})
    # found by the actors' own collectors, raised here as a local collector raises it
    with pytest.raises(TypeError, match="float32 actions for the integer action space") as info:
        make(4, policy=FloatActions(), num_collectors=2)
    assert any("raised in collector" in note for note in info.value.__notes__)
