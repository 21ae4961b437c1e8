"""Sample Factory 2.1.1's sampler on the suite's Pong with the suite's network.

Runs only under the interpreter of a separate virtual environment holding
sample-factory 2.1.1 with its numpy 1.x, gymnasium 0.29 and an ale-py of that era
(``make peers-sf`` builds ``.peers-sf``; the suite's ``--sf-python``), so it imports
nothing from rlcollect (which needs gymnasium 1.x) and nothing from the rest of the suite
but the timing protocol and the policies' layers, which need torch alone.

What runs: Sample Factory's ``SyncSamplingAPI``, its sampler without a learner. Rollout
worker processes (``num_workers``, each stepping ``num_envs_per_worker`` envs in
``worker_num_splits`` halves that alternate, its double buffering) write observations
into shared trajectory buffers; one inference worker process (the policy on ``device``)
batches the requests of every split that waits and writes the actions back; each
finished ``rollout``-step trajectory reaches this process, which copies it out and
hands its buffer back (the API's own loop). Frames are env steps, as in every other
run of the suite (the env skips 4 emulator frames per step itself; ``env_frameskip`` 1).

The same task: :func:`make_env` rebuilds ``benchmarks.common.make_pong`` for gymnasium
0.29 (grayscale, repeat_action_probability 0, frame skip 4, every second row and
column, the last 4 frames stacked: 4x105x80 uint8). The same network: the encoder is
the acting policy's layers up to its last hidden activation (``benchmarks.policies``:
``SmallCNN`` on the CPU suite, ``NatureCNN`` on the GPU suite); Sample Factory adds its
action head (the same last linear layer, to 6 logits) and a one-unit value head, with no
RNN core and no decoder layers; observations are divided by 255, as the policy does.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import gymnasium as gym
import numpy as np
from torch import Tensor, nn

from benchmarks.suite.measure import measure

ENV_NAME = "rlcollect_pong"
FRAMES = 4  # stacked frames
VERSIONS = ("sample-factory", "torch", "numpy", "gymnasium", "ale-py")  # recorded per run


class _HalfStack(gym.Wrapper):  # type: ignore[misc]
    """Every second row and column of the grayscale screen, the last ``FRAMES`` stacked
    (the reset frame repeated at the start of an episode): 4x105x80 uint8."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        h, w = env.observation_space.shape
        self.frames: deque[np.ndarray] = deque(maxlen=FRAMES)
        self.observation_space = gym.spaces.Box(0, 255, (FRAMES, h // 2, w // 2), np.uint8)

    def _stacked(self) -> np.ndarray:
        return np.stack(self.frames)

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        for _ in range(FRAMES):
            self.frames.append(obs[::2, ::2])
        return self._stacked(), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.frames.append(obs[::2, ::2])
        return self._stacked(), reward, terminated, truncated, info


def make_env(
    full_env_name: str, cfg: Any = None, env_config: Any = None, render_mode: str | None = None
) -> gym.Env:
    """Sample Factory's env factory: the suite's Pong (``benchmarks.common.make_pong``)."""
    import ale_py  # noqa: F401  (registers the ALE namespace with gymnasium 0.29)

    env = gym.make(
        "ALE/Pong-v5",
        obs_type="grayscale",
        repeat_action_probability=0.0,
        render_mode=render_mode,
    )
    return _HalfStack(env)


def _trunk(policy: str) -> nn.Sequential:
    """The acting policy's layers without its last linear layer (the action head)."""
    from benchmarks.policies import NatureCNN, SmallCNN

    net = SmallCNN(6).net if policy == "small_cnn" else NatureCNN(6).net
    layers = list(net)
    if not isinstance(layers[-1], nn.Linear):
        raise RuntimeError(f"{policy}'s last layer is {layers[-1]}, not its action head")
    return nn.Sequential(*layers[:-1])


def _encoder_class() -> type:
    from sample_factory.model.encoder import Encoder

    class PolicyTrunk(Encoder):  # type: ignore[misc]
        """The suite's acting network up to its last hidden activation."""

        def __init__(self, cfg: Any, obs_space: Any) -> None:
            super().__init__(cfg)
            self.trunk = _trunk(cfg.bench_policy)
            self.out_size = int(self.trunk[-2].out_features)

        def forward(self, obs_dict: dict[str, Tensor]) -> Tensor:
            return self.trunk(obs_dict["obs"])  # type: ignore[no-any-return]

        def get_out_size(self) -> int:
            return self.out_size

    return PolicyTrunk


def make_encoder(cfg: Any, obs_space: Any) -> Any:
    """Sample Factory's encoder factory (see :func:`_encoder_class`)."""
    return _encoder_class()(cfg, obs_space)


def sf_arguments(config: dict[str, Any], train_dir: str) -> list[str]:
    """Sample Factory's command line for ``config`` (every setting the run depends on)."""
    device = "gpu" if str(config["device"]).startswith("cuda") else "cpu"
    settings = {
        "env": ENV_NAME,
        "experiment": "suite",
        "train_dir": train_dir,
        "device": device,
        "seed": 0,
        "num_workers": config["num_workers"],
        "num_envs_per_worker": config["envs_per_worker"],
        "worker_num_splits": config["worker_num_splits"],
        "rollout": config["rollout"],
        "batch_size": config["batch_size"],
        "policy_workers_per_policy": 1,
        "serial_mode": False,
        "async_rl": True,
        "batched_sampling": False,
        "use_rnn": False,
        "normalize_input": False,
        "obs_scale": 255.0,
        "env_frameskip": 1,
    }
    return [f"--{k}={v}" for k, v in settings.items()] + [f"--bench_policy={config['policy']}"]


def _cfg(config: dict[str, Any], train_dir: str) -> Any:
    from sample_factory.algo.utils.context import global_model_factory
    from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
    from sample_factory.envs.env_utils import register_env

    register_env(ENV_NAME, make_env)
    global_model_factory().register_encoder_factory(make_encoder)
    argv = sf_arguments(config, train_dir)
    parser, _ = parse_sf_args(argv)
    parser.add_argument("--bench_policy", default="small_cnn", choices=("small_cnn", "nature_cnn"))
    return parse_full_cfg(parser, argv)


def run_sample_factory(config: dict[str, Any]) -> dict[str, Any]:
    """Env frames per second of Sample Factory's sampler, timed as every suite run."""
    from sample_factory.algo.sampling.simplified_sampling_api import SyncSamplingAPI
    from sample_factory.algo.utils.env_info import obtain_env_info_in_a_separate_process
    from sample_factory.algo.utils.rl_utils import samples_per_trajectory

    with tempfile.TemporaryDirectory(prefix="sf-suite-") as train_dir:
        cfg = _cfg(config, train_dir)
        env_info = obtain_env_info_in_a_separate_process(cfg)
        held: list[Any] = []

        def trajectories() -> Iterator[int]:
            sampler = SyncSamplingAPI(cfg, env_info)
            held.append(sampler)
            sampler.start()
            while True:
                trajectory = sampler.get_trajectories_sync()
                if trajectory is None:
                    raise RuntimeError("Sample Factory's sampler stopped")
                yield samples_per_trajectory(trajectory)

        steps = trajectories()
        try:
            result = measure(steps, config["warmup_s"], config["measure_s"])
        finally:
            steps.close()
            if held:
                held[0].stop()
    result["sample_factory"] = {
        "arguments": sf_arguments(config, "<temporary>"),
        "versions": {name: version(name) for name in VERSIONS},
    }
    return result
