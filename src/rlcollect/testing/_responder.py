"""A numpy stand-in for the inference server, and helpers that take chunks off a ring."""

from __future__ import annotations

import threading
import time

import numpy as np

from rlcollect.errors import ChannelClosed
from rlcollect.testing.envs import counting_actions
from rlcollect.testing.programs import _ACTIONS
from rlcollect.transports.base import ServerEnd
from rlcollect.transports.layout import RingLayout, request_rows

# Seconds any single step of a check may take before it counts as a hang: a restart
# spawns a worker process, which a heavily loaded 2-core machine took over 10 s to do.
_DEADLINE = 60.0


class _Responder:
    """A numpy stand-in for the inference server, in a thread."""

    def __init__(self, end: ServerEnd, layout: RingLayout) -> None:
        self.end = end
        self.layout = layout
        self.served = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        views = self.end.buffers
        obs = self.layout.request_sources(views, ("observation",))
        action = self.layout.request_sources(views, ("action",))
        try:
            while not self._stop.is_set():
                requests = self.end.wait_requests(0.05)
                if requests:
                    ws, qs = np.array(requests, dtype=np.intp).T
                    rows = request_rows(self.layout, views, ws, qs)
                    action[rows] = counting_actions(obs[rows], _ACTIONS)
                self.end.respond([w for w, _ in requests])
                self.served += len(requests)
        except ChannelClosed:
            pass
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(_DEADLINE)
        assert not self._thread.is_alive(), "wait_requests ignored its timeout"
        if self.error is not None:
            raise AssertionError(f"the server end failed: {self.error!r}") from self.error


_Chunk = tuple[int, int, dict[str, np.ndarray]]


def _collect(end: ServerEnd, layout: RingLayout, want: int, release: bool = True) -> list[_Chunk]:
    """Take ``want`` chunks (copies of their rows), releasing each unless told not to."""
    out: list[_Chunk] = []
    deadline = time.monotonic() + _DEADLINE
    while len(out) < want:
        assert time.monotonic() < deadline, f"only {len(out)} of {want} chunks arrived in time"
        for w, s in end.wait_chunks(0.1):
            out.append((w, s, _chunk_rows(end, layout, w, s)))
            if release:
                end.release(w, s)
    return out


def _chunk_rows(end: ServerEnd, layout: RingLayout, w: int, s: int) -> dict[str, np.ndarray]:
    sl = slice(s * layout.chunk_steps, (s + 1) * layout.chunk_steps)
    return {
        "/".join(f.key): np.array(end.buffers[f.key][w, sl]).reshape(-1, *f.shape)
        for f in layout.fields
    }
