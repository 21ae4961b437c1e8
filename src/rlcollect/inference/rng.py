"""The served policy's own random stream, seeded from the collector's ``seed``.

A policy draws its exploration noise from torch's default generator of its device
(``torch.distributions``, ``torch.rand``...), which the whole process shares. The
action step keeps a stream of its own for it, so the draws of batch ``k`` are the next
numbers of one stream seeded once, and the rest of the process (a learner's dropout,
its own sampling) sees its own stream go on as if the server drew nothing. How the
stream reaches the policy depends on how the step runs it:

* **An eager or compiled call** draws from whatever the default generator holds at
  the time, so the step swaps its stream in just before the call and out just after
  (``swap_in``/``swap_out``). While it is swapped in, the whole process shares it: a
  draw by another thread on the same device in that window takes numbers from the
  server's stream.
* **A CUDA graph** reads its seed and offset from a device buffer of the generator
  *state* it was captured with; every replay writes the state's current seed and
  offset into that buffer first, on the replaying stream, and the graph's kernels read
  it later. Two graphs captured on one state, replayed at once from two threads, could
  read each other's values and draw the same numbers. So on a CUDA device the stream
  is a generator state of its own (``DeviceRng``), not a copy of the default state's
  numbers: the step captures its graphs with it installed (``installed``), and from
  then on every replay draws from it and from nothing else, with no swap at all. A
  learner in the same process may draw and replay its own graphs on that device at
  any time (``docs/usage.md``, *Reproducibility*).

It is one stream per step, consumed batch by batch, not one per env: a policy draws
for a whole batch at once, row by row, so which env gets which number depends on the
batch's rows. A seeded run therefore repeats each env's stream exactly when batches are
formed the same way in every run.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

__all__ = ["DeviceRng", "HostRng", "PolicyRng", "policy_rng"]


class PolicyRng(ABC):
    """A random stream of its own for the policy's draws on one device."""

    #: The device's default generator, which the policy draws from.
    _generator: torch.Generator

    def reseed(self, seed: int | None) -> None:
        """Start the stream again from ``seed`` (None: a seed of the OS's randomness).
        On a GPU, graphs bound to the stream follow: a replay reads the state's seed
        and offset as they are then."""
        with self.installed():
            if seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(seed)

    @abstractmethod
    def swap_in(self) -> None:
        """Before an eager call: the stream becomes the device's default generator's."""

    @abstractmethod
    def swap_out(self) -> None:
        """After the call: keep where the stream is, give the device's back."""

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The stream as the device's default generator's for the ``with`` block."""
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()


class HostRng(PolicyRng):
    """On the CPU: the stream's numbers (its generator state as bytes) are swapped into
    the default generator and back around each call: one state copy each way."""

    def __init__(self, seed: int | None) -> None:
        self._generator = torch.default_generator
        self._saved = self._generator.get_state()
        self._state = self._saved
        self.reseed(seed)

    def swap_in(self) -> None:
        self._saved = self._generator.get_state()
        self._generator.set_state(self._state)

    def swap_out(self) -> None:
        self._state = self._generator.get_state()
        self._generator.set_state(self._saved)


class DeviceRng(PolicyRng):
    """On a CUDA device: a generator state of its own (``clone_state``), installed as
    the default generator's state object while an eager call runs or a graph is
    captured (``graphsafe_set_state``). Graphs captured meanwhile stay bound to it."""

    def __init__(self, device: torch.device, seed: int | None) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._generator = torch.cuda.default_generators[index]
        self._state = self._generator.clone_state()
        self._saved: torch.Generator | None = None
        self.reseed(seed)

    def swap_in(self) -> None:
        self._saved = self._generator.graphsafe_get_state()
        self._generator.graphsafe_set_state(self._state)

    def swap_out(self) -> None:
        # The stream's draws advanced self._state in place: only the default goes back.
        assert self._saved is not None
        self._generator.graphsafe_set_state(self._saved)
        self._saved = None


def policy_rng(device: torch.device, seed: int | None) -> PolicyRng:
    """The stream for a policy on ``device``, seeded with ``seed``."""
    return DeviceRng(device, seed) if device.type == "cuda" else HostRng(seed)
