"""Batches for other libraries' conventions.

TorchRL's value estimators and losses expect rewards and done flags with a trailing
dimension of size 1 (``("next", "reward")`` of shape ``[*batch, 1]``), as its envs
write them; rlcollect's are ``[*batch]``: one value per transition, as every per-step key
of a batch is (``docs/batch-keys.md``). :func:`to_torchrl` bridges the two without
copying.
"""

from __future__ import annotations

from rlcollect._tensordict import TensorDict

__all__ = ["TORCHRL_TRAILING", "to_torchrl"]

#: The keys TorchRL reads with a trailing dimension of size 1.
TORCHRL_TRAILING = (
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
)


def to_torchrl(batch: TensorDict) -> TensorDict:
    """``batch`` with :data:`TORCHRL_TRAILING` given a trailing dimension of size 1.

    A new TensorDict sharing every tensor with ``batch`` (the four are views); what
    TorchRL's value estimators and losses write into it (``advantage``,
    ``value_target``, ``state_value``) is not in ``batch``. On an on-policy batch
    (``[num_envs, T]``) GAE then runs along the time dimension of each env's row.

    Args:
        batch: a batch from the collector (any batch size).

    Returns:
        The TensorDict TorchRL expects.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from rlcollect.interop import to_torchrl
        >>> batch = TensorDict(
        ...     {"observation": torch.zeros(2, 5, 4), ("next", "reward"): torch.ones(2, 5),
        ...      ("next", "done"): torch.zeros(2, 5, dtype=torch.bool),
        ...      ("next", "terminated"): torch.zeros(2, 5, dtype=torch.bool),
        ...      ("next", "truncated"): torch.zeros(2, 5, dtype=torch.bool)},
        ...     batch_size=[2, 5],
        ... )
        >>> td = to_torchrl(batch)
        >>> td["next", "reward"].shape, td["observation"].shape
        (torch.Size([2, 5, 1]), torch.Size([2, 5, 4]))
    """
    out = batch.copy()  # shallow: the same tensors
    for key in TORCHRL_TRAILING:
        value = batch.get(key, None)
        if value is not None and value.shape == batch.batch_size:
            out.set(key, value.unsqueeze(-1))
    return out
