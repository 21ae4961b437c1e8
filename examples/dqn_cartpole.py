"""DQN on CartPole-v1, with collection running in the background.

The collector steps the envs in worker processes and writes every transition into a
replay buffer from a background thread; this script is only the learner: it samples,
takes Double DQN gradient steps, copies the target network now and then, and pushes its
weights (with the current exploration rate, a buffer of the acting policy) back to the
collector. ``train_ratio`` ties the two together both ways: collection waits whenever it
would get ahead of the learner, and the learner (``wait_to_sample``) whenever it would get
ahead of collection, so the number of updates per env step is the same on a fast machine
and a slow one. The networks are sized from the env's spaces (``policy_factory`` takes
them; the learner's copy is built from ``collector.observation_space`` and
``action_space``), and finished episodes come from ``collector.episodes()``, which reads
each episode's ``("next", "episode_return")`` at its last step.

    python examples/dqn_cartpole.py                 # 100k env steps, learning curve PNG
    python examples/dqn_cartpole.py --steps 3000    # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F

from rlcollect import AsyncBatchedCollector, ReplayBuffer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100_000, help="env steps in all")
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    # the whole run: early failures stay in the buffer after the agent stops failing, so
    # Q keeps seeing what failing looks like
    p.add_argument("--buffer-size", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=128)
    # 64 rows per env step: one update of 128 rows per 2 env steps
    p.add_argument("--train-ratio", type=float, default=64.0, help="rows sampled per env step")
    p.add_argument("--learning-starts", type=int, default=1_000)
    # annealed linearly to --final-lr over the run: large steps early, a steady policy late
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--final-lr", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=10.0, help="no one batch jolts Q")
    p.add_argument("--gamma", type=float, default=0.99)
    # a target copied every few updates is the online net chasing itself
    p.add_argument("--target-every", type=int, default=100, help="updates between target copies")
    p.add_argument("--explore-steps", type=int, default=16_000, help="epsilon 1 -> final")
    p.add_argument("--final-epsilon", type=float, default=0.04)
    p.add_argument("--push-every", type=int, default=10, help="updates between weight pushes")
    # a 256x256 MLP on 128 rows gains nothing from more threads; leave the cores to the envs
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs"), help="JSON and curve (PNG)")
    return p.parse_args()


def make_env() -> gym.Env:
    return gym.make("CartPole-v1")


class QNetwork(torch.nn.Module):
    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(observation_space.shape[0], 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, action_space.n),
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


class EpsilonGreedy(torch.nn.Module):
    """The acting policy: greedy in Q, random with probability ``epsilon``.

    ``epsilon`` is a buffer, so it travels with the weights the learner pushes.
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        self.q = QNetwork(observation_space, action_space)
        self.num_actions = action_space.n
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        greedy = self.q(obs).argmax(dim=-1)
        random = torch.randint_like(greedy, self.num_actions)
        explore = torch.rand(greedy.shape, device=obs.device) < self.epsilon
        return torch.where(explore, random, greedy)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    rb = ReplayBuffer(args.buffer_size)
    collector = AsyncBatchedCollector(
        [make_env] * args.envs,
        policy_factory=EpsilonGreedy,  # EpsilonGreedy(observation_space, action_space)
        frames_per_batch=64,
        total_frames=args.steps,
        policy_device="cpu",
        replay_buffer=rb,
        train_ratio=args.train_ratio,
        learning_starts=args.learning_starts,
        seed=args.seed,
    )
    # the learner's networks, from the collector's spaces; pushed before the first step
    acting = EpsilonGreedy(collector.observation_space, collector.action_space)
    q = acting.q
    target = QNetwork(collector.observation_space, collector.action_space)
    target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=args.lr)
    collector.update_policy_weights_(acting)
    finished: list[tuple[int, float]] = []  # (frames delivered, return) per episode
    start = time.perf_counter()
    updates = 0
    reached: int | None = None
    recent: deque[float] = deque(maxlen=20)
    logged = 0
    with collector:
        collector.start()
        # True while the learner is below its share (train_ratio rows sampled per row
        # collected past learning_starts); False once collection has ended and the share
        # is used up (or after a minute with nothing to sample: join() then says why).
        while collector.wait_to_sample(timeout=60.0):
            # learning rate: linear from --lr to --final-lr over the run
            frac = min(1.0, rb.written / args.steps)
            for group in optimizer.param_groups:
                group["lr"] = args.lr + frac * (args.final_lr - args.lr)

            # one Double DQN update on a uniform sample: the online network picks the next
            # action, the target network values it (a max over noisy estimates alone
            # overestimates)
            batch = rb.sample(args.batch_size)
            with torch.no_grad():
                next_obs = batch["next", "observation"]
                next_action = q(next_obs).argmax(dim=-1, keepdim=True)
                next_q = target(next_obs).gather(1, next_action).squeeze(1)
                not_done = (~batch["next", "terminated"]).float()
                td_target = batch["next", "reward"] + args.gamma * next_q * not_done
            q_taken = q(batch["observation"]).gather(1, batch["action"][:, None]).squeeze(1)
            loss = F.mse_loss(q_taken, td_target)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(q.parameters(), args.max_grad_norm)
            optimizer.step()
            updates += 1

            # target copy; new weights and exploration rate for the collector
            if updates % args.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % args.push_every == 0:
                frac = min(1.0, rb.written / args.explore_steps)
                acting.epsilon.fill_(1.0 + frac * (args.final_epsilon - 1.0))
                collector.update_policy_weights_(acting)

            # progress: returns of the episodes finished since the last look
            for episode in collector.episodes():
                finished.append((episode.frames, episode.episode_return))
                recent.append(episode.episode_return)
                if reached is None and len(recent) == 20 and np.mean(recent) >= 450:
                    reached = episode.frames
            if len(finished) // 50 > logged // 50:
                print(
                    f"steps {rb.written:7d}  episodes {len(finished):4d}  "
                    f"mean return (last 20) {np.mean(recent):6.1f}  updates {updates}  "
                    f"epsilon {float(acting.epsilon):.3f}",
                    flush=True,
                )
            logged = len(finished)
        collector.join(timeout=60.0)  # raises the background error, if collection failed
        finished += [(e.frames, e.episode_return) for e in collector.episodes()]
        stats = collector.stats()
    seconds = time.perf_counter() - start

    returns = [r for _, r in finished]
    final = float(np.mean(returns[-20:])) if returns else 0.0
    summary = {
        "env_steps": rb.written,
        "updates": updates,
        "episodes": len(returns),
        "mean_return_last_20": final,
        "steps_to_mean_450": reached,
        "wall_seconds": seconds,
        "frames_per_second": rb.written / seconds,
        "train_ratio": stats.get("train_ratio"),
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dqn_cartpole.json").write_text(
        json.dumps({**summary, "curve": finished}, indent=1)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    steps, rets = zip(*finished, strict=True) if finished else ((), ())
    smooth = [np.mean(rets[max(0, i - 19) : i + 1]) for i in range(len(rets))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rets, ".", alpha=0.3, label="episode return")
    ax.plot(steps, smooth, label="mean of the last 20")
    ax.axhline(450, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(f"DQN on CartPole-v1, rlcollect background collection ({seconds:.0f} s)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out / "dqn_cartpole.png", dpi=120)
    print(f"learning curve: {args.out / 'dqn_cartpole.png'}")


if __name__ == "__main__":
    main()
