"""Collection spread over the nodes of a Ray cluster with ``RayCollector``.

The envs are cut into ``--collectors`` groups; each group is stepped by an
``AsyncBatchedCollector`` inside a Ray actor, with its own policy copy and inference
on its own node. The driver (this script, the learner) receives finished batches of
exactly ``--frames-per-batch`` transitions, updates the policy, and sends the new
weights back through Ray's object store::

    python examples/ray_collect.py                        # a local Ray instance
    python examples/ray_collect.py --simulate-nodes 2     # two simulated nodes, this machine
    RAY_ADDRESS=10.0.0.1:6379 python examples/ray_collect.py --collectors 4   # a cluster

With ``RAY_ADDRESS`` set (or ``ray start --address`` run on this machine), ``ray.init()``
joins that cluster; every node needs rlcollect, torch and gymnasium installed.
``docs/distributed.md`` explains what crosses the network and what happens when a
node fails.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import gymnasium as gym
import ray
import torch

from rlcollect.distributed import RayCollector


# --8<-- [start:policy]
class Policy(torch.nn.Module):
    """CartPole's observations in, sampled actions (and their log-probabilities) out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)
        )

    def forward(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
        dist = torch.distributions.Categorical(logits=self.net(observation))
        action = dist.sample()
        return {"action": action, "log_prob": dist.log_prob(action)}


# --8<-- [end:policy]


def connect(simulate_nodes: int, node_cpus: int) -> Any:
    """Join the cluster ``RAY_ADDRESS`` names, or start ``simulate_nodes`` local nodes
    (``ray.cluster_utils.Cluster``: separate raylets and object stores on this machine,
    as separate machines would have). Returns the simulated cluster, if any."""
    # --8<-- [start:connect]
    if not simulate_nodes:
        ray.init()  # RAY_ADDRESS (or a running `ray start`) names the cluster; else local
        return None
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # the head runs the driver only: no CPUs for collector actors
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    for _ in range(simulate_nodes):
        cluster.add_node(num_cpus=node_cpus, object_store_memory=200 * 2**20)
    ray.init(address=cluster.address)
    # --8<-- [end:connect]
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50_000, help="total_frames")
    parser.add_argument("--frames-per-batch", type=int, default=1000)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--collectors", type=int, default=2, help="Ray actors")
    parser.add_argument("--simulate-nodes", type=int, default=0, help="0: RAY_ADDRESS or local")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs of a simulated node")
    args = parser.parse_args()
    cluster = connect(args.simulate_nodes, args.node_cpus)
    torch.set_num_threads(1)  # this process learns; the nodes' cores are the envs'

    # --8<-- [start:collect]
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    make_env = functools.partial(gym.make, "CartPole-v1")  # pickled to every node
    t0 = time.perf_counter()
    with RayCollector(
        [make_env] * args.envs,
        policy,
        num_collectors=args.collectors,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames,
        max_collector_restarts=2,  # a lost collector is restarted, twice at most
        policy_device="cpu",  # each collector's own inference device, on its node
    ) as collector:
        print(f"{collector.num_envs} envs on {args.collectors} collectors: {collector.hosts}")
        lengths = []
        for batch in collector:
            # A stand-in learner step (REINFORCE, each step's reward as its return). Rows
            # come from every node; env_index says which env, policy_version which weights.
            dist = torch.distributions.Categorical(logits=policy.net(batch["observation"]))
            loss = -(dist.log_prob(batch["action"]) * batch["next", "reward"]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            version = collector.update_policy_weights_(policy)  # one ray.put, every node
            lengths.extend((batch["step"][batch["next", "done"]] + 1).tolist())
            if version % 10 == 0:
                print(
                    f"weights v{version}: {collector.stats()['frames']} frames, rows of "
                    f"versions {sorted(set(batch['policy_version'].tolist()))}, "
                    f"mean episode length {sum(lengths[-50:]) / max(1, len(lengths[-50:])):.1f}"
                )
        stats = collector.stats()
    # --8<-- [end:collect]
    seconds = time.perf_counter() - t0
    print(
        f"collected {stats['frames']} frames in {stats['batches']} batches "
        f"({stats['frames'] / seconds:.0f} frames/s, actor start-up included); "
        f"collector restarts: {stats['collector_restarts']}"
    )
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
