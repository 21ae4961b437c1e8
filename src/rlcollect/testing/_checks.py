"""The checks of the transport conformance suite, which ``conformance.CHECKS`` names."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from rlcollect.errors import ChannelClosed, WorkerError
from rlcollect.testing._responder import _DEADLINE, _Chunk, _chunk_rows, _collect, _Responder
from rlcollect.testing.envs import ENV_ID, EPISODE, LAST_ACTION, STEP, counting_actions
from rlcollect.testing.programs import _ACTIONS, counting_layout, counting_programs
from rlcollect.transports.base import ServerEnd, Transport, WorkerEnd
from rlcollect.transports.layout import RingLayout


def _round_trip(make_transport: Callable[[], Transport], layout: RingLayout, want: int) -> None:
    """Chunks arrive in slot order per worker; every env's stream is whole and routed."""
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    responder = _Responder(end, layout)
    try:
        chunks = _collect(end, layout, want=want)
    finally:
        transport.close()
        responder.stop()
    next_slot = [0] * layout.num_workers
    streams: dict[int, list[np.ndarray]] = {}
    for w, s, rows in chunks:
        assert s == next_slot[w], f"worker {w} handed over slot {s}, expected {next_slot[w]}"
        next_slot[w] = (s + 1) % layout.slots
        obs, nxt = rows["observation"], rows["next/observation"]
        assert (obs[:, ENV_ID] // layout.columns == w).all(), "rows from another worker"
        assert (rows["env_index"] == obs[:, ENV_ID]).all(), "env_index does not match the env"
        assert (rows["action"] == counting_actions(obs, _ACTIONS)).all(), "action misrouted"
        assert (nxt[:, LAST_ACTION] == rows["action"]).all(), "env received another action"
        for i in np.unique(obs[:, ENV_ID]):
            streams.setdefault(int(i), []).append(obs[obs[:, ENV_ID] == i])
    for i, parts in streams.items():
        seq = np.concatenate(parts)
        assert seq[0, EPISODE] == 0 and seq[0, STEP] == 0, f"env {i} starts at {seq[0].tolist()}"
        for a, b in itertools.pairwise(seq):
            same = a[EPISODE] == b[EPISODE] and b[STEP] == a[STEP] + 1
            new = b[EPISODE] == a[EPISODE] + 1 and b[STEP] == 0
            assert same or new, f"env {i} stream jumps from {a.tolist()} to {b.tolist()}"


def _check_round_trip(make_transport: Callable[[], Transport]) -> None:
    """One request per worker at a time: streams whole, actions routed, slots in order."""
    layout = counting_layout(num_workers=3, columns=2, chunk_steps=4, slots=2)
    _round_trip(make_transport, layout, want=30)


def _check_double_buffered_round_trip(make_transport: Callable[[], Transport]) -> None:
    """Two requests per worker outstanding (two splits of its columns): the same guarantees.

    The transport must deliver a worker's requests in the order it made them and one
    response per request.
    """
    layout = counting_layout(num_workers=2, columns=4, chunk_steps=3, slots=2, splits=2)
    _round_trip(make_transport, layout, want=30)


def _check_staged_round_trip(make_transport: Callable[[], Transport]) -> None:
    """Vector envs returning arbitrary subsets of sub-envs (staged requests, two vector
    envs per worker): every env's stream is still whole, in order and routed."""
    layout = counting_layout(
        num_workers=2, columns=8, chunk_steps=3, slots=2, splits=2, vector_batch=2
    )
    _round_trip(make_transport, layout, want=30)


def _check_backpressure(make_transport: Callable[[], Transport]) -> None:
    """A worker stops after filling every slot, and resumes once per released slot."""
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=3, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    responder = _Responder(end, layout)
    try:
        held = _collect(end, layout, want=4, release=False)
        assert sorted(w for w, _, _ in held) == [0, 0, 1, 1]
        extra = end.wait_chunks(0.5)
        assert extra == [], f"chunks {extra} arrived while every slot was held"
        end.release(0, 0)
        more = _collect(end, layout, want=1, release=False)
        assert more[0][:2] == (0, 0), f"after releasing (0, 0) got chunk {more[0][:2]}"
    finally:
        transport.close()
        responder.stop()


def _check_worker_error(make_transport: Callable[[], Transport]) -> None:
    """An env raising reaches wait_chunks as a WorkerError naming the env."""
    layout = counting_layout(num_workers=2, columns=2, chunk_steps=2, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout, fail={3: (1, 2)}))
    responder = _Responder(end, layout)
    deadline = time.monotonic() + _DEADLINE
    try:
        while True:
            assert time.monotonic() < deadline, "the env's exception never reached the driver"
            try:
                for w, s in end.wait_chunks(0.1):
                    end.release(w, s)
            except WorkerError as err:
                assert err.env_index == 3 and err.worker_index == 1, str(err)
                assert "failed on purpose in step" in str(err), str(err)
                assert "Traceback" in str(err.__cause__), "the remote traceback is missing"
                break
    finally:
        transport.close()
        responder.stop()


def _check_abort(make_transport: Callable[[], Transport]) -> None:
    """abort() ends both driver waits promptly, and close() twice is harmless."""
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    try:
        assert end.wait_chunks(0.05) == [], "a chunk arrived with no server answering"
        end.abort()
        for wait in (end.wait_requests, end.wait_chunks):
            t0 = time.monotonic()
            try:
                wait(_DEADLINE)
            except ChannelClosed:
                pass
            else:
                raise AssertionError(f"{wait.__name__} returned after abort()")
            assert time.monotonic() - t0 < _DEADLINE / 2, f"{wait.__name__} waited out its timeout"
    finally:
        transport.close()
        transport.close()


def _check_close_unblocks_workers(make_transport: Callable[[], Transport]) -> None:
    """close() ends workers blocked on a response and on a full ring, and returns."""
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=1, slots=1)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout))
    # Worker 0 ends up waiting for a free slot; worker 1 waits for a response.
    deadline = time.monotonic() + _DEADLINE
    got: list[tuple[int, int]] = []
    while not got:
        assert time.monotonic() < deadline, "no request arrived"
        for w, p in end.wait_requests(0.1):
            if w == 0:
                end.buffers[("action",)][w, p] = 0
                end.respond([w])
        got = end.wait_chunks(0.05)
    closer = threading.Thread(target=transport.close, daemon=True)
    closer.start()
    closer.join(_DEADLINE)  # a transport whose close() hangs fails here, not forever
    assert not closer.is_alive(), f"close() did not return within {_DEADLINE} s"


def _check_restart(make_transport: Callable[[], Transport]) -> None:
    """Every chunk a failing worker handed over comes before its failure; restarted with
    ``restart_worker``, it runs on with its slots free, its failure no longer raised,
    and takes only the answers to its own requests. (Transports without
    ``supports_restart`` pass trivially.)"""
    if not make_transport().supports_restart:
        return
    # Two splits: when env 3 fails, the other split's request is outstanding, and its
    # answer must not reach the new worker. Env 3 fails in its 7th step (episode 0 lasts
    # 4), the first of the 4th chunk: the worker has handed over 3 chunks by then.
    layout = counting_layout(num_workers=2, columns=2, chunk_steps=2, slots=2, splits=2)
    transport = make_transport()
    end = transport.start(layout, counting_programs(layout, fail={3: (1, 2)}))
    responder = _Responder(end, layout)
    before: list[np.ndarray] = []  # env 3's observations handed over before it failed
    after: list[_Chunk] = []
    deadline = time.monotonic() + _DEADLINE
    try:
        restarted = False
        while len([c for c in after if c[0] == 1]) < 6:
            assert time.monotonic() < deadline, "the restarted worker handed over too little"
            try:
                ready = end.wait_chunks(0.1)
            except WorkerError as err:
                assert not restarted, f"a second failure after the restart: {err}"
                assert err.worker_index == 1, str(err)
                transport.restart_worker(1, counting_programs(layout)[1])
                restarted = True
                continue
            for w, s in ready:
                rows = _chunk_rows(end, layout, w, s)
                if restarted:
                    after.append((w, s, rows))
                elif w == 1:
                    obs = rows["observation"]
                    before.append(obs[obs[:, ENV_ID] == 3])
                end.release(w, s)  # every chunk comes before the failure, or after the restart
        last = np.concatenate(before)[-1] if before else None
        assert last is not None and (last[EPISODE], last[STEP]) == (1, 1), (
            f"env 3's last transition before the failure was {last}, not (episode 1, step 1): "
            "a chunk handed over before the failure was not returned before it"
        )
        new = [c for c in after if c[0] == 1]
        assert [s for _, s, _ in new] == [i % layout.slots for i in range(len(new))], (
            "the restarted worker did not start with every slot free"
        )
        obs = np.concatenate([rows["observation"] for _, _, rows in new])
        action = np.concatenate([rows["action"] for _, _, rows in new])
        assert (action == counting_actions(obs, _ACTIONS)).all(), "a stale answer was taken"
        for i in (2, 3):
            seq = obs[obs[:, ENV_ID] == i]
            assert seq[0, EPISODE] == 0 and seq[0, STEP] == 0, f"env {i} did not start anew"
            for a, b in itertools.pairwise(seq):
                same = a[EPISODE] == b[EPISODE] and b[STEP] == a[STEP] + 1
                assert same or (b[EPISODE] == a[EPISODE] + 1 and b[STEP] == 0), (
                    f"env {i} stream jumps from {a.tolist()} to {b.tolist()} after the restart"
                )
    finally:
        transport.close()
        responder.stop()


def _handed(end: ServerEnd, want: int) -> list[tuple[int, int]]:
    """The next ``want`` chunks handed over, ``(worker, slot)``, within the deadline."""
    got: list[tuple[int, int]] = []
    deadline = time.monotonic() + _DEADLINE
    while len(got) < want:
        assert time.monotonic() < deadline, f"{len(got)} of {want} chunks came back: {got}"
        got += end.wait_chunks(0.1)
    return got


def _echo_slots(end: WorkerEnd) -> None:
    """A worker program that hands over each slot it is given, untouched."""
    while True:
        slot = end.wait_slot()
        end.hand_over(-1 if slot is None else slot)


def _check_named_slots(make_transport: Callable[[], Transport]) -> None:
    """``wait_slot`` returns the slots ``release`` gave back, in the order it gave them,
    after every slot once from 0 up. (Transports without ``names_slots`` pass
    trivially.)"""
    if not make_transport().names_slots:
        return
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=1, slots=3)
    transport = make_transport()
    end = transport.start(layout, [_echo_slots] * layout.num_workers)

    try:
        first = _handed(end, 6)
        for w in range(layout.num_workers):
            mine = [s for v, s in first if v == w]
            assert mine == [0, 1, 2], f"worker {w} was given slots {mine} at first, not 0, 1, 2"
        order = {0: [2, 0, 1], 1: [1, 2, 0]}  # out of the order they were handed over
        for w, slots in order.items():
            for s in slots:
                end.release(w, s)
        then = _handed(end, 6)
        for w, slots in order.items():
            mine = [s for v, s in then if v == w]
            assert mine == slots, f"worker {w} was given slots {mine} after {slots} were released"
    finally:
        transport.close()


def _mark_slots(end: WorkerEnd) -> None:
    """A worker program that writes its index plus 100 into each slot it is given (a
    pooled ring of one-step slots) and hands it over."""
    steps = end.buffers[("step",)]  # pooled: every slot of the ring
    while True:
        slot = end.wait_slot()
        assert slot is not None
        steps[slot] = 100 + end.index
        end.hand_over(slot)


def _check_pooled_ring(make_transport: Callable[[], Transport]) -> None:
    """A pooled ring's workers start with ``RingLayout.first_credits``, write the
    slot their credit names, whichever worker wrote it before, and see the whole ring.
    (Transports whose ``pool_slots`` is 0 pass trivially.)"""
    if not make_transport().pool_slots:
        return
    layout = dataclasses.replace(
        counting_layout(num_workers=2, columns=1, chunk_steps=1, slots=3), pooled=True
    )
    transport = make_transport()
    end = transport.start(layout, [_mark_slots] * layout.num_workers)
    steps = end.buffers[("step",)]

    def written(slot: int) -> int:
        return int(steps[slot // layout.slots, slot % layout.slots, 0])

    try:
        first = _handed(end, 4)
        for w in range(layout.num_workers):
            mine = tuple(s for v, s in first if v == w)
            assert mine == layout.first_credits(w), (
                f"worker {w} was given slots {mine} at first, not {layout.first_credits(w)}"
            )
            assert all(written(s) == 100 + w for s in mine), f"worker {w} wrote elsewhere"
        end.release(0, 4)  # worker 1's slot before: any worker writes any slot
        end.release(1, 2)
        then = sorted(_handed(end, 2))
        assert then == [(0, 4), (1, 2)], f"slots {then} came back, not [(0, 4), (1, 2)]"
        assert written(4) == 100 and written(2) == 101, "a slot was not written where named"
    finally:
        transport.close()


def _check_segments(make_transport: Callable[[], Transport]) -> None:
    """Every shared-memory segment ``segments()`` names is in ``/dev/shm`` while the
    transport runs, and gone once it is closed. (Transports that name none pass
    trivially.)"""
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=1, slots=1)
    transport = make_transport()
    transport.start(layout, counting_programs(layout))
    try:
        names = transport.segments()
        missing = [n for n in names if not os.path.exists(os.path.join("/dev/shm", n))]
        assert not missing, f"segments() names {missing}, which /dev/shm does not hold"
    finally:
        transport.close()
    left = [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]
    assert not left, f"segments {left} are still in /dev/shm after close()"
