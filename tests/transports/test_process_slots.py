"""What only the process transport promises: real processes, real shared memory, cleanup."""

import dataclasses
import functools
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from envs import exit_marking
from helpers import CountingPolicy, process_gone, shm_exists, wait_until
from programs import PaddedProgram

from rlcollect import AsyncBatchedCollector
from rlcollect.errors import ChannelClosed, CollectorError, WorkerError
from rlcollect.testing import counting_layout, counting_programs
from rlcollect.testing._checks import _handed, _mark_slots
from rlcollect.transports import ProcessSlotTransport, process_server


def start(num_workers=2):
    t = ProcessSlotTransport()
    layout = counting_layout(num_workers=num_workers, columns=1, chunk_steps=2, slots=2)
    end = t.start(layout, counting_programs(layout))
    return t, end


def test_segments_names_the_ring_in_dev_shm_until_close():
    """segments() names what the transport created: nothing before start, the ring's
    segment (in /dev/shm) once started; close() unlinks it."""
    t = ProcessSlotTransport()
    assert t.segments() == ()
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=2)
    t.start(layout, counting_programs(layout))
    try:
        assert t.segments() == (t.shm_name,)
        assert os.path.exists(f"/dev/shm/{t.shm_name}")
    finally:
        t.close()
    assert t.segments() == (t.shm_name,)
    assert not os.path.exists(f"/dev/shm/{t.shm_name}")


def test_segment_is_owner_only_and_gone_after_close():
    t, _ = start()
    try:
        mode = os.stat(f"/dev/shm/{t.shm_name}").st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert len(t.shm_name) >= 24  # random, unguessable
    finally:
        t.close()
    assert not shm_exists(t.shm_name)
    assert all(code is not None for code in t.exit_codes)
    t.close()  # idempotent


def test_worker_killed_with_sigkill_is_reported():
    t, end = start()
    try:
        os.kill(t.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker 1 .* killed by SIGKILL") as info:
            while time.monotonic() - t0 < 10:
                end.wait_chunks(0.1)
        assert info.value.worker_index == 1
    finally:
        t.close()


@pytest.mark.parametrize("wait", ["wait_requests", "wait_chunks"])
def test_close_leaves_the_fds_of_a_wait_under_way_open_until_it_returns(monkeypatch, wait):
    """A thread inside a wait when another closes the transport (a server thread that a
    busy machine did not schedule, the collector's stop having timed out) reads open fds
    and ends with ChannelClosed: close() frees them only once the wait has returned."""
    monkeypatch.setattr(process_server, "_CLOSE_WAIT", 60.0)  # no bound reached here
    t, end = start()
    paused, resume, closing = threading.Event(), threading.Event(), threading.Event()
    poll = process_server._read_requests if wait == "wait_requests" else end._wait_chunks

    def descheduled(*args):  # inside the wait, before it reads
        paused.set()
        assert resume.wait(60)
        return poll(*args)

    if wait == "wait_requests":
        monkeypatch.setattr(process_server, "_read_requests", descheduled)
    else:
        monkeypatch.setattr(end, "_wait_chunks", descheduled)
    real_close_fds = end.close_fds

    def close_fds():
        closing.set()
        real_close_fds()

    monkeypatch.setattr(end, "close_fds", close_fds)
    outcome = []

    def waiter():
        try:
            getattr(end, wait)(0.05)
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=waiter)
    waiting.start()
    closer = threading.Thread(target=t.close)
    try:
        assert paused.wait(60)
        closer.start()
        assert closing.wait(60)
        closer.join(1.0)
        # Still closing: its fds stay open while the wait is under way.
        assert closer.is_alive(), "close() freed the fds of a wait still under way"
    finally:
        resume.set()
        waiting.join(60)
        if closer.ident is not None:
            closer.join(60)
        t.close()
    assert not closer.is_alive() and not waiting.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ChannelClosed), outcome


def test_garbage_collected_transport_cleans_up():
    t, _ = start()
    name, pids = t.shm_name, t.pids
    del t, _
    import gc

    gc.collect()
    assert not shm_exists(name)
    wait_until(lambda: all(process_gone(p) for p in pids), what="workers to exit")


DRIVER = """
import sys
from rlcollect.testing import counting_layout, counting_programs
from rlcollect.transports import ProcessSlotTransport
t = ProcessSlotTransport()
layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=2)
end = t.start(layout, counting_programs(layout))
print(t.shm_name, *t.pids, flush=True)
sys.stdin.read()
"""


def test_driver_killed_with_sigkill_leaves_nothing_behind():
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        name, *pids = driver.stdout.readline().split()
        assert shm_exists(name)
        driver.kill()
        driver.wait(10)
        wait_until(lambda: all(process_gone(int(p)) for p in pids), what="orphaned workers")
        wait_until(lambda: not shm_exists(name), what="the segment to be unlinked")
    finally:
        driver.kill()
        driver.wait(10)


def test_request_channel_needs_a_running_transport():
    layout = counting_layout(num_workers=1, columns=1, chunk_steps=1, slots=1)
    transport = ProcessSlotTransport()
    with pytest.raises(CollectorError, match=r"request_channel\(\) needs a running"):
        transport.request_channel()
    transport.start(layout, counting_programs(layout))
    assert transport.request_channel().layout == layout
    transport.close()
    with pytest.raises(CollectorError, match=r"request_channel\(\) needs a running"):
        transport.request_channel()


def test_a_ring_of_more_slots_than_one_write_of_credits_holds_is_refused():
    """A worker's first credits are one pipe write of at most 4096 bytes (two per slot)."""
    transport = ProcessSlotTransport()
    layout = counting_layout(num_workers=1, columns=1, chunk_steps=1, slots=2049)
    with pytest.raises(ValueError, match="at most 2048 slots per worker"):
        transport.start(layout, counting_programs(layout))
    transport.close()


def test_a_pooled_ring_of_more_slots_than_a_credit_can_name_is_refused():
    layout = dataclasses.replace(
        counting_layout(num_workers=1, columns=1, chunk_steps=1, slots=2**16 + 1),
        pooled=True,
    )
    transport = ProcessSlotTransport()
    with pytest.raises(ValueError, match="at most 65536 slots in a pooled ring"):
        transport.start(layout, counting_programs(layout))
    transport.close()


def test_credits_name_slots_past_a_byte():
    """Two workers of a pooled ring of 600 slots: a credit names slots 300 and 599 (more
    than a byte holds), and each worker writes the slot named, not a byte of it."""
    layout = dataclasses.replace(
        counting_layout(num_workers=2, columns=1, chunk_steps=1, slots=300), pooled=True
    )
    transport = ProcessSlotTransport()
    end = transport.start(layout, [_mark_slots] * 2)
    steps = end.buffers[("step",)]
    try:
        first = _handed(end, 4)  # each worker's first credits: slots 0-3
        assert sorted(slot for _, slot in first) == [0, 1, 2, 3]
        end.release(0, 300)
        end.release(1, 599)
        assert sorted(_handed(end, 2)) == [(0, 300), (1, 599)]
        assert int(steps[1, 0, 0]) == 100 and int(steps[1, 299, 0]) == 101
        assert int(steps[0, 44, 0]) == 0 and int(steps[0, 87, 0]) == 0  # 300 % 256, 599 % 256
    finally:
        transport.close()


def test_a_worker_of_a_pooled_ring_maps_the_whole_ring_at_start():
    """Each worker writes slots all over a pooled ring, so it maps every page of it
    before its first slot (processes.map_every_page): its resident shared memory is
    the whole ring once it has handed its first slots over, where it has written only
    four of twelve slots (a third of the ring)."""
    layout = dataclasses.replace(
        counting_layout(num_workers=2, columns=1, chunk_steps=2048, slots=6),
        pooled=True,
    )
    assert layout.nbytes > 64 * os.sysconf("SC_PAGE_SIZE")
    transport = ProcessSlotTransport()
    end = transport.start(layout, [_mark_slots] * 2)
    try:
        assert sorted(slot for _, slot in _handed(end, 4)) == [0, 1, 2, 3]
        for pid in transport.pids:
            status = Path(f"/proc/{pid}/status").read_text()
            kib = int(
                next(line for line in status.splitlines() if line.startswith("RssShmem:")).split()[
                    1
                ]
            )
            assert kib * 1024 >= layout.nbytes - os.sysconf("SC_PAGE_SIZE"), (
                f"worker {pid} maps {kib} KiB of a {layout.nbytes // 1024} KiB ring"
            )
    finally:
        transport.close()


def test_start_does_not_wait_for_workers_to_read_their_programs(tmp_path, monkeypatch):
    # Worker interpreters held at their start until `gate` exists, with programs larger
    # than a pipe holds: start() must return all the same. (Sent through a pipe, a
    # program would block start() until its worker got going and read it, so workers
    # would start one after another.)
    gate = tmp_path / "gate"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, time\n"
        "deadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(gate)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    monkeypatch.syspath_prepend(str(site))  # the workers' PYTHONPATH is the driver's path
    layout = counting_layout(num_workers=2, columns=1, chunk_steps=2, slots=2)
    programs = [PaddedProgram(p, 4 << 20) for p in counting_programs(layout)]
    t = ProcessSlotTransport()
    started = threading.Event()
    ends = []

    def start_transport():
        ends.append(t.start(layout, programs))
        started.set()

    threading.Thread(target=start_transport, daemon=True).start()
    try:
        assert started.wait(30), "start() waited for the workers to read their programs"
        assert not gate.exists()  # so no worker had started running yet
        gate.touch()
        seen = set()
        deadline = time.monotonic() + 30
        while seen != {0, 1} and time.monotonic() < deadline:
            seen.update(w for w, _ in ends[0].wait_requests(0.5))
        assert seen == {0, 1}  # both workers read their programs and run them
    finally:
        gate.touch()
        started.wait(30)
        t.close()


@pytest.mark.parametrize("backend", ["thread", "worker"])
def test_stopped_workers_run_their_exit_handlers(tmp_path, backend):
    # A stopped worker exits without the interpreter's teardown (slow with torch
    # imported, and close() would wait for it), but after the exit handlers its envs
    # registered; close() returns once every worker has exited.
    factories = [functools.partial(exit_marking, str(tmp_path), i) for i in range(4)]
    with AsyncBatchedCollector(
        factories,
        CountingPolicy(),
        frames_per_batch=16,
        total_frames=-1,
        envs_per_worker=2,
        inference_backend=backend,
        transport="process_slots",
    ) as c:
        pids = c.transport.pids
        seen: set[int] = set()
        deadline = time.monotonic() + 300
        while seen != {0, 1, 2, 3}:  # every worker got going and built its envs
            seen.update(next(c)["env_index"].tolist())
            assert time.monotonic() < deadline, "a worker delivers nothing"  # a hang guard
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(map(str, pids))
