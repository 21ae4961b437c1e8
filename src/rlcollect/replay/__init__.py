"""The off-policy replay buffer."""

from rlcollect.replay.buffer import ReplayBuffer

__all__ = ["ReplayBuffer"]
