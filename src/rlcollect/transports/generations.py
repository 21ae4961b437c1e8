"""Worker generations: how a restarted worker ignores what was meant for its predecessor.

A restarted worker (``Transport.restart_worker``) shares its request and response
channels with the worker it replaces. Requests the old worker made may still be queued
or in the inference server's hands, and the server will answer them: those answers must
not be taken by the new worker as answers to its own requests. So every request carries
the generation of the worker that made it, tagged into its worker field, and every
response echoes the generation of the request it answers; a worker skips responses of
another generation.

A transport's request side reads tagged requests with :meth:`Generations.split`, which
hands the server plain ``(worker, request)`` pairs and remembers each request's
generation, and answers with :meth:`Generations.answer`, which returns the generation
of the oldest unanswered request of that worker (the server answers one worker's
requests in the order they arrived, which is what makes this match).

A stale request is still served: the server reads the cells it names and writes actions
into them. That is harmless: it was made before every request of the new worker, so it
is served before them, or in the same batch and scattered before them, and the new
worker reads an action only after the answer to its own request, which comes after
every stale one. (Should a stale request name the very cells of one of the new
worker's in the same batch, both rows were gathered from those cells, that is from
the new worker's observation, so the answer written last is a right one.)

The rest of a restart is told where it is implemented: what any transport must do in
``Transport.restart_worker`` (``base.py``), the pipes and processes in
``process_slots.py``, the chunk marker in ``thread_queue.py``, and how the collector
keeps every env's stream whole in ``collector/batches/restarts.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["Generations", "response_token", "tag", "wrap"]

_WORKER_BITS = 16
_WORKER_MASK = (1 << _WORKER_BITS) - 1
_GENERATION_MASK = (1 << (31 - _WORKER_BITS)) - 1  # a tag stays a non-negative int32


def wrap(generation: int) -> int:
    """``generation`` as a request carries it (15 bits), and as :meth:`Generations.answer`
    returns it."""
    return generation & _GENERATION_MASK


def tag(worker: int, generation: int) -> int:
    """The worker field of a request made by ``worker`` in ``generation``."""
    return worker | (wrap(generation) << _WORKER_BITS)


def response_token(generation: int) -> int:
    """The byte (1 … 255) a byte-wide response carries for ``generation``: never 0, and
    1 for the first generation."""
    return wrap(generation) % 255 + 1


class Generations:
    """Per-worker generations of the requests handed to the server, oldest first."""

    def __init__(self, num_workers: int) -> None:
        self._pending: list[deque[int]] = [deque() for _ in range(num_workers)]

    def split(self, tagged: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Plain ``(worker, request)`` pairs of tagged ones; remembers their generations."""
        out = []
        for raw, request in tagged:
            worker = raw & _WORKER_MASK
            self._pending[worker].append(raw >> _WORKER_BITS)
            out.append((worker, request))
        return out

    def answer(self, worker: int) -> int:
        """Generation of ``worker``'s oldest unanswered request (0 if none is known)."""
        pending = self._pending[worker]
        return pending.popleft() if pending else 0
