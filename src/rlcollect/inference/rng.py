"""The served policy's own random stream, seeded from the collector's ``seed``.

A policy draws its exploration noise from torch's default generator of its device
(``torch.distributions``, ``torch.rand``...), which the whole process shares. The
server keeps a stream of its own on that generator: it swaps the stream's state in just
before a batch's action step and out just after, so the draws of batch ``k`` are the
next numbers of one stream seeded once, and the rest of the process (a learner's
dropout, its own sampling) sees its own stream go on as if the server drew nothing.

It is one stream per server, consumed batch by batch, not one per env: a policy draws
for a whole batch at once, row by row, so which env gets which number depends on the
batch's rows. A seeded run therefore repeats each env's stream exactly when batches are
formed the same way in every run (see ``docs/usage.md``, *Reproducibility*), and when no
other thread of the process draws on the same device while a batch runs (with
``inference_backend="process"`` none can). CUDA graphs replay from the generator's
state too, so a graphed step follows the same stream.
"""

from __future__ import annotations

import torch

__all__ = ["PolicyRng"]


class PolicyRng:
    """A stream of the default generator of ``device``, swapped in around each batch."""

    def __init__(self, device: torch.device, seed: int) -> None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._generator = torch.cuda.default_generators[index]
        else:
            self._generator = torch.default_generator
        saved = self._generator.get_state()
        self._generator.manual_seed(seed)
        self._state = self._generator.get_state()
        self._generator.set_state(saved)
        self._saved = saved

    def swap_in(self) -> None:
        """Before a batch: the server's stream becomes the device's (about 1 µs on a CPU)."""
        self._saved = self._generator.get_state()
        self._generator.set_state(self._state)

    def swap_out(self) -> None:
        """After a batch: keep where the server's stream is, give the device's back."""
        self._state = self._generator.get_state()
        self._generator.set_state(self._saved)
