"""The off-policy replay buffer, and the type of any buffer a collector writes into."""

from rlcollect.replay.buffer import ReplayBuffer
from rlcollect.replay.sink import SupportsExtend

__all__ = ["ReplayBuffer", "SupportsExtend"]
