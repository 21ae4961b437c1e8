"""The off-policy replay buffer, the type of any buffer a collector writes into, and
what ``train_ratio`` needs of one (counts of the rows written and sampled)."""

from rlcollect.replay.buffer import FrameStackError, ReplayBuffer
from rlcollect.replay.counting import CountingBuffer, CountsSamples
from rlcollect.replay.sink import SupportsExtend

__all__ = [
    "CountingBuffer",
    "CountsSamples",
    "FrameStackError",
    "ReplayBuffer",
    "SupportsExtend",
]
