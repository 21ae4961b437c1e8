"""Collect Atari Pong frames with rlcollect and compare with the loop you would write.

8 Pong envs (grayscale, every second pixel, 4 stacked frames: 4x105x80 uint8) and a
small CNN that samples its actions. The collector is given no layout arguments: it
measures the envs, the policy and the machine when it is built and chooses where the
envs and the policy run; the script prints that choice (``collector.describe()``).

Then it measures, in alternating windows so that a busy spell of the machine hits all
three alike: the collector, the loop a user would write instead (the same envs in
gymnasium's AsyncVectorEnv, the same policy acting on each step's batch) and the envs
alone (random actions, no policy: the ceiling). It prints each round's frames/s and
the median of the rounds' ratios.

    python examples/quickstart.py [--envs 8] [--rounds 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator

import ale_py
import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput

# ale-py prints its banner once in each process that builds an env: the collector's
# workers, the AsyncVectorEnv's processes and the env-only measure's would print it
# again and again. This process shows it once; the processes it starts inherit this
# variable and keep quiet.
DRIVER = "QUICKSTART_DRIVER_PID"


class HalfResolution(gym.ObservationWrapper):
    """Keep every second row and column: 210x160 → 105x80, no image library needed."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        h, w = env.observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (h // 2, w // 2), np.uint8)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[::2, ::2]


def make_pong() -> gym.Env:
    # Registering here, not at import: the factory runs in worker processes, which
    # never import this script.
    if os.environ.get(DRIVER, str(os.getpid())) != str(os.getpid()):
        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Warning)  # no banner here
    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", obs_type="grayscale", repeat_action_probability=0.0)
    return gym.wrappers.FrameStackObservation(HalfResolution(env), 4)


class SmallCNN(nn.Module):
    """uint8 frames in, sampled actions and their log-probabilities out.

    It samples by Gumbel-max — argmax of the logits plus Gumbel noise, a draw from
    Categorical(logits) — which needs no host synchronisation, so on a GPU the whole
    step can be captured as a CUDA graph.
    """

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 16, 8, stride=4), nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
            nn.Flatten(), nn.LazyLinear(256), nn.ReLU(), nn.Linear(256, num_actions),
        )  # fmt: skip

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(obs.float() / 255.0)
        noise = -torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-9, 1.0)))
        action = (logits + noise).argmax(-1)
        log_prob = torch.log_softmax(logits, -1).gather(-1, action[:, None])[:, 0]
        return {"action": action, "log_prob": log_prob}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="windows of each of the three")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each window")
    args = parser.parse_args()
    os.environ[DRIVER] = str(os.getpid())
    # This script's own threads leave the cores to the env workers (docs/tuning.md,
    # "Torch threads"); the collector warns where they would compete.
    torch.set_num_threads(1)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    policy = SmallCNN(num_actions=6)
    policy(torch.zeros(1, 4, 105, 80, dtype=torch.uint8))  # sizes the lazy layer

    collector = AsyncBatchedCollector(
        [make_pong] * args.envs,
        policy,
        frames_per_batch=512,
        # The policy's execution, not its layout: on a GPU its whole step is one CUDA
        # graph (it needs no host synchronisation). Where the envs and the policy run is
        # the collector's to choose.
        cuda_graph=cuda,
    )
    print(collector.describe())  # what it chose, from which figures, by which rule
    loop = AsyncVectorLoop(args.envs, policy.to(device), device)
    batches = iter(collector)
    rounds: list[tuple[float, float, float]] = []
    try:
        print(f"\n{'round':>5} {'collector':>10} {'loop':>10} {'env-only':>10}  (frames/s)")
        for r in range(args.rounds):
            fps = window(batches, args.seconds)
            loop_fps = loop.window(args.seconds)
            env_fps = env_throughput([make_pong] * args.envs, seconds=args.seconds)
            rounds.append((fps, loop_fps, env_fps))
            print(f"{r + 1:5d} {fps:10.0f} {loop_fps:10.0f} {env_fps:10.0f}")
        stats = collector.stats()
    finally:
        collector.shutdown()
        loop.close()
    per_loop = statistics.median(c / lo for c, lo, _ in rounds)
    per_env = statistics.median(c / e for c, _, e in rounds)
    mean_batch = stats.get("server", {}).get("mean_batch_size")
    if mean_batch is not None:
        print(f"mean batch size:  {mean_batch:10.2f} envs per policy call")
    print(f"driver CPU:       {stats['driver_cpu_ms_per_frame']:10.3f} ms per frame")
    print(f"collector / AsyncVectorEnv loop: {per_loop:6.2f} (median of {len(rounds)} rounds)")
    print(f"collector / env-only:            {per_env:6.2f} (median of {len(rounds)} rounds)")


def window(batches: Iterator[object], seconds: float, warmup: float = 0.5) -> float:
    """Frames/s of the collector over ``seconds``, after ``warmup`` seconds that drain
    what its workers collected while the other two were measured."""
    start = time.perf_counter()
    for _ in batches:
        if time.perf_counter() - start >= warmup:
            break
    frames, start = 0, time.perf_counter()
    for batch in batches:
        frames += batch.numel()  # type: ignore[attr-defined]
        if time.perf_counter() - start >= seconds:
            break
    return frames / (time.perf_counter() - start)


class AsyncVectorLoop:
    """The hand-written alternative: the envs in gymnasium's AsyncVectorEnv (a process
    each), the policy here acting on each step's batch in turn."""

    def __init__(self, num_envs: int, policy: nn.Module, device: str) -> None:
        self.envs = gym.vector.AsyncVectorEnv([make_pong] * num_envs)
        self.policy, self.device, self.num_envs = policy, device, num_envs
        self.obs, _ = self.envs.reset(seed=0)

    def window(self, seconds: float) -> float:
        frames, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            with torch.inference_mode():
                obs = torch.from_numpy(self.obs).to(self.device)
                action = self.policy(obs)["action"].cpu().numpy()
            self.obs, *_ = self.envs.step(action)
            frames += self.num_envs
        return frames / (time.perf_counter() - start)

    def close(self) -> None:
        self.envs.close()


if __name__ == "__main__":
    main()
