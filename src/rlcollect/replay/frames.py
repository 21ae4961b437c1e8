"""The frame store of ``ReplayBuffer(capacity, frame_stack=k)``: each frame stored once.

An env that stacks its last ``k`` frames (Atari's 4 of 84x84) writes rows whose
``observation`` ``[k, *frame]`` shares ``k - 1`` frames with the row before it in the
same episode, and whose ``("next", "observation")`` is the same stack moved on by one new
frame. Stored as rows, a transition costs ``2k`` frames; here it costs one, plus one per
episode start. Both stacks are rebuilt at ``sample()``, by index, on the storage device.

Storage (beside the buffer's other fields, on its device):

* ``frames`` ``[F + 1, *frame]``: a ring of frames by serial, frame ``s`` at position
  ``s % F`` (:func:`frame_slots`); position ``F`` holds zeros and is never written (the
  padding of envs that pad an episode's first stacks with zeros).
* ``table`` ``[capacity, k + 1]`` int64, a row field like the others: the positions of a
  row's ``k + 1`` frames, oldest first. ``observation`` is frames ``0 … k-1``,
  ``("next", "observation")`` frames ``1 … k``; a sample gathers the ``k + 1`` once and
  returns the two stacks as views of that one gather.

Streams. ``env_index`` tells the envs apart; a row *continues* its env's previous row
when it has the same ``episode`` and the next ``step``. A continuing row adds one frame,
the newest of its ``("next", "observation")``. Any other row starts a segment: at
``step == 0`` (an episode start, a restarted env) it also adds the newest frame of its
``observation``, and the frames before it are what the env put there, told from the row
itself: zeros (the zero frame) or that first frame repeated. Anywhere else (an env first
seen mid-episode, an env whose frames lie too far back: below), or at a start padded in
another way, it adds all ``k`` frames of its ``observation``. So a stack is rebuilt from
the very frames the env gave, whatever the env, and nothing is assumed of it. A write
stores the segments' first frames, then each env's new frames together, in step order:
a stack's frames then mostly lie side by side, and a sample reads them as one piece.

Verification. After its frames are copied in, a write rebuilds from the store the stacks
of some of its rows and compares them, bit for bit, with the rows' own: every row of an
episode's first step, the first :data:`VERIFY_FIRST` rows of each env, and one row in
:data:`VERIFY_ONE_IN` at random (the store's own generator). A row that differs (a stack
on another axis, a wrapper that changes old frames) stops the write before its rows
become readable; :class:`~rlcollect.replay.FrameStackError` names the key and the env.

Eviction. A row stays readable only while every frame it names is stored. A write of
``n`` frames overwrites those below serial ``t = next + n - F``, so the buffer first
takes out of its window every row up to the last one naming a frame below ``t``
(:class:`Staircase` finds it in ``O(log rows)``); the buffer's protocol then waits for
samplers that may be gathering them, as for rows it overwrites. A continuing row whose
env's frames lie more than ``F // 4`` frames back (an env that has not stepped for that
long) starts a segment instead, storing its frames anew; and a write of more than
``F - F // 4`` frames is made in parts. So no write overwrites a frame its own rows name.

Threads. Everything here but :meth:`FrameStore.gather` belongs to the writer (``extend``,
``load_state_dict``): the buffer's protocol (``rlcollect/replay/buffer.py``) covers the
store's tensors as it covers its fields, the table being one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcollect.replay.rows import Rows, name

OBSERVATION = ("observation",)
NEXT_OBSERVATION = ("next", "observation")
STREAM_KEYS = (("env_index",), ("episode",), ("step",))
TABLE = ("\0frame_table",)  # the table's key among the rows the buffer copies
VERIFY_FIRST = 16  #: rows of each env verified from its first on
VERIFY_ONE_IN = 16  #: after those, one row in this many, at random
_NONE = np.iinfo(np.int64).max  # no frame (the zero frame) in a minimum over serials

Empty = Callable[[int, torch.Tensor], torch.Tensor]  # n rows shaped like those of a tensor


def frame_slots(capacity: int, k: int) -> int:
    """Frames the ring holds: one per row, and 1/16 more: for the first frame of each
    episode, and for the frames of one write's rows that reach back past the oldest
    readable row (those of an env whose rows of one write are stored after another's).
    Episodes shorter than 32 steps, or writes of more than ``capacity / 32`` rows, leave
    room for fewer rows than ``capacity``."""
    return capacity + max(capacity // 16, 2 * (k + 1))


def check_stacks(k: int, obs: Any, nxt: Any, frame: torch.Tensor | None) -> None:
    """``observation`` and ``("next", "observation")``: tensors ``[n, k, *frame]`` alike,
    of the stored frame's shape and dtype once there is one."""
    for key, got in ((OBSERVATION, obs), (NEXT_OBSERVATION, nxt)):
        if not isinstance(got, torch.Tensor):
            raise ValueError(f"extend: frame_stack needs a tensor {name(key)} in every batch")
        if got.ndim < 2 or got.shape[1] != k:
            raise ValueError(
                f"extend: {name(key)} has rows of shape {list(got.shape[1:])}; "
                f"frame_stack={k} needs [{k}, *frame], the stack on the first axis"
            )
    assert isinstance(obs, torch.Tensor) and isinstance(nxt, torch.Tensor)
    if nxt.shape != obs.shape or nxt.dtype != obs.dtype:
        raise ValueError(
            f"extend: ('next', 'observation') {list(nxt.shape[1:])} {nxt.dtype} differs "
            f"from 'observation' {list(obs.shape[1:])} {obs.dtype}"
        )
    if frame is not None and (obs.shape[2:] != frame.shape[1:] or obs.dtype != frame.dtype):
        raise ValueError(
            f"extend: 'observation' has frames {list(obs.shape[2:])} {obs.dtype}, the buffer "
            f"stores {list(frame.shape[1:])} {frame.dtype}"
        )


def stream_columns(rows: Rows) -> list[np.ndarray]:
    """``env_index``, ``episode`` and ``step`` as int64 arrays: they tell the streams."""
    out = []
    for key in STREAM_KEYS:
        got = rows.get(key)
        if got is None or got.ndim != 1 or got.dtype.is_floating_point or got.is_complex():
            raise ValueError(
                f"extend: frame_stack needs an integer column {name(key)} [n] "
                "(env_index, episode and step tell each env's stream; the collector writes them)"
            )
        out.append(got.detach().cpu().numpy().astype(np.int64))
    if len(out[0]) and out[0].min() < 0:
        raise ValueError(f"extend: env_index must be >= 0, got {int(out[0].min())}")
    return out


class Staircase:
    """The rows that bound eviction: a *step* is a row whose oldest frame is older than
    that of every later row. Kept oldest first, their frames strictly increasing, so the
    rows to take out before frames below ``t`` are overwritten are those up to the last
    step below ``t``. Every row is a step or has a later step as old or older."""

    def __init__(self, capacity: int) -> None:
        # at most ``capacity`` steps at once (one per readable row); twice the room
        # moves them to the front only once per ``capacity`` pushed at least
        self.rows = np.zeros(2 * capacity + 1, np.int64)
        self.frames = np.zeros(2 * capacity + 1, np.int64)
        self.head = self.tail = 0

    def push(self, first_row: int, oldest: np.ndarray) -> None:
        """Rows ``first_row, …`` written, each with the serial of its oldest frame."""
        suffix = np.minimum.accumulate(oldest[::-1])[::-1]
        new = np.flatnonzero(np.append(oldest[:-1] < suffix[1:], True))
        h, t = self.head, self.tail
        t = h + int(np.searchsorted(self.frames[h:t], suffix[0]))  # steps as old stay
        if t + len(new) > len(self.rows):
            self.rows[: t - h], self.frames[: t - h] = self.rows[h:t], self.frames[h:t]
            h, t = 0, t - h
        self.rows[t : t + len(new)] = first_row + new
        self.frames[t : t + len(new)] = oldest[new]
        self.head, self.tail = h, t + len(new)

    def cut(self, below: int) -> int:
        """The first row that may stay once frames below serial ``below`` are overwritten
        (0: every row may); forgets the steps before it."""
        i = self.head + int(np.searchsorted(self.frames[self.head : self.tail], below))
        if i == self.head:
            return 0
        self.head = i
        return int(self.rows[i - 1]) + 1

    def forget(self, lo: int) -> None:
        """Rows below ``lo`` have left the window."""
        self.head += int(np.searchsorted(self.rows[self.head : self.tail], lo))


@dataclass
class Plan:
    """One write's rows and frames, worked out before anything is copied (writer only)."""

    size: int  # rows
    rows: Rows  # the rows' fields, and their frame positions under TABLE
    obs: torch.Tensor  # the rows' observation and ("next", "observation")
    nxt: torch.Tensor
    first: int  # serial of its first new frame
    frames: int  # new frames: the obs frames of segment starts, then one per row
    from_obs: torch.Tensor  # flat [n * k] indices into the batch's observation frames
    from_next: torch.Tensor  # rows whose newest next frames follow them (each env's together)
    table: np.ndarray  # [n, k + 1] frame positions of each row, in batch order
    oldest: np.ndarray  # [n] serial of each row's oldest frame, in batch order
    check: np.ndarray  # rows to verify (batch indices)
    envs: tuple[np.ndarray, ...]  # env slots, their last stacks, episode, step, rows seen


class FrameStore:
    """Frames of one buffer, and the writer's record of each env's stream.

    Args:
        capacity: the buffer's rows.
        k: frames per stack.
        frame: ``[n, *frame]`` frames like those to store (shape and dtype).
        empty: makes ``n`` uninitialised rows like a tensor's, in the buffer's memory.
        seed: seeds the choice of rows to verify.
    """

    def __init__(
        self, capacity: int, k: int, frame: torch.Tensor, empty: Empty, seed: int | None
    ) -> None:
        self.k, self.slots = k, frame_slots(capacity, k)
        self.reach = self.slots // 4
        self.frames = empty(self.slots + 1, frame)
        self.frames[self.slots].zero_()
        self.table = empty(capacity, torch.empty(0, k + 1, dtype=torch.int64))
        self._stairs = Staircase(capacity)
        self._next = 0  # serial of the next frame written
        self.filled = 0  # positions of the row ring that ever held a row
        self._ids: dict[int, int] = {}  # env_index -> slot of the arrays below
        self._known = np.zeros(0, bool)
        self._episode = np.zeros(0, np.int64)
        self._step = np.zeros(0, np.int64)
        self._seen = np.zeros(0, np.int64)
        self._hist = np.zeros((0, k), np.int64)  # serials of each env's last next stack
        self._rand = torch.Generator()
        if seed is None:
            self._rand.seed()
        else:
            self._rand.manual_seed(seed)

    @property
    def nbytes(self) -> int:
        """Bytes of the frames, the table and the staircase."""
        stairs = self._stairs.rows.nbytes + self._stairs.frames.nbytes
        return self.frames.nbytes + self.table.nbytes + stairs

    def plans(self, rows: Rows, obs: torch.Tensor, nxt: torch.Tensor) -> Iterator[Plan]:
        """Plans of the writes of ``rows`` (the fields) and their stacks, in parts where
        one would overwrite frames its own rows name. Each part is planned once the one
        before it is committed."""
        env, episode, step = stream_columns(rows)
        todo = [(0, len(env))]
        while todo:
            lo, hi = todo.pop()
            part = slice(lo, hi)
            fields = {key: value[part] for key, value in rows.items()}
            plan = self._plan(env[part], episode[part], step[part], fields, obs[part], nxt[part])
            if plan.frames > self.slots - self.reach and hi - lo > 1:
                todo += [((lo + hi) // 2, hi), (lo, (lo + hi) // 2)]
                continue
            yield plan

    def _slot(self, env: int) -> int:
        slot = self._ids.setdefault(env, len(self._ids))
        if slot == len(self._known):  # room for twice as many envs
            more = max(8, slot)
            self._known = np.append(self._known, np.zeros(more, bool))
            self._episode = np.append(self._episode, np.zeros(more, np.int64))
            self._step = np.append(self._step, np.zeros(more, np.int64))
            self._seen = np.append(self._seen, np.zeros(more, np.int64))
            self._hist = np.concatenate([self._hist, np.zeros((more, self.k), np.int64)])
        return slot

    def _plan(
        self,
        env: np.ndarray,
        episode: np.ndarray,
        step: np.ndarray,
        rows: Rows,
        obs: torch.Tensor,
        nxt: torch.Tensor,
    ) -> Plan:
        k, m, j = self.k, len(env), np.arange(len(env))
        ids, inverse = np.unique(env, return_inverse=True)
        slot = np.array([self._slot(int(i)) for i in ids], np.int64)[inverse]
        order = np.argsort(slot, kind="stable")  # each env's rows together, in batch order
        g, ep, st = slot[order], episode[order], step[order]
        first = np.append(True, g[1:] != g[:-1])
        head = first | np.append(True, (ep[1:] != ep[:-1]) | (st[1:] != st[:-1] + 1))
        hist = self._hist[g]
        near = np.where(hist >= 0, hist, _NONE).min(1) >= self._next - self.reach
        resume = first & self._known[g] & (ep == self._episode[g]) & (st == self._step[g] + 1)
        resume &= near
        start = head & ~resume
        one, zeros = self._episode_starts(start & (st == 0), order, obs)
        count = np.where(one, 1, np.where(start, k, 0))
        a, before = int(count.sum()), np.cumsum(count) - count
        base = self._next + before  # serial of a segment's first frame
        frame_row = np.repeat(j, count)  # the sorted row of each obs frame stored
        within = np.arange(a) - np.repeat(before, count)
        from_obs = order[frame_row] * k + np.where(one[frame_row], k - 1, within)
        pre = np.zeros((m, k), np.int64)  # each segment's k frames before its first next one
        pre[resume] = hist[resume]
        pre[one] = np.where(zeros[one, None], -1, base[one, None])
        pre[one, k - 1] = base[one]
        whole = start & ~one
        pre[whole] = base[whole, None] + np.arange(k)
        h = np.maximum.accumulate(np.where(head, j, 0))
        at = (j - h)[:, None] + np.arange(k + 1)  # place in its segment's frames
        # the rows' own new frames follow, each env's together (in order): a stack's
        # frames mostly lie side by side, and a sample reads it in one piece
        newer = self._next + a + j[:, None] + np.arange(k + 1) - k
        serial = np.where(at < k, pre[h[:, None], np.minimum(at, k - 1)], newer)
        table, oldest = np.empty_like(serial), np.empty(m, np.int64)
        table[order] = np.where(serial < 0, self.slots, serial % self.slots)
        oldest[order] = np.where(serial >= 0, serial, _NONE).min(1)
        rank = j - np.maximum.accumulate(np.where(first, j, 0))
        chance = torch.rand(m, generator=self._rand).numpy() * VERIFY_ONE_IN < 1
        check = (st == 0) | (self._seen[g] + rank < VERIFY_FIRST) | chance
        last = np.append(g[1:] != g[:-1], True)
        envs = (g[last], serial[last, 1:], ep[last], st[last], rank[last] + 1)
        return Plan(
            size=m,
            rows={**rows, TABLE: torch.from_numpy(table)},
            obs=obs,
            nxt=nxt,
            first=self._next,
            frames=a + m,
            from_obs=torch.from_numpy(from_obs),
            from_next=torch.from_numpy(order),
            table=table,
            oldest=oldest,
            check=np.sort(order[check]),
            envs=envs,
        )

    def _episode_starts(
        self, candidates: np.ndarray, order: np.ndarray, obs: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which episode starts pad their first stack with zeros or with the first frame
        repeated (stored as one frame), and which of them with zeros; told from the rows."""
        one, zeros = candidates.copy(), np.zeros_like(candidates)
        if self.k == 1 or not one.any():
            return one, zeros
        x = obs[torch.from_numpy(order[one]).to(obs.device)]
        pad, newest = x[:, : self.k - 1], x[:, self.k - 1 :]
        z, r = (pad == 0).flatten(1).all(1), (pad == newest).flatten(1).all(1)
        zeros[one] = z.cpu().numpy()
        one[one] = (z | r).cpu().numpy()
        return one, zeros

    def evict(self, plan: Plan) -> int:
        """The first row that may stay readable once ``plan`` is written (0: any)."""
        return self._stairs.cut(plan.first + plan.frames - self.slots)

    def forget(self, lo: int) -> None:
        """Rows below ``lo`` have left the buffer's window."""
        self._stairs.forget(lo)

    def write(self, plan: Plan) -> str:
        """Copy the plan's frames in (on the current stream, where CUDA), then verify the
        plan's rows; returns what differs, if a row does ("" if none)."""
        obs, nxt, rows, frame = plan.obs, plan.nxt, plan.rows, plan.obs.shape[2:]
        self._put(obs.reshape(-1, *frame), plan.from_obs, plan.first)
        self._put(nxt[:, self.k - 1], plan.from_next, plan.first + len(plan.from_obs))
        if not len(plan.check):
            return ""
        check = torch.from_numpy(plan.check)
        table = torch.from_numpy(plan.table[plan.check]).to(self.frames.device)
        bad = []
        for given, cols in ((obs, 0), (nxt, 1)):
            got = self.frames.index_select(0, table[:, cols : cols + self.k].reshape(-1))
            want = given[check.to(given.device)].to(self.frames.device)
            # bit for bit: as bytes (a NaN equals itself, -0.0 differs from 0.0)
            got, want = (x.reshape(len(check), -1).view(torch.uint8) for x in (got, want))
            bad.append(None if torch.equal(got, want) else (got != want).any(1).cpu())
        if bad[0] is None and bad[1] is None:
            return ""
        either = torch.stack(
            [torch.zeros(len(check), dtype=torch.bool) if b is None else b for b in bad]
        )
        first = int(either.any(0).nonzero()[0, 0])  # the earliest row that differs
        key = OBSERVATION if bool(either[0, first]) else NEXT_OBSERVATION
        env, episode, step = (int(rows[column][int(check[first])]) for column in STREAM_KEYS)
        return (
            f"extend: {name(key)} of env {env} (episode {episode}, step {step}) differs "
            "from the stack rebuilt from the frames stored before it: "
            f"frame_stack={self.k} needs each stack on the first axis, oldest frame first, "
            "and each step's stack the one before it moved on by one new frame (a stack on "
            "another axis, or a wrapper that changes old frames, is not one)"
        )

    def _put(self, src: torch.Tensor, index: torch.Tensor | None, first: int) -> None:
        """Frames ``src[index]`` (``src`` itself where ``index`` is None) to serials
        ``first, first + 1, …``: one copy, two where the ring wraps."""
        n = len(src) if index is None else len(index)
        at = first % self.slots
        head = min(n, self.slots - at)
        if index is not None:
            index = index.to(src.device)
        for dst, lo, hi in ((self.frames[at : at + head], 0, head), (self.frames, head, n)):
            if hi == lo:
                continue
            if index is None:
                dst[: hi - lo].copy_(src[lo:hi])
            elif dst.device == src.device:
                torch.index_select(src, 0, index[lo:hi], out=dst[: hi - lo])
            else:
                dst[: hi - lo].copy_(src.index_select(0, index[lo:hi]))

    def commit(self, plan: Plan, first_row: int) -> None:
        """The plan's frames written and its rows at serials ``first_row, …``."""
        self._next += plan.frames
        slots, hist, episode, step, seen = plan.envs
        self._hist[slots], self._episode[slots], self._step[slots] = hist, episode, step
        self._known[slots] = True
        self._seen[slots] += seen
        self._stairs.push(first_row, plan.oldest)
        self.filled = min(len(self.table), self.filled + plan.size)

    def gather(self, positions: torch.Tensor, empty: Empty) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks of the rows at ``positions``: ``observation`` and its next one, two
        views of one ``[n, k + 1, *frame]`` gather that reads each row's ``k + 1`` frames
        once (a row buffer reads ``2k``). A row's frames mostly lie side by side (each
        env's new frames of one write are stored together), so the reads are mostly of
        whole stacks, as a row buffer's."""
        n, k = len(positions), self.k
        index = self.table.index_select(0, positions).view(-1)
        got = torch.index_select(self.frames, 0, index, out=empty(n * (k + 1), self.frames))
        got = got.view(n, k + 1, *self.frames.shape[1:])
        return got[:, :k], got[:, 1:]

    def state_dict(self, hi: int) -> dict[str, Any]:
        """The frames, the table's rows at ``[0, filled)`` and each env's record, as
        tensors (on the CPU) and ints; row serials relative to the buffer's ``hi``."""
        stairs, n = self._stairs, len(self._ids)
        records = {
            "known": self._known,
            "episode": self._episode,
            "step": self._step,
            "seen": self._seen,
            "last_stack": self._hist,
        }
        return {
            "frame_stack": self.k,
            "frames": self.frames[: self.slots].to("cpu", copy=True),
            "table": self.table[: self.filled].to("cpu", copy=True),
            "filled": self.filled,
            "next_frame": self._next,
            "env_index": torch.tensor(list(self._ids), dtype=torch.int64),  # by slot
            **{key: torch.from_numpy(value[:n].copy()) for key, value in records.items()},
            "staircase_rows": torch.from_numpy(stairs.rows[stairs.head : stairs.tail] - hi),
            "staircase_frames": torch.from_numpy(stairs.frames[stairs.head : stairs.tail].copy()),
            "verify_generator": self._rand.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any], hi: int) -> None:
        """Restore what :meth:`state_dict` returned (on the current stream, where CUDA)."""
        self.frames[: self.slots].copy_(state["frames"])
        self.filled = int(state["filled"])
        self.table[: self.filled].copy_(state["table"])
        self._next = int(state["next_frame"])
        self._ids = {int(env): slot for slot, env in enumerate(state["env_index"].tolist())}
        self._known = state["known"].numpy().copy()
        self._episode = state["episode"].numpy().copy()
        self._step = state["step"].numpy().copy()
        self._seen = state["seen"].numpy().copy()
        self._hist = state["last_stack"].numpy().copy().reshape(-1, self.k)
        steps = len(state["staircase_rows"])
        self._stairs.rows[:steps] = state["staircase_rows"].numpy() + hi
        self._stairs.frames[:steps] = state["staircase_frames"].numpy()
        self._stairs.head, self._stairs.tail = 0, steps
        self._rand.set_state(state["verify_generator"])
