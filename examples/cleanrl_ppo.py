"""CleanRL's ``ppo.py`` (PPO on CartPole-v1), ported to rlcollect: its hyperparameters,
its structure, its arithmetic.

One file, read top to bottom. What the port changes, and nothing else:

* The rollout comes from ``AsyncBatchedCollector(on_policy=True, time_major=True)``:
  each batch is ``[num_steps, num_envs]``, the shape of CleanRL's storage tensors,
  every action computed with the weights of the last update (the envs wait while the
  learner learns). The storage and the inner stepping loop go; the batch is them.
* ``Agent`` is sized from the env's spaces, ``Agent(observation_space, action_space)``,
  given to the collector as ``policy_factory``: no env is built to size it. Its
  ``forward`` is the acting half of ``get_action_and_value`` (a sampled action, its
  log-probability, the value). The learner's agent is built from the collector's spaces
  and pushed to the collector before the first rollout and after every update.
* CleanRL's ``dones[t]`` flags that ``obs[t]`` begins an episode; rlcollect's
  ``("next", "done")[t]`` that step ``t`` ended one, so CleanRL's ``dones[t + 1]`` is
  ``next_done[t]`` here, and its ``next_done``/``next_obs`` after the rollout are
  ``("next", "done" | "observation")[-1]``: the same GAE, without a shift.
* Episodic returns come from ``collector.episodes()`` rather than a
  ``RecordEpisodeStatistics`` wrapper's ``final_info``; results go to ``--out`` as
  JSON and a PNG curve rather than TensorBoard.

    python examples/cleanrl_ppo.py                           # 500k steps, seed 1
    python examples/cleanrl_ppo.py --total-timesteps 4096    # a quick smoke run
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
from torch import nn
from torch.distributions.categorical import Categorical

from rlcollect import AsyncBatchedCollector


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--total-timesteps", type=int, default=500_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--no-anneal-lr", dest="anneal_lr", action="store_false")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--no-norm-adv", dest="norm_adv", action="store_false")
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--no-clip-vloss", dest="clip_vloss", action="store_false")
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--target-kl", type=float, default=None)
    p.add_argument("--out", type=Path, default=Path("runs"), help="JSON and curve (PNG)")
    args = p.parse_args()
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = args.total_timesteps // args.batch_size
    return args


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        obs_size = int(np.prod(observation_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )  # fmt: skip
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, action_space.n), std=0.01),
        )  # fmt: skip

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the collector serves: the rollout's step of ``get_action_and_value``."""
        action, logprob, _, value = self.get_action_and_value(x)
        return {"action": action, "logprob": logprob, "value": value.flatten()}


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)  # the cores belong to the env workers
    make_env = functools.partial(gym.make, args.env_id)

    collector = AsyncBatchedCollector(
        [make_env] * args.num_envs,
        policy_factory=Agent,  # Agent(observation_space, action_space)
        frames_per_batch=args.batch_size,
        total_frames=args.num_iterations * args.batch_size,
        policy_device="cpu",
        inference_backend="worker",  # CartPole is cheap: each worker acts for its envs
        on_policy=True,
        time_major=True,  # [num_steps, num_envs], as CleanRL's storage
        seed=args.seed,
    )
    agent = Agent(collector.observation_space, collector.action_space)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    collector.update_policy_weights_(agent)  # the first rollout acts with these weights

    curve: list[tuple[int, float]] = []
    start_time = time.time()
    with collector:
        for iteration, batch in enumerate(collector, 1):
            global_step = iteration * args.batch_size
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate
            obs, actions = batch["observation"], batch["action"]
            logprobs, values = batch["logprob"], batch["value"]
            rewards = batch["next", "reward"]
            next_dones = batch["next", "done"].float()  # CleanRL's dones[t + 1]
            for episode in collector.episodes():
                curve.append((global_step, episode.episode_return))
                print(f"global_step={global_step}, episodic_return={episode.episode_return}")

            # bootstrap value if not done
            with torch.no_grad():
                next_value = agent.get_value(batch["next", "observation"][-1]).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    nextnonterminal = 1.0 - next_dones[t]
                    nextvalues = next_value if t == args.num_steps - 1 else values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = (
                        delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    )
                returns = advantages + values

            # flatten the batch
            b_obs = obs.reshape((-1, *collector.observation_space.shape))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1, *collector.action_space.shape))
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            # Optimizing the policy and value network
            b_inds = np.arange(args.batch_size)
            clipfracs = []
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, args.batch_size, args.minibatch_size):
                    mb_inds = b_inds[start : start + args.minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds], b_actions.long()[mb_inds]
                    )
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]
                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (
                            mb_advantages.std() + 1e-8
                        )
                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(
                        ratio, 1 - args.clip_coef, 1 + args.clip_coef
                    )
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
                    # Value loss
                    newvalue = newvalue.view(-1)
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(
                            newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                        )
                        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()
                if args.target_kl is not None and approx_kl > args.target_kl:
                    break
            collector.update_policy_weights_(agent)  # the next rollout acts with these
            sps = int(global_step / (time.time() - start_time))
            print(f"SPS: {sps}, clipfrac {np.mean(clipfracs):.3f}, v_loss {v_loss.item():.2f}")

    returns_only = [r for _, r in curve]
    summary = {
        "env_steps": args.num_iterations * args.batch_size,
        "episodes": len(curve),
        "mean_return_last_100": float(np.mean(returns_only[-100:])) if curve else 0.0,
        "wall_seconds": time.time() - start_time,
        "seed": args.seed,
    }
    print(json.dumps(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {**summary, "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}
    (args.out / "cleanrl_ppo.json").write_text(json.dumps(doc, indent=1))
    plot(curve, args.out / "cleanrl_ppo.png", "CleanRL ppo.py on rlcollect, CartPole-v1")


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
