"""CleanRL's ``dqn.py`` (DQN on CartPole-v1), ported to rlcollect: its hyperparameters,
its structure, its arithmetic.

One file, read top to bottom. What the port changes, and nothing else:

* The env is stepped by the collector, in a worker process, and every transition goes
  into the replay buffer from a background thread (``start()``); this script is the
  learner only. CleanRL's one gradient step per ``train_frequency`` env steps is
  ``train_ratio = batch_size / train_frequency`` rows sampled per row collected, held
  both ways: collection waits for the learner, the learner (``wait_to_sample``) for
  collection. ``learning_starts`` is the collector's argument of the same name; the
  global step is the buffer's ``written``.
* ``QNetwork`` is sized from the env's spaces, and the acting policy (its epsilon-greedy
  step) is given to the collector as ``policy_factory``: no env is built to size it.
  Epsilon is a registered buffer of the acting policy, so it travels with the weights
  pushed after every update.
* The buffer stores each transition's true ``("next", "observation")`` and its
  ``terminated`` flag: the ``real_next_obs`` copy CleanRL makes for truncated episodes
  is not needed, and the TD target is cut by ``terminated`` alone, as CleanRL's is.
* Episodic returns come from ``collector.episodes()`` rather than a
  ``RecordEpisodeStatistics`` wrapper's ``final_info``; results go to ``--out`` as
  JSON and a PNG curve rather than TensorBoard.

    python examples/cleanrl_dqn.py                                          # 500k steps
    python examples/cleanrl_dqn.py --total-timesteps 3000 --learning-starts 1000  # smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlcollect import AsyncBatchedCollector, ReplayBuffer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--total-timesteps", type=int, default=500_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--buffer-size", type=int, default=10_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--target-network-frequency", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--start-e", type=float, default=1.0)
    p.add_argument("--end-e", type=float, default=0.05)
    p.add_argument("--exploration-fraction", type=float, default=0.5)
    p.add_argument("--learning-starts", type=int, default=10_000)
    p.add_argument("--train-frequency", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("runs"), help="JSON and curve (PNG)")
    return p.parse_args()


class QNetwork(nn.Module):
    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(int(np.prod(observation_space.shape)), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, action_space.n),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


class EpsilonGreedy(nn.Module):
    """The acting policy the collector serves: CleanRL's action choice, batched. Epsilon
    is a buffer, so it travels with the weights."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        self.q_network = QNetwork(observation_space, action_space)
        self.num_actions = action_space.n
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        greedy = self.q_network(x).argmax(dim=1)
        random = torch.randint_like(greedy, self.num_actions)
        return torch.where(torch.rand(greedy.shape) < self.epsilon, random, greedy)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)  # the cores belong to the env workers

    rb = ReplayBuffer(args.buffer_size)
    collector = AsyncBatchedCollector(
        [functools.partial(gym.make, args.env_id)] * args.num_envs,
        policy_factory=EpsilonGreedy,  # EpsilonGreedy(observation_space, action_space)
        frames_per_batch=args.train_frequency,
        total_frames=args.total_timesteps,
        policy_device="cpu",
        replay_buffer=rb,
        # one update of batch_size rows per train_frequency env steps
        train_ratio=args.batch_size / args.train_frequency,
        learning_starts=args.learning_starts,
        seed=args.seed,
    )
    acting = EpsilonGreedy(collector.observation_space, collector.action_space)
    q_network = acting.q_network
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(collector.observation_space, collector.action_space)
    target_network.load_state_dict(q_network.state_dict())
    collector.update_policy_weights_(acting)  # epsilon 1 and these weights from step 0

    curve: list[tuple[int, float]] = []
    updates = 0
    start_time = time.time()
    with collector:
        collector.start()
        while collector.wait_to_sample(timeout=60.0):
            global_step = rb.written
            for episode in collector.episodes():
                curve.append((episode.frames, episode.episode_return))
                print(f"global_step={episode.frames}, episodic_return={episode.episode_return}")

            # ALGO LOGIC: training.
            data = rb.sample(args.batch_size)
            with torch.no_grad():
                target_max, _ = target_network(data["next", "observation"]).max(dim=1)
                not_done = 1 - data["next", "terminated"].float()
                td_target = data["next", "reward"] + args.gamma * target_max * not_done
            old_val = q_network(data["observation"]).gather(1, data["action"][:, None]).squeeze()
            loss = F.mse_loss(td_target, old_val)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1

            # update target network
            if updates % (args.target_network_frequency // args.train_frequency) == 0:
                for target_param, param in zip(
                    target_network.parameters(), q_network.parameters(), strict=True
                ):
                    target_param.data.copy_(
                        args.tau * param.data + (1.0 - args.tau) * target_param.data
                    )

            # ALGO LOGIC: put action logic here (epsilon, with the weights, to the collector)
            epsilon = linear_schedule(
                args.start_e,
                args.end_e,
                int(args.exploration_fraction * args.total_timesteps),
                global_step,
            )
            acting.epsilon.fill_(epsilon)
            collector.update_policy_weights_(acting)
            if updates % 100 == 0:
                sps = int(global_step / (time.time() - start_time))
                print(f"SPS: {sps}, td_loss {loss.item():.3f}, epsilon {epsilon:.3f}")
        collector.join(timeout=60.0)  # raises the background error, if collection failed
        curve += [(e.frames, e.episode_return) for e in collector.episodes()]

    returns_only = [r for _, r in curve]
    summary = {
        "env_steps": rb.written,
        "updates": updates,
        "episodes": len(curve),
        "mean_return_last_100": float(np.mean(returns_only[-100:])) if curve else 0.0,
        "wall_seconds": time.time() - start_time,
        "seed": args.seed,
    }
    print(json.dumps(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**summary, "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}
    (args.out / "cleanrl_dqn.json").write_text(json.dumps(doc, indent=1))
    plot(curve, args.out / "cleanrl_dqn.png", "CleanRL dqn.py on rlcollect, CartPole-v1")


def plot(curve: list[tuple[int, float]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        steps, rets = zip(*curve, strict=True)
        ax.plot(steps, rets, ".", alpha=0.3, label="episodic return")
        smooth = [np.mean(rets[max(0, i - 99) : i + 1]) for i in range(len(rets))]
        ax.plot(steps, smooth, label="mean of the last 100")
    ax.set_xlabel("global step")
    ax.set_ylabel("episodic return")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"learning curve: {path}")


if __name__ == "__main__":
    main()
