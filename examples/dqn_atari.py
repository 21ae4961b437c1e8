"""DQN on Atari with CleanRL's hyperparameters, each frame of the replay stored once.

ale-py's ``AtariVectorEnv`` (84x84 grayscale, 4 stacked frames, frameskip 4 with the max
of the last two, 1 to 30 no-ops and FIRE at reset) steps ``--envs`` games in a worker of
the collector, which writes every transition into ``ReplayBuffer(buffer_size,
frame_stack=4)`` from its background thread. Each 84x84 frame is stored once: CleanRL's
1M transitions take 7.6 GB instead of 56 GB, and ``observation`` and
``("next", "observation")`` are rebuilt when sampled (on the GPU where the buffer is).

This script is the learner, with the hyperparameters of CleanRL's ``dqn_atari.py``: the
Nature CNN, Adam at 1e-4, batches of 32, one gradient step per 4 env steps
(``train_ratio = 32 / 4``, which holds whatever the machine), learning from 80k steps,
epsilon from 1 to 0.01 over the first 10% of the steps (it travels with the weights
pushed to the collector), the target network copied every 1000 env steps, the mean
squared TD error on rewards clipped to their sign. Unlike CleanRL, ``--envs`` games step
together (the hyperparameters count env steps of all of them), and an episode is a whole
game (ale-py's ``episodic_life`` restarts the game at each life lost, which CleanRL's
wrapper does not), so its return is the game's score. It prints env steps/s, updates/s
and the scores, and writes a JSON summary and the learning curve (a PNG, if matplotlib
is installed) to ``--out``.

    python examples/dqn_atari.py --out examples/results            # Pong, 10M steps: a GPU
    python examples/dqn_atari.py --total-steps 640 --buffer-size 1024 --learning-starts 512 \\
        --envs 2 --out /tmp/dqn_atari                               # a CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from rlcollect import AsyncBatchedCollector, ReplayBuffer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env-id", default="pong", help="an ALE ROM: pong, breakout, ...")
    p.add_argument("--total-steps", type=int, default=10_000_000, help="env steps, all envs")
    p.add_argument("--envs", type=int, default=8, help="games in the AtariVectorEnv")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--buffer-device", default=None, help="default: cuda where available")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-every", type=int, default=4, help="env steps per gradient step")
    p.add_argument("--learning-starts", type=int, default=80_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--target-every", type=int, default=1000, help="env steps between copies")
    p.add_argument("--explore-fraction", type=float, default=0.1, help="of the steps: eps 1->end")
    p.add_argument("--final-epsilon", type=float, default=0.01)
    p.add_argument("--push-every", type=int, default=25, help="updates between weight pushes")
    # rows per replay write: 32 steps of each env, so a stack's frames mostly lie together
    p.add_argument("--frames-per-batch", type=int, default=256)
    p.add_argument("--transport", choices=["thread", "process_slots"], default="process_slots")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between reports")
    p.add_argument("--out", type=Path, default=Path("runs"), help="where results go")
    return p.parse_args()


def make_env(game: str, num_envs: int):
    """``num_envs`` games in one AtariVectorEnv, stepped whole. Raw rewards (the learner
    clips them), so that an episode's return is the game's score."""
    from ale_py.vector_env import AtariVectorEnv  # here: it runs in the worker

    return AtariVectorEnv(
        game, num_envs, batch_size=num_envs, num_threads=min(num_envs, 4),
        img_height=84, img_width=84, grayscale=True, stack_num=4, frameskip=4,
        maxpool=True, noop_max=30, use_fire_reset=True, reward_clipping=False,
        repeat_action_probability=0.0,
    )  # fmt: skip


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
    """The acting policy: greedy in Q, random with probability ``epsilon``, a buffer that
    travels with the weights. No host synchronisation: a CUDA graph can capture it."""

    def __init__(self, q: NatureCNN, num_actions: int) -> None:
        super().__init__()
        self.q, self.num_actions = q, num_actions
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        greedy = self.q(obs).argmax(dim=-1)
        random = torch.randint_like(greedy, self.num_actions)
        explore = torch.rand(greedy.shape, device=obs.device) < self.epsilon
        return torch.where(explore, random, greedy)


class ScoredReplay(ReplayBuffer):
    """The replay buffer (each frame stored once), also logging each finished game:
    (env steps so far, score), from the collector's episode returns."""

    def __init__(self, capacity: int, device: str, seed: int) -> None:
        super().__init__(capacity, device=device, seed=seed, frame_stack=4)
        self.finished: list[tuple[int, float]] = []

    def extend(self, data: TensorDict) -> None:
        super().extend(data)
        done = data["next", "done"]
        ends = (self.written - len(done) + 1 + done.nonzero().squeeze(1)).tolist()
        scores = data["next", "episode_return"][done].tolist()
        self.finished += zip(ends, scores, strict=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # the learner's threads: leave the cores to the envs
    env_fn = functools.partial(make_env, args.env_id, args.envs)
    probe = env_fn()
    num_actions = int(probe.single_action_space.n)
    probe.close()

    q = NatureCNN(num_actions).to(device)
    target = NatureCNN(num_actions).to(device)
    target.load_state_dict(q.state_dict())
    acting = EpsilonGreedy(q, num_actions).to(device)
    optimizer = torch.optim.Adam(q.parameters(), lr=args.lr, fused=cuda)
    rb = ScoredReplay(args.buffer_size, args.buffer_device or device, args.seed)
    explore_steps = args.explore_fraction * args.total_steps

    collector = AsyncBatchedCollector(
        [env_fn],
        acting,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_steps,
        transport=args.transport,
        policy_device=device,
        cuda_graph=cuda,
        replay_buffer=rb,
        train_ratio=args.batch_size / args.train_every,
        learning_starts=args.learning_starts,
        seed=args.seed,
    )
    print(
        f"DQN on {args.env_id}: {args.envs} envs, {args.total_steps} env steps, replay of "
        f"{args.buffer_size} on {rb.device} (frame_stack=4), learner on {device}",
        flush=True,
    )
    start = last_log = time.perf_counter()
    learn_start: tuple[float, int] | None = None  # (time, env steps) of the first update
    updates = logged = copies = 0
    recent: deque[float] = deque(maxlen=20)
    with collector:
        collector.start()
        # True while the learner is below its share of samples; False once collection
        # has ended and the share is used up (or after a minute with nothing to sample).
        while collector.wait_to_sample(timeout=60.0):
            recent.extend(score for _, score in rb.finished[logged:])
            logged = len(rb.finished)
            now = time.perf_counter()
            if now - last_log >= args.log_every:
                last_log = now
                ups = updates / (now - learn_start[0]) if learn_start else 0.0
                print(
                    f"{now - start:6.0f} s  steps {rb.written:9d}  "
                    f"{rb.written / (now - start):6.0f} env steps/s  {ups:5.0f} updates/s  "
                    f"games {len(rb.finished):4d}  mean score (last 20) "
                    f"{np.mean(recent) if recent else float('nan'):6.1f}  "
                    f"epsilon {float(acting.epsilon):.3f}  replay {rb.nbytes / 1e9:.2f} GB",
                    flush=True,
                )
            if learn_start is None:
                learn_start = (time.perf_counter(), rb.written)

            # one DQN update: mean squared TD error, rewards clipped to their sign
            batch = rb.sample(args.batch_size).to(device, non_blocking=True)
            with torch.no_grad():
                next_q = target(batch["next", "observation"]).max(dim=-1).values
                not_done = (~batch["next", "terminated"]).float()
                td_target = batch["next", "reward"].sign() + args.gamma * next_q * not_done
            q_taken = q(batch["observation"]).gather(1, batch["action"][:, None]).squeeze(1)
            loss = F.mse_loss(q_taken, td_target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1

            # target copy every target_every env steps; new weights and epsilon pushed
            if rb.written // args.target_every > copies:
                copies = rb.written // args.target_every
                target.load_state_dict(q.state_dict())
            if updates % args.push_every == 0:
                frac = min(1.0, rb.written / explore_steps)
                acting.epsilon.fill_(1.0 + frac * (args.final_epsilon - 1.0))
                collector.update_policy_weights_(acting)
        collector.join(timeout=60.0)  # raises the background error, if collection failed
        stats = collector.stats()
    seconds = time.perf_counter() - start
    write_results(args, rb, updates, learn_start, seconds, stats, device)


def write_results(args, rb, updates, learn_start, seconds, stats, device) -> None:
    """The JSON summary (with the curve) and, with matplotlib, the curve as a PNG."""
    learning = None
    if learn_start is not None:
        learn_seconds = time.perf_counter() - learn_start[0]
        learning = {
            "seconds": learn_seconds,
            "env_steps_per_second": (rb.written - learn_start[1]) / learn_seconds,
            "updates_per_second": updates / learn_seconds,
        }
    scores = [s for _, s in rb.finished]
    summary = {
        "env_id": args.env_id,
        "device": device,
        "replay": {
            "device": str(rb.device),
            "capacity": rb.capacity,
            "len": len(rb),
            "frame_stack": rb.frame_stack,
            "gb": rb.nbytes / 1e9,
        },
        "env_steps": rb.written,
        "updates": updates,
        "episodes": len(scores),
        "mean_return_last_20": float(np.mean(scores[-20:])) if scores else None,
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
    steps, got = zip(*rb.finished, strict=True) if rb.finished else ((), ())
    smooth = [np.mean(got[max(0, i - 19) : i + 1]) for i in range(len(got))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, got, ".", alpha=0.3, label="game score")
    ax.plot(steps, smooth, label="mean of the last 20")
    ax.set_xlabel("env steps")
    ax.set_ylabel("score")
    ax.set_title(f"DQN on {args.env_id}, replay with frame_stack=4 ({seconds:.0f} s)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out / "dqn_atari.png", dpi=120)
    print(f"learning curve: {args.out / 'dqn_atari.png'}")


if __name__ == "__main__":
    main()
