"""PPO with the Nature CNN on Atari Pong, fed by rlcollect, against a plain loop.

One file, read top to bottom. Proximal policy optimisation (clipped surrogate, clipped
value loss, entropy bonus, GAE, advantages normalised per minibatch, Adam annealed
linearly) trains a Nature CNN that shares its trunk between the action logits and the
value. The envs are Pong through ale-py's native ``AtariVectorEnv`` (C++ threads; the
usual recipe: grayscale 84x84, 4 stacked frames, action repeat 4 with the max of the
last two frames, up to 30 no-op starts, FIRE at reset, episodic life, rewards clipped
to [-1, 1]), or with ``--envs gym`` the same recipe in numpy around gymnasium's
``ALE/Pong-v5``, one env per Python process. Pong has no lives and rewards of +-1 only,
so episodic life and clipping change nothing there: the logged returns are game scores.

Two ways to step the same envs, the same learner code for both:

* ``--loop rlcollect`` (default): rollouts from ``AsyncBatchedCollector(on_policy=True)``,
  ``[num_envs, num_steps]`` batches all acted by the weights of the last update, which
  are pushed after every update (``update_policy_weights_``). On a GPU the acting step
  (uint8 -> float, forward, Gumbel-max sampling) is a CUDA graph (``cuda_graph=True``).
  ALE: the envs are split into ``--vector-envs`` vector envs (on 16 cores, 8 of 4), each
  stepped whole by a worker process over shared memory, each with half the cores' worth
  of C++ threads: while one vector env's worker waits for its actions, the others'
  threads take its cores. gym: worker processes of single envs.
* ``--loop sync``: the baseline, a plain loop in this process: ``step()`` the whole
  ``AtariVectorEnv`` (gym: a ``gymnasium.vector.AsyncVectorEnv``), act, store, repeat.
  Made as fast as a hand-written loop reasonably gets: pinned staging, rollout storage
  on the GPU, the acting step as a CUDA graph of its own, twice as many C++ threads as
  cores.

The learner's minibatch step (forward, losses, backward, clip, Adam) is one CUDA graph
on a GPU, replayed 48 times per update (``--no-graph-learner``: eager), for both loops.

``--overlap`` (rlcollect only) collects the next rollout while the learner learns
(``policy_lag=1``): the collector starts round ``k+1`` as soon as it hands out round
``k``, so the envs step with the weights of update ``k-1`` while update ``k`` runs. The
lag is then exactly one update (``policy_version`` of the batch against the learner's
count of updates, both logged); PPO's ratio uses the behaviour policy's stored
log-probability, so its clip bounds how far the stale rows move the policy.

Hyperparameters. The defaults are the run for the 16-core H200 (goal: mean return of the
last 20 episodes >= 18 within 8 minutes of wall clock from process start). They start
from the settings EnvPool's CleanRL example gives for solving Pong in about five minutes
(``examples/cleanrl_examples/ppo_atari_envpool.py`` in sail-sg/envpool: 16 envs, 128
steps, 8 minibatches of 256, 3 epochs, clip 0.2; otherwise CleanRL's Atari defaults:
Adam 2.5e-4 annealed to 0, entropy 0.01, value 0.5, gradient norm 0.5, gamma 0.99,
lambda 0.95) and double the envs, keeping the minibatch size and the env steps per
gradient step: 32 envs x 128 steps = 4,096 per rollout, 16 minibatches of 256, 3 epochs,
so 48 gradient steps per rollout, one per 85 env steps as in the original. More envs
keep 16 cores busier and halve the updates per env step, whose cost on the GPU is
mostly fixed; the same minibatch and steps per gradient step should keep the learning
per env step of the recipe (not measured here). The learning rate anneals over
``--total-timesteps`` (10M, CleanRL's Atari budget), so it is still high when
``--max-seconds`` (480 s from process start) ends the run.

Output (``--out``, default ``runs/``): ``ppo_atari_<envs>_<loop>_seed<N>.json``
(config; every episode's return, env step and wall time; every update's losses, KL and
policy lag; a summary with the time and env step at which the mean of the last 20
returns first reached ``--target-return``) and a PNG of the returns against wall time
and against env steps. ``--plot A.json B.json`` draws runs already made into one figure.

    python examples/ppo_atari.py                          # rlcollect, the H200 run
    python examples/ppo_atari.py --overlap                # collection beside learning
    python examples/ppo_atari.py --loop sync              # the baseline
    python examples/ppo_atari.py --envs gym --loop sync   # Python envs in processes
    python examples/ppo_atari.py --num-envs 2 --num-steps 16 --total-timesteps 64 \\
        --num-minibatches 2 --update-epochs 1             # a CPU smoke run
    python examples/ppo_atari.py --plot runs/ppo_atari_ale_*.json
"""

from __future__ import annotations

import os

# One BLAS thread per process, set before numpy starts its pool: the gym envs' frame
# resize is a small matrix product, and 32 env processes forked from this one must not
# each start a pool of every core (the collector's worker processes get the same setting
# from rlcollect).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import contextlib
import functools
import json
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlcollect import AsyncBatchedCollector


def process_start() -> float:
    """When this process started (seconds since the epoch), from Linux's /proc: wall time
    counts from there, interpreter start-up and imports included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


PROCESS_START = process_start()
CORES = len(os.sched_getaffinity(0))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--envs",
        choices=["ale", "gym"],
        default="ale",
        help="ale-py's AtariVectorEnv, or gymnasium envs in processes",
    )
    p.add_argument("--loop", choices=["rlcollect", "sync"], default="rlcollect")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="rlcollect: collect the next rollout while the learner learns",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=10_000_000)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=480.0,
        help="stop after this much wall time from process start (0: none)",
    )
    p.add_argument(
        "--max-episode-frames",
        type=int,
        default=108_000,
        help="episodes truncated after this many frames (the standard: 30 minutes of play)",
    )
    p.add_argument("--target-return", type=float, default=18.0)
    p.add_argument("--target-window", type=int, default=20, help="episodes in the mean")
    p.add_argument(
        "--stop-at-target", action="store_true", help="stop as soon as the target mean is reached"
    )
    # PPO
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--num-steps", type=int, default=128, help="steps of each env per rollout")
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--no-anneal-lr", dest="anneal_lr", action="store_false")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=16)
    p.add_argument("--update-epochs", type=int, default=3)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument(
        "--no-graph-learner",
        dest="graph_learner",
        action="store_false",
        help="on a GPU, run each minibatch step eagerly rather than as a CUDA graph",
    )
    # how the envs run
    p.add_argument(
        "--env-threads",
        type=int,
        default=None,
        help="ale: C++ threads in all (default: twice the cores for sync; for rlcollect "
        "half the cores' worth per vector env, which oversubscribes the cores: "
        "docs/training-pong.md)",
    )
    p.add_argument(
        "--vector-envs",
        type=int,
        default=None,
        help="ale + rlcollect: vector envs the envs are split into, one worker each "
        "(default: the most that divide --num-envs, at most half the cores)",
    )
    p.add_argument(
        "--transport",
        choices=["thread", "process_slots"],
        default="process_slots",
        help="rlcollect: where the workers run",
    )
    p.add_argument("--inference-backend", choices=["thread", "process"], default="thread")
    p.add_argument(
        "--envs-per-worker",
        type=int,
        default=None,
        help="gym + rlcollect (default: the fewest that fit one worker a core)",
    )
    p.add_argument("--worker-splits", type=int, default=None, help="gym + rlcollect")
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between reports")
    p.add_argument("--out", type=Path, default=Path("runs"), help="where results go")
    p.add_argument(
        "--plot",
        type=Path,
        nargs="+",
        default=None,
        help="no training: draw these runs' JSON into one figure in --out",
    )
    args = p.parse_args()
    if args.overlap and args.loop != "rlcollect":
        p.error("--overlap is a way of running the collector: it needs --loop rlcollect")
    return args


# ----------------------------------------------------------------------------- envs


def make_ale_vector(num_envs: int, num_threads: int, max_frames: int) -> gym.vector.VectorEnv:
    """``num_envs`` Pong envs in one ``AtariVectorEnv``, stepped whole: ``batch_size ==
    num_envs`` and ``SameStep`` autoreset (an on-policy round steps every env once per
    step; ``docs/usage.md``, *on_policy*)."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(
        "pong",
        num_envs,
        batch_size=num_envs,
        num_threads=num_threads,
        autoreset_mode="SameStep",
        img_height=84,
        img_width=84,
        grayscale=True,
        stack_num=4,
        frameskip=4,
        maxpool=True,
        noop_max=30,
        use_fire_reset=True,
        episodic_life=True,
        reward_clipping=True,
        repeat_action_probability=0.0,
        max_num_frames_per_episode=max_frames,
    )


def area_matrix(size_in: int, size_out: int) -> np.ndarray:
    """``[size_out, size_in]`` weights of an area-averaging resize along one axis: output
    pixel ``i`` covers ``[i * s, (i + 1) * s)`` of the input, ``s = size_in / size_out``,
    and takes each input pixel in proportion to the overlap."""
    scale = size_in / size_out
    lo = np.arange(size_out)[:, None] * scale
    j = np.arange(size_in)[None, :]
    overlap = np.clip(np.minimum(lo + scale, j + 1) - np.maximum(lo, j), 0.0, None)
    return (overlap / scale).astype(np.float32)


class AtariRecipe(gym.Wrapper):
    """The ``AtariVectorEnv`` recipe around one gymnasium ALE env, in numpy (no OpenCV):
    1-30 no-ops and FIRE at reset, each action repeated 4 frames with the pixel-wise max
    of the last two, the grayscale screen area-averaged to 84x84, rewards clipped.
    Episodic life is left out: Pong has no lives."""

    def __init__(self, env: gym.Env, skip: int = 4, size: int = 84, noop_max: int = 30) -> None:
        super().__init__(env)
        self.skip, self.noop_max = skip, noop_max
        height, width = env.observation_space.shape
        self.rows = area_matrix(height, size)  # [84, 210]
        self.cols = area_matrix(width, size).T  # [160, 84]
        self.fire = env.unwrapped.get_action_meanings()[1] == "FIRE"
        self.observation_space = gym.spaces.Box(0, 255, (size, size), np.uint8)

    def shrink(self, frame: np.ndarray) -> np.ndarray:
        small = self.rows @ frame.astype(np.float32) @ self.cols
        return np.rint(small).clip(0, 255).astype(np.uint8)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        frame, info = self.env.reset(**kwargs)
        actions = [0] * int(self.unwrapped.np_random.integers(1, self.noop_max + 1))
        for action in actions + ([1] if self.fire else []):
            frame, _, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                frame, info = self.env.reset()
        return self.shrink(frame), info

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        total, frames = 0.0, []
        for _ in range(self.skip):
            frame, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            frames = [*frames[-1:], frame]
            if terminated or truncated:
                break
        return (
            self.shrink(np.max(frames, axis=0)),
            float(np.sign(total)),
            terminated,
            truncated,
            info,
        )


def make_gym_env(max_frames: int) -> gym.Env:
    gym.register_envs(ale_py)  # here: it runs in the worker processes
    env = gym.make(
        "ALE/Pong-v5",
        obs_type="grayscale",
        frameskip=1,
        repeat_action_probability=0.0,
        max_num_frames_per_episode=max_frames,
    )
    return gym.wrappers.FrameStackObservation(AtariRecipe(env), stack_size=4)


def vector_envs(args: argparse.Namespace) -> int:
    """ALE + rlcollect: how many vector envs the envs are split into."""
    if args.vector_envs is not None:
        return int(args.vector_envs)
    return max(d for d in range(1, max(1, CORES // 2) + 1) if args.num_envs % d == 0)


def env_threads(args: argparse.Namespace) -> int:
    """ALE: C++ threads in all. Both defaults oversubscribe the cores, the fastest
    measured on the H200 (docs/training-pong.md): each vector env stepped whole idles its
    threads while its loop acts, and the other vector envs' threads take the cores."""
    if args.env_threads is not None:
        return int(args.env_threads)
    if args.loop == "sync":
        return 2 * CORES
    return vector_envs(args) * max(1, CORES // 2)


def num_actions(args: argparse.Namespace) -> int:
    probe = make_ale_vector(1, 1, 1000) if args.envs == "ale" else make_gym_env(1000)
    n = int(probe.single_action_space.n if args.envs == "ale" else probe.action_space.n)
    probe.close()
    return n


# ----------------------------------------------------------------------------- agent


def layer_init(layer: nn.Module, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """The Nature CNN trunk (3 convolutions, 512 hidden units) with two heads: action
    logits (initialised small, so the first policy is near uniform) and the value."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )  # fmt: skip
        self.actor = layer_init(nn.Linear(512, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1.0)

    def hidden(self, obs: torch.Tensor) -> torch.Tensor:
        return self.trunk(obs.float() / 255.0)  # uint8 frames arrive as they are

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self.hidden(obs)).squeeze(-1)

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Log-probability of ``action``, entropy and value, under the current weights."""
        h = self.hidden(obs)
        logp = self.actor(h).log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, action[:, None]).squeeze(-1), entropy, self.critic(h).squeeze(-1)

    def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The acting step the collector serves: a sampled action, its log-probability
        and the value. Gumbel-max sampling never waits for the host, so the whole step
        can be captured as a CUDA graph."""
        h = self.hidden(obs)
        logp = self.actor(h).log_softmax(-1)
        gumbel = -torch.log(-torch.log(torch.rand_like(logp)))
        action = (logp + gumbel).argmax(-1)
        return {
            "action": action,
            "logprob": logp.gather(-1, action[:, None]).squeeze(-1),
            "value": self.critic(h).squeeze(-1),
        }


# ----------------------------------------------------------------------------- rollouts
#
# Both loops yield dicts of the same tensors: obs, action, logprob, value, reward, done,
# episode_return ([num_envs, num_steps, ...]), last_next_obs (what each env observed
# after its last step, to bootstrap from) and version (the weights that acted).


def as_rollout(batch: Any) -> dict[str, Any]:
    """An on-policy batch of the collector (``[num_envs, num_steps]``) as a rollout."""
    return {
        "obs": batch["observation"],
        "action": batch["action"],
        "logprob": batch["logprob"],
        "value": batch["value"],
        "reward": batch["next", "reward"],
        "done": batch["next", "done"],
        "episode_return": batch["next", "episode_return"],
        "last_next_obs": batch["next", "observation"][:, -1],
        "version": int(batch["policy_version"][0, 0]),  # one version per on-policy batch
    }


def rlcollect_rollouts(
    agent: Agent, args: argparse.Namespace, device: torch.device, report: dict[str, Any]
) -> Generator[dict[str, Any], None, None]:
    """Rollouts from the collector; the caller's updated ``agent`` is pushed after each."""
    n, t = args.num_envs, args.num_steps
    iterations = args.total_timesteps // (n * t)
    if args.envs == "ale":
        groups = vector_envs(args)
        if n % groups:
            raise SystemExit(f"--num-envs {n} is not a multiple of --vector-envs {groups}")
        threads = max(1, env_threads(args) // groups)
        env_fns = [
            functools.partial(make_ale_vector, n // groups, threads, args.max_episode_frames)
        ]
        env_fns *= groups
        layout: dict[str, Any] = {"transport": args.transport}
    else:
        # the fewest envs per worker process that leave no more workers than cores
        fits = [d for d in range(1, n + 1) if n % d == 0 and n // d <= CORES]
        per_worker = args.envs_per_worker or fits[0]
        env_fns = [functools.partial(make_gym_env, args.max_episode_frames)] * n
        layout = {
            "transport": args.transport,
            "envs_per_worker": per_worker,
            "worker_splits": args.worker_splits,
        }
    report["collector_layout"] = layout
    with AsyncBatchedCollector(
        env_fns,
        agent,
        frames_per_batch=n * t,
        total_frames=iterations * n * t,
        on_policy=True,
        # Overlap: round k+1 starts as soon as round k is handed out, so it runs with the
        # weights of update k-1 while update k is computed. The push of update k waits for
        # round k+1 to end (an on-policy batch holds one version), and round k+2 starts
        # with it: a lag of one.
        policy_lag=1 if args.overlap else 0,
        policy_device=device,
        cuda_graph=device.type == "cuda",
        inference_backend=args.inference_backend,
        seed=args.seed,  # env i is first reset with seed + i, as the sync loop's
        **layout,
    ) as collector:
        try:
            for batch in collector:
                yield as_rollout(batch)
                collector.update_policy_weights_(agent)  # the next round to start acts with these
        finally:
            with contextlib.suppress(Exception):  # the run's result does not hang on it
                report["collector_stats"] = collector.stats()


class GraphedActing:
    """The sync loop's acting step as one CUDA graph, as the collector's ``cuda_graph=True``
    does it: copy the observations in, replay, read the outputs (valid until the next
    replay). The optimiser updates the weights in place, so the graph stays valid."""

    def __init__(self, agent: Agent, obs: torch.Tensor) -> None:
        self.obs = obs.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm-up off the capture: cuDNN picks its kernels here
                agent(self.obs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.out = agent(self.obs)

    def __call__(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
        self.obs.copy_(obs)
        self.graph.replay()
        return self.out


def make_sync_envs(args: argparse.Namespace) -> gym.vector.VectorEnv:
    """The baseline's envs: the same ones, in one vector env this process steps whole."""
    if args.envs == "ale":
        return make_ale_vector(args.num_envs, env_threads(args), args.max_episode_frames)
    # one process per env; forked before this process touches CUDA (train() sees to it)
    return gym.vector.AsyncVectorEnv(
        [functools.partial(make_gym_env, args.max_episode_frames)] * args.num_envs,
        context="fork",
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


def sync_rollouts(
    agent: Agent, args: argparse.Namespace, device: torch.device, envs: gym.vector.VectorEnv
) -> Generator[dict[str, Any], None, None]:
    """The baseline: the envs stepped whole from this process, the agent acting in turn;
    the envs wait while it learns, as with the on-policy collector."""
    n, t = args.num_envs, args.num_steps
    cuda = device.type == "cuda"
    obs_np, _ = envs.reset(seed=args.seed)  # sub-env i gets seed + i
    obs_shape = obs_np.shape[1:]
    staging = torch.empty((n, *obs_shape), dtype=torch.uint8, pin_memory=cuda)
    act = GraphedActing(agent, staging.to(device)) if cuda else agent
    running = np.zeros(n, np.float32)
    try:
        for _ in range(args.total_timesteps // (n * t)):
            obs = torch.empty((n, t, *obs_shape), dtype=torch.uint8, device=device)
            out = {
                key: torch.empty((n, t), dtype=dtype, device=device)
                for key, dtype in (("action", torch.int64), ("logprob", torch.float32))
            }
            out["value"] = torch.empty((n, t), device=device)
            reward, done = np.empty((n, t), np.float32), np.empty((n, t), bool)
            episode_return = np.empty((n, t), np.float32)
            for step in range(t):
                np.copyto(staging.numpy(), obs_np)
                obs[:, step].copy_(staging, non_blocking=True)
                with torch.no_grad():
                    acted = act(obs[:, step])
                for key, column in out.items():
                    column[:, step] = acted[key]
                action = acted["action"].cpu().numpy()  # waits for the step on the GPU
                obs_np, r, terminated, truncated, _ = envs.step(action)
                ended = terminated | truncated
                running += r
                reward[:, step], done[:, step], episode_return[:, step] = r, ended, running
                running[ended] = 0.0
            yield {
                "obs": obs,
                **out,
                "reward": torch.from_numpy(reward),
                "done": torch.from_numpy(done),
                "episode_return": torch.from_numpy(episode_return),
                # after an env's last step: at a done row the next episode's first
                # observation, which the done flag keeps out of the bootstrap anyway
                "last_next_obs": torch.from_numpy(obs_np.copy()),
                "version": -1,  # the learner's own weights, always current
            }
    finally:
        envs.close()


# ----------------------------------------------------------------------------- learner


class PPO:
    """The update both loops share: GAE along each env's row, then epochs of shuffled
    minibatches of the clipped objective, on ``device``.

    On a GPU (unless ``--no-graph-learner``) each minibatch step (forward, losses,
    backward, gradient clip, Adam) is one CUDA graph, replayed 48 times per update. The
    eager step launches a few hundred kernels from Python, 5 ms a step, and beside the
    collector's threads it also waits for the GIL (an update took 0.41 s there, 0.25 s
    alone); a replay is one call. The arithmetic is the eager step's, on the same data
    in the same order: ``tests/test_examples.py`` checks the two agree."""

    def __init__(self, agent: Agent, args: argparse.Namespace, device: torch.device) -> None:
        self.agent, self.args, self.device = agent, args, device
        self.graphed = device.type == "cuda" and args.graph_learner
        # a graph replays Adam with the learning rate it finds on the GPU, so it is a
        # tensor there (filled each update); otherwise a float, as usual
        lr = torch.tensor(args.learning_rate, device=device) if self.graphed else args.learning_rate
        self.optimizer = torch.optim.Adam(
            agent.parameters(),
            lr=lr,
            eps=1e-5,
            fused=device.type == "cuda",
            capturable=self.graphed,
        )
        self.iterations = args.total_timesteps // (args.num_envs * args.num_steps)
        self.size = args.num_envs * args.num_steps
        # pg loss, value loss, entropy, approx_kl, clip fraction, count: summed on the GPU
        self.sums = torch.zeros(6, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] = {}
        self.index = torch.arange(self.size // args.num_minibatches, device=device)

    def advantages(self, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE: the bootstrap is cut at every done (terminated or truncated)."""
        a = self.args
        with torch.no_grad():
            next_value = self.agent.value(data["last_next_obs"])
        values, rewards = data["value"], data["reward"]
        live = 1.0 - data["done"].float()
        advantages = torch.empty_like(rewards)
        running = torch.zeros_like(next_value)
        for t in reversed(range(a.num_steps)):
            following = next_value if t == a.num_steps - 1 else values[:, t + 1]
            delta = rewards[:, t] + a.gamma * following * live[:, t] - values[:, t]
            running = delta + a.gamma * a.gae_lambda * live[:, t] * running
            advantages[:, t] = running
        return advantages, advantages + values

    def step(self, b: dict[str, torch.Tensor], mb: torch.Tensor) -> None:
        """One minibatch (rows ``mb`` of the flattened rollout ``b``): the clipped
        objective's gradient step; its figures added to ``self.sums``."""
        a, agent = self.args, self.agent
        logprob, entropy, value = agent.evaluate(b["obs"][mb], b["action"][mb])
        log_ratio = logprob - b["logprob"][mb]
        ratio = log_ratio.exp()
        adv = b["advantage"][mb]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - a.clip_coef, 1 + a.clip_coef))
        pg_loss = pg_loss.mean()
        old_value, ret = b["value"][mb], b["return"][mb]
        v_clipped = old_value + (value - old_value).clamp(-a.clip_coef, a.clip_coef)
        v_loss = 0.5 * torch.max((value - ret) ** 2, (v_clipped - ret) ** 2).mean()
        loss = pg_loss - a.ent_coef * entropy.mean() + a.vf_coef * v_loss
        self.optimizer.zero_grad(set_to_none=not self.graphed)
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), a.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            kl = ((ratio - 1) - log_ratio).mean()
            clipped = ((ratio - 1).abs() > a.clip_coef).float().mean()
            one = torch.ones((), device=self.device)
            self.sums += torch.stack((pg_loss, v_loss, entropy.mean(), kl, clipped, one))

    def capture(self, b: dict[str, torch.Tensor]) -> None:
        """The minibatch step as a CUDA graph over static copies of ``b`` and of the
        minibatch's rows. Capture needs a few eager steps first (cuDNN picks its
        kernels; Adam makes its state): they run on the static copies, and then the
        weights and Adam's state are put back, so training starts where it stood."""
        self.static = {k: v.clone() for k, v in b.items()}
        params = list(self.agent.parameters())
        saved = [p.detach().clone() for p in params]
        self.optimizer.zero_grad(set_to_none=False)  # the graph's gradients: kept tensors
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step(self.static, self.index)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
            for state in self.optimizer.state.values():
                for value in state.values():
                    value.zero_()  # step, first and second moments: as before any step
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step(self.static, self.index)

    def update(self, rollout: dict[str, Any], iteration: int) -> dict[str, float]:
        a = self.args
        lr = a.learning_rate
        if a.anneal_lr:
            lr *= 1.0 - (iteration - 1.0) / self.iterations
        if self.graphed:
            self.optimizer.param_groups[0]["lr"].fill_(lr)
        else:
            self.optimizer.param_groups[0]["lr"] = lr
        keys = ("obs", "action", "logprob", "value", "reward", "done", "last_next_obs")
        data = {k: rollout[k].to(self.device, non_blocking=True) for k in keys}
        advantages, returns = self.advantages(data)
        b = {
            "obs": data["obs"].reshape(self.size, *data["obs"].shape[2:]),
            "action": data["action"].reshape(-1),
            "logprob": data["logprob"].reshape(-1),
            "value": data["value"].reshape(-1),
            "advantage": advantages.reshape(-1),
            "return": returns.reshape(-1),
        }
        if self.graphed:
            if self.graph is None:
                self.capture(b)
            for key, value in b.items():
                self.static[key].copy_(value)
        self.sums.zero_()
        for _ in range(a.update_epochs):
            order = torch.randperm(self.size, device=self.device)
            for mb in order.split(self.size // a.num_minibatches):
                if self.graph is None:
                    self.step(b, mb)
                else:
                    self.index.copy_(mb)
                    self.graph.replay()
        # One wait for the GPU, off the GIL (a CUDA event's synchronize releases it), so
        # the collector's threads keep stepping meanwhile; then the figures are ready.
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        pg, v, ent, kl, clipfrac, count = self.sums.tolist()
        return {
            "lr": lr,
            "pg_loss": pg / count,
            "v_loss": v / count,
            "entropy": ent / count,
            "approx_kl": kl / count,
            "clipfrac": clipfrac / count,
        }


# ----------------------------------------------------------------------------- training


def since_start() -> float:
    return time.time() - PROCESS_START


def train(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)  # the cores belong to the envs; the learner runs on the GPU
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    n, t = args.num_envs, args.num_steps
    batch_size = n * t
    iterations = args.total_timesteps // batch_size
    if iterations < 1 or batch_size % args.num_minibatches:
        raise SystemExit("--total-timesteps must hold a rollout, and --num-minibatches divide it")
    report: dict[str, Any] = {}
    agent = Agent(num_actions(args))
    if args.loop == "sync":
        envs = make_sync_envs(args)  # first: gym's env processes fork before CUDA starts
        stream = sync_rollouts(agent.to(device), args, device, envs)
    else:
        stream = rlcollect_rollouts(agent.to(device), args, device, report)
    learner = PPO(agent, args, device)

    episodes: list[dict[str, float]] = []
    returns: list[float] = []
    window = args.target_window
    updates: list[dict[str, float]] = []
    target: dict[str, float] | None = None
    stopped_by = "total_timesteps"
    collect_seconds = learn_seconds = 0.0
    first_rollout = last_log = 0.0
    mode = f"{args.loop}{' --overlap' if args.overlap else ''}"
    print(
        f"PPO on Pong ({args.envs} envs), {mode}: {n} envs x {t} steps, {iterations} updates "
        f"at most, learner on {device}, {CORES} cores; {since_start():.1f} s since start",
        flush=True,
    )
    with contextlib.closing(stream):
        waited = time.perf_counter()
        for iteration, rollout in enumerate(stream, 1):
            now = since_start()
            collect_seconds += time.perf_counter() - waited
            first_rollout = first_rollout or now
            step0 = (iteration - 1) * batch_size
            # episodes that ended in this rollout, in step order, timed at its arrival;
            # the first at which the mean of the last `window` reached the target
            envs_done, steps_done = torch.nonzero(rollout["done"], as_tuple=True)
            for s, e in sorted(zip(steps_done.tolist(), envs_done.tolist(), strict=True)):
                ret = float(rollout["episode_return"][e, s])
                episodes.append(
                    {"env_step": step0 + (s + 1) * n, "wall_seconds": now, "return": ret}
                )
                returns.append(ret)
                if (
                    target is None
                    and len(returns) >= window
                    and np.mean(returns[-window:]) >= args.target_return
                ):
                    target = {**episodes[-1], "episodes": len(episodes)}
                    print(f"target reached: {target}", flush=True)

            started = time.perf_counter()
            stats = learner.update(rollout, iteration)
            learn_seconds += time.perf_counter() - started
            version = rollout["version"]
            stats.update(
                iteration=iteration,
                env_step=iteration * batch_size,
                wall_seconds=since_start(),
                # updates the learner had made before this rollout, less the ones that acted
                policy_lag=0 if version < 0 else iteration - 1 - version,
            )
            updates.append(stats)

            if since_start() - last_log >= args.log_every or iteration == iterations:
                last_log = since_start()
                rate = (stats["env_step"] - batch_size) / max(last_log - first_rollout, 1e-9)
                print(
                    f"{last_log:6.1f} s  step {stats['env_step']:9,d}  {rate:7,.0f} steps/s  "
                    f"episodes {len(episodes):5d}  mean return (last {window}) "
                    f"{np.mean(returns[-window:]) if returns else float('nan'):6.1f}  "
                    f"kl {stats['approx_kl']:.4f}  clipfrac {stats['clipfrac']:.3f}  "
                    f"lag {stats['policy_lag']}",
                    flush=True,
                )
            if args.stop_at_target and target is not None:
                stopped_by = "target"
                break
            if args.max_seconds > 0 and since_start() >= args.max_seconds:
                stopped_by = "max_seconds"
                break
            waited = time.perf_counter()
        wall = since_start()  # before the envs and the collector shut down
    env_steps = len(updates) * batch_size
    lags = [u["policy_lag"] for u in updates]
    summary = {
        "loop": args.loop,
        "overlap": args.overlap,
        "envs": args.envs,
        "seed": args.seed,
        "device": str(device),
        "env_steps": env_steps,
        "updates": len(updates),
        "stopped_by": stopped_by,
        "wall_seconds": wall,  # process start to the end of the last update
        "startup_seconds": first_rollout,  # process start to the first rollout
        "steps_per_second": env_steps / wall,
        # from the first rollout's arrival on: start-up (imports, envs, graphs) left out
        "steps_per_second_after_first_rollout": (env_steps - batch_size)
        / max(wall - first_rollout, 1e-9),
        # where the loop's time went: waiting for rollouts, and updating
        "collect_seconds": collect_seconds,
        "learn_seconds": learn_seconds,
        "episodes": len(episodes),
        f"mean_return_last_{window}": float(np.mean(returns[-window:])) if returns else None,
        "target": {
            "return": args.target_return,
            "window": window,
            "reached": target is not None,
            "wall_seconds": None if target is None else target["wall_seconds"],
            "env_step": None if target is None else target["env_step"],
        },
        "policy_lag": {
            "mean": float(np.mean(lags)) if lags else 0.0,
            "max": max(lags, default=0),
            "counts": {str(v): lags.count(v) for v in sorted(set(lags))},
        },
        # the collector's own statistics at the end (rlcollect only; docs/usage.md)
        "collector": report.pop("collector_stats", None),
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config.update(
        batch_size=batch_size,
        minibatch_size=batch_size // args.num_minibatches,
        iterations=iterations,
        cores=CORES,
        env_threads=env_threads(args) if args.envs == "ale" else None,
        vector_envs=vector_envs(args) if args.envs == "ale" and args.loop == "rlcollect" else None,
        transport=args.transport if args.loop == "rlcollect" else None,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        versions={
            "torch": torch.__version__,
            "ale_py": ale_py.__version__,
            "gymnasium": gym.__version__,
        },
        **report,
    )
    return {"summary": summary, "config": config, "episodes": episodes, "updates": updates}


# ----------------------------------------------------------------------------- output


def run_name(run: dict[str, Any]) -> str:
    s = run["summary"]
    return f"ppo_atari_{s['envs']}_{s['loop']}{'_overlap' if s['overlap'] else ''}_seed{s['seed']}"


def run_label(run: dict[str, Any]) -> str:
    s = run["summary"]
    loop = "rlcollect, overlap" if s["overlap"] else s["loop"]
    reached_at = s["target"]["wall_seconds"]
    when = "target not reached"
    if reached_at is not None:
        when = f"{s['target']['return']:g} at {reached_at:.0f} s"
    return f"{loop} ({s['envs']}, seed {s['seed']}): {when}"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, run in enumerate(runs):
        eps = run["episodes"]
        if not eps:
            continue
        window = run["summary"]["target"]["window"]
        rets = np.array([e["return"] for e in eps])
        smooth = [rets[max(0, j - window + 1) : j + 1].mean() for j in range(len(rets))]
        color = f"C{i}"
        for ax, key in ((by_time, "wall_seconds"), (by_step, "env_step")):
            x = [e[key] for e in eps]
            if len(runs) == 1:
                ax.plot(x, rets, ".", color=color, alpha=0.2, markersize=3)
            ax.plot(x, smooth, color=color, label=run_label(run) if ax is by_time else None)
    target = runs[0]["summary"]["target"]
    for ax in (by_time, by_step):
        ax.axhline(target["return"], color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    by_time.set_xlabel("wall-clock seconds from process start")
    by_step.set_xlabel("env steps (4 frames each)")
    by_time.set_ylabel(f"episodic return (mean of the last {target['window']})")
    if by_time.get_legend_handles_labels()[0]:  # no curve before the first episode
        by_time.legend(loc="lower right", fontsize=8)
    fig.suptitle("PPO on Pong, Nature CNN")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"curves: {path}")


def to_json(value: Any) -> Any:
    """What json cannot write by itself (numpy and torch scalars, the odd object)."""
    return value.item() if hasattr(value, "item") else str(value)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        runs = [json.loads(p.read_text()) for p in args.plot]
        plot(runs, args.out / "ppo_atari_compare.png")
        return
    run = train(args)
    print(json.dumps(run["summary"], indent=2))
    name = run_name(run)
    (args.out / f"{name}.json").write_text(json.dumps(run, default=to_json))
    print(f"results: {args.out / (name + '.json')}")
    plot([run], args.out / f"{name}.png")


if __name__ == "__main__":
    main()
