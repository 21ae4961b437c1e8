"""Collect Atari Pong frames with rlcollect and compare with the envs' own speed.

8 Pong envs (grayscale, every second pixel, 4 stacked frames: 4x105x80 uint8) run in
worker processes; a small CNN picks actions on the best device present: on a GPU
batched by the inference server as a CUDA graph, on a CPU-only machine inside each
worker process for its own envs (``inference_backend="worker"``); the envs are grouped
into about one worker process per core (``envs_per_worker="auto"``).
The script prints the collector's frames/s, the mean inference batch size and the
driver's CPU time per frame, then the throughput of the loop a user would write instead
(the same envs in gymnasium's AsyncVectorEnv, the same policy acting on each step's
batch) and the env-only throughput of the same 8 envs (random actions, no policy), both
measured in this run, and the ratios.

    python examples/quickstart.py [--frames 20000] [--envs 8]
"""

from __future__ import annotations

import argparse
import time

import ale_py
import gymnasium as gym
import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from rlcollect import AsyncBatchedCollector
from rlcollect.envspeed import env_throughput


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
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--env-seconds", type=float, default=3.0)
    args = parser.parse_args()
    # This script's own threads leave the cores to the env workers (docs/tuning.md,
    # "Torch threads"); the collector warns where they would compete.
    torch.set_num_threads(1)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    policy = SmallCNN(num_actions=6)
    policy(torch.zeros(1, 4, 105, 80, dtype=torch.uint8))  # sizes the lazy layer

    if cuda:  # one batching server, its whole step a CUDA graph
        how, placement = "cuda, as a CUDA graph", {"cuda_graph": True}
    else:  # no GPU: each worker process runs the policy for its own envs
        how, placement = "cpu, in each worker process", {"inference_backend": "worker"}
    with AsyncBatchedCollector(
        [make_pong] * args.envs,
        policy,
        frames_per_batch=512,
        total_frames=args.frames,
        transport="process_slots",
        policy_device=device,
        envs_per_worker="auto",  # about one worker process per core
        worker_splits="auto",  # with a GPU, half of each worker steps while half waits
        **placement,
    ) as collector:
        workers = args.envs // collector.envs_per_worker
        print(
            f"collecting {args.frames} frames from {args.envs} Pong envs in {workers} "
            f"worker processes, policy on {how}"
        )
        start, frames = None, 0
        with tqdm(total=args.frames, unit="frame", desc="collecting") as bar:
            for batch in collector:
                if start is None:  # time from the first batch: process start-up excluded
                    start, cpu0, first = time.perf_counter(), time.process_time(), batch.numel()
                frames += batch.numel()
                bar.update(batch.numel())
        stats = collector.stats()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    fps = (frames - first) / elapsed
    print(f"collector:        {fps:10.0f} frames/s")
    print(f"mean batch size:  {stats['server']['mean_batch_size']:10.2f} envs per policy call")
    print(f"driver CPU:       {1e3 * cpu / (frames - first):10.3f} ms per frame")

    print(f"the loop you would write instead, for {args.env_seconds:.0f} s ...")
    loop_fps = async_vector_loop(args.envs, policy.to(device), device, args.env_seconds)
    print(f"AsyncVectorEnv loop: {loop_fps:7.0f} frames/s (the same envs and policy)")
    print(f"measuring the same {args.envs} envs alone for {args.env_seconds:.0f} s ...")
    env_fps = env_throughput([make_pong] * args.envs, seconds=args.env_seconds)
    print(f"env-only:         {env_fps:10.0f} frames/s (random actions, no policy)")
    print(f"collector / AsyncVectorEnv loop: {fps / loop_fps:6.2f}")
    print(f"collector / env-only:            {fps / env_fps:6.2f}")


def async_vector_loop(num_envs: int, policy: nn.Module, device: str, seconds: float) -> float:
    """Frames/s of the hand-written alternative: the envs in gymnasium's AsyncVectorEnv
    (a process each), the policy here acting on each step's batch in turn."""
    envs = gym.vector.AsyncVectorEnv([make_pong] * num_envs)
    try:
        obs, _ = envs.reset(seed=0)
        frames, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            with torch.inference_mode():
                action = policy(torch.from_numpy(obs).to(device))["action"].cpu().numpy()
            obs, *_ = envs.step(action)
            frames += num_envs
        return frames / (time.perf_counter() - start)
    finally:
        envs.close()


if __name__ == "__main__":
    main()
