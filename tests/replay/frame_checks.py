"""Rows by hand and checks of sampled stacks, for the frame_stack tests."""

import numpy as np
import torch
from frame_envs import episode_steps, expected, padding_of
from tensordict import TensorDict


class Streams:
    """Envs stepped by hand in a random interleaving, as a collector's batches hold them:
    each row's stacks are the ones gymnasium's FrameStackObservation would give."""

    def __init__(self, envs, k=4, seed=0, paddings=None, dtype=np.uint8, lengths=episode_steps):
        self.k, self.dtype, self.lengths = k, dtype, lengths
        self.rng = np.random.default_rng(seed)
        self.paddings = paddings or {e: padding_of(e) for e in envs}
        self.at = {e: [0, 0] for e in envs}  # env -> [episode, step]

    def restart(self, env):
        """The env is rebuilt: a new episode from step 0, as the collector numbers it."""
        self.at[env] = [self.at[env][0] + 1, 0]

    def jump(self, env, steps):
        """The env's next rows come ``steps`` later in its episode (as if not seen)."""
        self.at[env][1] += steps

    def stack(self, env, episode, step):
        out = expected(env, episode, step, self.k, self.paddings[env])
        return out.astype(self.dtype)

    def rows(self, n, envs=None):
        envs = list(self.at) if envs is None else envs
        cols = {key: [] for key in ("env", "ep", "st", "obs", "nxt", "done")}
        for env in self.rng.choice(envs, n):
            episode, step = self.at[env]
            done = step + 1 >= self.lengths(env, episode)
            for key, value in zip(
                cols,
                (env, episode, step, self.stack(env, episode, step),
                 self.stack(env, episode, step + 1), done),
                strict=True,
            ):  # fmt: skip
                cols[key].append(value)
            self.at[env] = [episode + 1, 0] if done else [episode, step + 1]
        return TensorDict(
            {
                "observation": torch.from_numpy(np.stack(cols["obs"])),
                ("next", "observation"): torch.from_numpy(np.stack(cols["nxt"])),
                "env_index": torch.tensor(cols["env"]),
                "episode": torch.tensor(cols["ep"]),
                "step": torch.tensor(cols["st"]),
                ("next", "done"): torch.tensor(cols["done"]),
                "action": torch.tensor(cols["st"]) % 3,
            },
            batch_size=[n],
        )


def check_stacks(batch, k, paddings=None):
    """Every row's stacks are what its env gave at its episode and step."""
    envs, eps, steps = (batch[key].cpu().tolist() for key in ("env_index", "episode", "step"))
    obs, nxt = batch["observation"].cpu().numpy(), batch["next", "observation"].cpu().numpy()
    for i, (env, ep, step) in enumerate(zip(envs, eps, steps, strict=True)):
        pad = (paddings or {}).get(env) or padding_of(env)
        want = expected(env, ep, step, k, pad)
        assert np.array_equal(obs[i], want), f"observation of env {env}, {ep}/{step}"
        assert np.array_equal(nxt[i], expected(env, ep, step + 1, k, pad)), (env, ep, step)


def same_as_given(out, given):
    """Every sampled row is the row the collector gave for its env, episode and step."""
    key = lambda td: td["env_index"] * 1_000_000 + td["episode"] * 1000 + td["step"]  # noqa: E731
    index = {int(k): i for i, k in enumerate(key(given).tolist())}
    rows = torch.tensor([index[int(k)] for k in key(out).tolist()])
    want = given[rows]
    assert torch.equal(out["observation"], want["observation"])
    assert torch.equal(out["next", "observation"], want["next", "observation"])
    assert torch.equal(out["action"], want["action"])
