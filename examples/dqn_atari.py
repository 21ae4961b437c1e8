"""DQN on Atari Pong with the Nature CNN, collection running in the background.

16 Pong envs step in worker processes and the collector writes every transition into a
replay buffer (on the GPU when there is one) from a background thread; this script is
the learner: a gradient step on 32 sampled transitions per 4 env steps, a target
network copied now and then, weights (with the exploration rate) pushed to the
collector. ``train_ratio = batch_size / train_every`` holds that pace whatever the
machine, both ways: collection waits whenever it would get ahead of the learner, the
learner (``wait_to_sample``) whenever it would get ahead of collection. On a GPU the
acting policy runs as a CUDA graph. The script prints env steps/s, updates/s and the
episode returns, and writes a JSON summary (and the learning curve as a PNG, if
matplotlib is installed) to ``--out``.

    python examples/dqn_atari.py                     # 10M env steps (40M frames), a GPU
    python examples/dqn_atari.py --steps 2000 --envs 2 --learning-starts 500  # CPU smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import deque
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector, ReplayBuffer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env-id", default="ALE/Pong-v5")
    p.add_argument("--steps", type=int, default=10_000_000, help="env steps (4 frames each)")
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    # 56 KB a row (observation and next observation): 1M rows take 56 GB
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-every", type=int, default=4, help="env steps per gradient step")
    p.add_argument("--learning-starts", type=int, default=80_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--target-every", type=int, default=250, help="updates between target copies")
    p.add_argument("--explore-steps", type=int, default=1_000_000, help="epsilon 1 -> final")
    p.add_argument("--final-epsilon", type=float, default=0.01)
    p.add_argument("--push-every", type=int, default=25, help="updates between weight pushes")
    # envs per inference batch and per replay write; collection leads the learner by one
    p.add_argument("--frames-per-batch", type=int, default=128)
    # "process": inference in a process of its own, out of reach of the learner's GIL
    p.add_argument("--inference-backend", choices=["thread", "process"], default="thread")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between reports")
    p.add_argument("--out", type=Path, default=Path("runs"), help="where results go")
    return p.parse_args()


def area_weights(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray]:
    """For each output pixel of an area-averaging resize, the input pixels it covers
    ``[size_out, k]`` and their weights (the overlap, over the output pixel's width)."""
    scale = size_in / size_out
    k = int(np.ceil(scale)) + 1
    index = np.zeros((size_out, k), np.int64)
    weight = np.zeros((size_out, k), np.float32)
    for i in range(size_out):
        lo, hi = i * scale, (i + 1) * scale
        for n, j in enumerate(range(int(lo), min(size_in, int(np.ceil(hi))))):
            index[i, n], weight[i, n] = j, (min(hi, j + 1) - max(lo, j)) / scale
    return index, weight


class NatureFrames(gym.Wrapper):
    """The frame pipeline of the Nature DQN paper, in numpy.

    After each reset, 1 to ``noop_max`` no-op actions (varied starts); each action
    repeated ``skip`` frames, returning the pixel-wise max of the last two (some sprites
    are drawn every other frame only); the grayscale screen area-averaged down to
    ``size`` x ``size`` uint8. gymnasium's ``AtariPreprocessing`` does the same with
    OpenCV, which this example does without.
    """

    def __init__(self, env: gym.Env, skip: int = 4, size: int = 84, noop_max: int = 30) -> None:
        super().__init__(env)
        self.skip, self.noop_max = skip, noop_max
        h, w = env.observation_space.shape
        self.rows, self.row_weights = area_weights(h, size)
        self.cols, self.col_weights = area_weights(w, size)
        self.observation_space = gym.spaces.Box(0, 255, (size, size), np.uint8)

    def resize(self, frame: np.ndarray) -> np.ndarray:
        tall = np.einsum("ikw,ik->iw", frame[self.rows], self.row_weights)
        small = np.einsum("ijk,jk->ij", tall[:, self.cols], self.col_weights)
        return small.round().astype(np.uint8)

    def reset(self, **kwargs):
        frame, info = self.env.reset(**kwargs)
        for _ in range(self.unwrapped.np_random.integers(1, self.noop_max + 1)):
            frame, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                frame, info = self.env.reset()
        return self.resize(frame), info

    def step(self, action):
        total, last_two = 0.0, []
        for _ in range(self.skip):
            frame, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            last_two = [*last_two[-1:], frame]
            if terminated or truncated:
                break
        return self.resize(np.max(last_two, axis=0)), total, terminated, truncated, info


def make_env(env_id: str) -> gym.Env:
    gym.register_envs(ale_py)  # here, not at import: this runs in the worker processes
    # frameskip=1: NatureFrames repeats actions itself; no sticky actions, as in the paper
    env = gym.make(env_id, obs_type="grayscale", frameskip=1, repeat_action_probability=0.0)
    return gym.wrappers.FrameStackObservation(NatureFrames(env), stack_size=4)


class NatureCNN(torch.nn.Module):
    """Q-values from 4 stacked 84x84 uint8 frames: 3 conv layers and 512 hidden units."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(4, 32, 8, stride=4), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 4, stride=2), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 64, 3, stride=1), torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 7 * 7, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, num_actions),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float() / 255.0)


class EpsilonGreedy(torch.nn.Module):
    """The acting policy: greedy in Q, random with probability ``epsilon``.

    ``epsilon`` is a buffer, so it travels with the weights the learner pushes. No
    host synchronisation anywhere: the step can be captured as a CUDA graph.
    """

    def __init__(self, q: NatureCNN, num_actions: int) -> None:
        super().__init__()
        self.q = q
        self.num_actions = num_actions
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        greedy = self.q(obs).argmax(dim=-1)
        random = torch.randint_like(greedy, self.num_actions)
        explore = torch.rand(greedy.shape, device=obs.device) < self.epsilon
        return torch.where(explore, random, greedy)


class EpisodeLog(ReplayBuffer):
    """The replay buffer, also adding up each env's rewards to log finished episodes."""

    def __init__(self, capacity: int, num_envs: int, device: str, seed: int) -> None:
        super().__init__(capacity, device=device, seed=seed)
        self.running = np.zeros(num_envs)
        self.finished: list[tuple[int, float]] = []  # (env steps so far, return)

    def extend(self, data: TensorDict) -> None:
        super().extend(data)
        envs = data["env_index"].tolist()
        rewards = data[("next", "reward")].tolist()
        dones = data[("next", "done")].tolist()
        for i, (env, reward, done) in enumerate(zip(envs, rewards, dones, strict=True)):
            self.running[env] += reward
            if done:
                self.finished.append((self.written - len(envs) + i + 1, self.running[env]))
                self.running[env] = 0.0


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    env_fn = functools.partial(make_env, args.env_id)
    probe = env_fn()
    num_actions = int(probe.action_space.n)
    probe.close()

    q = NatureCNN(num_actions).to(device)
    target = NatureCNN(num_actions).to(device)
    target.load_state_dict(q.state_dict())
    acting = EpsilonGreedy(q, num_actions).to(device)
    # fused: one kernel for the whole Adam step, where CUDA has it
    optimizer = torch.optim.Adam(q.parameters(), lr=args.lr, fused=cuda)
    # no more rows than the run will write: the storage is laid out in full on first write
    rb = EpisodeLog(min(args.buffer_size, args.steps), args.envs, device, args.seed)

    collector = AsyncBatchedCollector(
        [env_fn] * args.envs,
        acting,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.steps,
        policy_device=device,
        cuda_graph=cuda,
        inference_backend=args.inference_backend,
        replay_buffer=rb,
        train_ratio=args.batch_size / args.train_every,
        learning_starts=args.learning_starts,
        seed=args.seed,
    )
    print(
        f"DQN on {args.env_id}: {args.envs} envs, {args.steps} env steps, learner and "
        f"replay buffer on {device}, acting {'as a CUDA graph' if cuda else 'eagerly'}",
        flush=True,
    )
    start = last_log = time.perf_counter()
    learn_start: tuple[float, int] | None = None  # (time, env steps) of the first update
    updates = logged = 0
    recent: deque[float] = deque(maxlen=20)
    with collector:
        collector.start()
        # True while the learner is below its share (train_ratio rows sampled per row
        # collected past learning_starts); False once collection has ended and the share
        # is used up (or after a minute with nothing to sample: join() then says why).
        while collector.wait_to_sample(timeout=60.0):
            # progress: returns of the episodes finished since the last look
            recent.extend(ret for _, ret in rb.finished[logged:])
            logged = len(rb.finished)
            now = time.perf_counter()
            if now - last_log >= args.log_every:
                last_log = now
                ups = updates / (now - learn_start[0]) if learn_start else 0.0
                print(
                    f"{now - start:6.0f} s  steps {rb.written:9d}  "
                    f"{rb.written / (now - start):6.0f} env steps/s  {ups:5.0f} updates/s  "
                    f"episodes {len(rb.finished):4d}  mean return (last 20) "
                    f"{np.mean(recent) if recent else float('nan'):6.1f}  "
                    f"epsilon {float(acting.epsilon):.3f}",
                    flush=True,
                )

            if learn_start is None:
                learn_start = (time.perf_counter(), rb.written)

            # one DQN update: Huber loss on the TD error, rewards clipped to their sign
            batch = rb.sample(args.batch_size)
            with torch.no_grad():
                next_q = target(batch["next", "observation"]).max(dim=-1).values
                not_done = (~batch["next", "terminated"]).float()
                reward = batch["next", "reward"].sign()
                td_target = reward + args.gamma * next_q * not_done
            q_taken = q(batch["observation"]).gather(1, batch["action"][:, None]).squeeze(1)
            loss = F.smooth_l1_loss(q_taken, td_target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1

            # target copy; new weights and exploration rate for the collector
            if updates % args.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % args.push_every == 0:
                frac = min(1.0, rb.written / args.explore_steps)
                acting.epsilon.fill_(1.0 + frac * (args.final_epsilon - 1.0))
                collector.update_policy_weights_(acting)
        collector.join(timeout=60.0)  # raises the background error, if collection failed
        stats = collector.stats()
    seconds = time.perf_counter() - start

    learning = None
    if learn_start is not None:
        learn_seconds = time.perf_counter() - learn_start[0]
        learning = {
            "seconds": learn_seconds,
            "env_steps_per_second": (rb.written - learn_start[1]) / learn_seconds,
            "updates_per_second": updates / learn_seconds,
        }
    returns = [r for _, r in rb.finished]
    summary = {
        "env_id": args.env_id,
        "device": device,
        "env_steps": rb.written,
        "updates": updates,
        "episodes": len(returns),
        "mean_return_last_20": float(np.mean(returns[-20:])) if returns else None,
        "wall_seconds": seconds,
        "env_steps_per_second": rb.written / seconds,
        "while_learning": learning,  # from the first update on: the learner sets the pace
        "train_ratio": stats.get("train_ratio"),
        "mean_inference_batch": stats["server"].get("mean_batch_size"),
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dqn_atari.json").write_text(json.dumps({**summary, "curve": rb.finished}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no learning-curve PNG")
        return
    steps, rets = zip(*rb.finished, strict=True) if rb.finished else ((), ())
    smooth = [np.mean(rets[max(0, i - 19) : i + 1]) for i in range(len(rets))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rets, ".", alpha=0.3, label="episode return")
    ax.plot(steps, smooth, label="mean of the last 20")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(f"DQN on {args.env_id}, rlcollect background collection ({seconds:.0f} s)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out / "dqn_atari.png", dpi=120)
    print(f"learning curve: {args.out / 'dqn_atari.png'}")


if __name__ == "__main__":
    main()
