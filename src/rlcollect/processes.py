"""Process plumbing: shared-memory segments, starting a child with its program, stopping it.

Used by the worker processes (:mod:`rlcollect.transports.process_slots`) and the
inference process (:mod:`rlcollect.inference.process`); what travels through the
segments and pipes is described in those modules. Imports no torch: worker processes
import it.

Shared-memory segments (who creates, who maps, who unlinks, and why it is safe):

* The driver creates each segment (:func:`create_segment`) with ``O_CREAT | O_EXCL``
  and mode ``0600``, named with 96 random bits: another user cannot open it, and a
  segment of that name cannot be planted in advance (creation would fail instead of
  reusing it).
* Children only map it (:func:`attach_segment`), by hand rather than through
  ``SharedMemory``, which in Python < 3.13 registers the segment with a resource
  tracker of the child that unlinks it when the child exits, under the feet of the
  driver and the other children.
* The driver checks the space in ``/dev/shm`` first and backs every page at once
  (``posix_fallocate``), so a shortage is a clear error at construction, never a
  SIGBUS later in a worker or the driver.
* A child that will write pages all over a segment maps every page of it at once
  (:func:`map_every_page`), so that it takes no page fault per page as it goes.
* The driver unlinks it when done; a child that finds the driver gone unlinks it too
  (:func:`unlink_segment`: unlinking a removed name is harmless), so a driver killed
  with SIGKILL leaves no segment behind.

The program hand-off (:func:`spawn` in the driver, :func:`read_handoff` in the child):

* A child runs ``python -c ENTRY FD``. Its header (what it needs first: descriptors,
  segment names, layouts; cloudpickled, so classes defined in a script travel too) and
  its payload (the pickled program: env factories, a policy) are written in full to an
  unnamed, owner-only temporary file before the child starts; the child inherits the
  open file (offset 0) as descriptor ``FD``, unpickles the header and reads the rest.
* Not through a pipe: a program can be larger than a pipe holds (the bounds of an image
  observation space alone are ~70 KB for Pong), and a pipe write would then wait for
  the child's interpreter to start and read it, so children would start one after
  another instead of all at once.
* A child inherits only the descriptors named in ``pass_fds`` (under the same
  numbers), never the caller's ``__main__`` module, and gets ``sys.path`` as
  ``PYTHONPATH`` so that factories and policies from the caller's modules import
  (:func:`child_env`).

Stopping: closing its pipes is a child's stop signal (each protocol says which);
:func:`stop_processes` then waits for it and kills it if it does not exit.

What a child starts goes with it, and a child goes with its driver:

* **Its own process group.** Every child is the leader of a process group of its own
  (in the driver's session), and whatever it starts (a simulator's helper process, say)
  joins that group unless it leaves on purpose. A Ctrl-C at the terminal, sent to the
  terminal's foreground group, never reaches a child (the driver decides when children
  stop); a child ignores SIGINT as well from the first line it runs, before any import
  (:func:`spawn`), for a SIGINT sent to it alone.
* **Killed as a group, before it is reaped.** Whenever the driver finds a child exited
  (:func:`reap`, :func:`wait_exit`), stops it (:func:`stop_processes`) or kills it
  (:func:`kill`), it sends SIGKILL to the child's whole group first, so that nothing the
  child started outlives it. Only before the child is reaped: until then its pid, which
  is the group's id, cannot be given to another process, so the signal can reach no
  other group (a zombie leader still pins it).
* **The lifeline** (``lifeline.py``): a child notices its driver's death even inside a
  long call, and then ends itself and its group.
"""

from __future__ import annotations

import _posixshmem
import errno
import mmap
import os
import pickle
import resource
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from rlcollect.errors import CollectorError
from rlcollect.lifeline import Lifeline

__all__ = [
    "attach_segment",
    "batch_scheduling",
    "child_env",
    "create_segment",
    "describe_exit",
    "kill",
    "lend_pages",
    "map_every_page",
    "out_of_descriptors",
    "read_handoff",
    "reap",
    "release_mapping",
    "shm_free_bytes",
    "spawn",
    "stop_processes",
    "unlink_segment",
    "wait_exit",
]


def out_of_descriptors(exc: BaseException, doing: str) -> CollectorError | None:
    """The error to raise for ``exc`` when it is this process running out of file
    descriptors while ``doing`` (``"starting 8 workers"``, ``"restarting worker 1"``):
    it names the limit and the remedies; None for any other exception."""
    if not isinstance(exc, OSError) or exc.errno != errno.EMFILE:
        return None
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return CollectorError(
        f"ran out of file descriptors {doing} (this process may open {limit}; a worker "
        "process takes about 5 here): raise the limit (ulimit -n, or "
        "resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or put more envs in each "
        "worker (envs_per_worker)"
    )


_SINGLE_THREADED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux


# ---------------------------------------------------------------------- shared memory


def create_segment(prefix: str, size: int) -> tuple[str, mmap.mmap]:
    """Create an owner-only segment of ``size`` bytes named ``prefix`` + 96 random bits;
    returns its name and a mapping of it.

    Raises:
        CollectorError: ``/dev/shm`` has less than ``size`` bytes free (the message says
            how much is needed, how much is free, and the remedies).
    """
    free = shm_free_bytes()
    if free is not None and size > free:
        raise CollectorError(_no_space(size, free))
    name = prefix + secrets.token_hex(12)
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        _reserve(fd, size)
        return name, mmap.mmap(fd, size)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)


def shm_free_bytes() -> int | None:
    """Bytes free in ``/dev/shm`` for this user, or None where it cannot be read."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _reserve(fd: int, size: int) -> None:
    """Back every page of the segment now. A segment is sparse until written: without
    this, a shortage of ``/dev/shm`` (Docker's default is 64 MB) shows up later as a
    SIGBUS in whichever process first touches an unbacked page, with no error and no
    clean-up. Reserved here, it is ENOSPC, turned into a clear error."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # no reservation on this system: the space check above stands alone
        if exc.errno == errno.ENOSPC:
            raise CollectorError(_no_space(size, shm_free_bytes())) from exc
        raise


def _no_space(size: int, free: int | None) -> str:
    mib = 2**20
    has = "too little" if free is None else f"{free / mib:.1f} MiB"
    return (
        f"the shared-memory segment needs {size / mib:.1f} MiB, but {_SHM_DIR} has {has} "
        "free: give it more (in Docker: docker run --shm-size=2g ...), or use fewer envs, "
        "a smaller frames_per_batch or a smaller transition_chunk_size"
    )


def attach_segment(name: str, size: int) -> mmap.mmap:
    """Map the existing segment ``name`` (without a resource tracker).

    Raises:
        FileNotFoundError: the segment is gone (the driver has closed).
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later; the mmap module does not name it


def map_every_page(mapping: mmap.mmap) -> None:
    """Enter every page of ``mapping`` into this process's page tables now, writable,
    without touching what the pages hold (other processes may be writing them).

    Why: a process takes a page fault on its first access to each page of a shared
    mapping, even where another process mapped the page long ago. A worker of a pooled
    ring writes slots all over the ring as it is given them
    (``collector/batches/pooled.py``), so every slot it had not written before would
    cost it a fault per 4 KB page, for many batches, where a worker that writes only
    its own slots takes none after the first batch. Mapped at start, the ring costs
    each worker its page-table entries (8 bytes a page) and one pass over them (the
    measurements: ``docs/decisions/``)."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        # An older kernel: a read enters a page as well (a shared page needs no copy
        # on write, so the entry is writable where the mapping is).
        for offset in range(0, len(mapping), mmap.PAGESIZE):
            mapping[offset]


#: Mappings some of whose pages the caller may still read through batches lent to it
#: (``collector/batches/loans.py``), each with a test of whether a lent batch is alive.
_LENT: weakref.WeakKeyDictionary[mmap.mmap, Callable[[], bool]] = weakref.WeakKeyDictionary()


def lend_pages(mapping: mmap.mmap, alive: Callable[[], bool]) -> None:
    """Say that batches viewing ``mapping`` are handed out while ``alive()`` is true:
    :func:`release_mapping` then leaves its pages to be freed with the last view."""
    _LENT[mapping] = alive


def release_mapping(mapping: mmap.mmap) -> None:
    """Give a ring's memory back now, not at garbage collection: the pages go at once
    (``MADV_REMOVE``, which frees a shared segment's memory, unlinked or not), then the
    mapping itself unless numpy views of it are still held (they read zeros from here
    on). Where a batch the caller may still hold views the ring (:func:`lend_pages`),
    the pages stay, and go when the mapping does: with the last view of it. Only once
    nothing steps or serves any more: the transport's ``close`` after its workers
    stopped."""
    alive = _LENT.pop(mapping, None)
    try:
        if alive is None or not alive():
            mapping.madvise(mmap.MADV_REMOVE)
    except (AttributeError, OSError, ValueError):
        pass  # no MADV_REMOVE here, or pages page-locked by a GPU: freed when unmapped
    try:
        mapping.close()
    except BufferError:
        pass  # views still held (a stuck worker thread, a caller's reference): GC unmaps


def unlink_segment(name: str) -> None:
    """Remove segment ``name``; already gone is fine."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------- starting a child


def child_env(*, single_threaded: bool = False) -> dict[str, str]:
    """The environment of a child: this one's, ``sys.path`` as ``PYTHONPATH``, and with
    ``single_threaded`` one BLAS/OpenMP thread (an env step gains nothing from a thread
    pool, and a pool per worker oversubscribes the cores)."""
    env = dict(os.environ)
    if single_threaded:
        env.update(dict.fromkeys(_SINGLE_THREADED, "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


# A process group of its own, not a session: where the kernel schedules by session
# (autogroup), a session per child would make each one a scheduling group of its own,
# with a share of the CPU equal to the driver's whole session, and change how workers
# and the driver's inference thread share the cores (docs/decisions/). Python 3.10 has
# no process_group: setpgid in the child, before it runs anything of its own.
_OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)

# The first line every child runs, before any import: SIGINT ignored, which also drops
# one pending since the child was started (below), then let through again.
_IGNORE_SIGINT = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
)


def spawn(
    entry: str,
    header: Any,
    payload: bytes,
    *,
    pass_fds: Sequence[int],
    env: Mapping[str, str],
    lifeline: Lifeline,
) -> subprocess.Popen[bytes]:
    """Start ``python -c entry`` with ``header`` and ``payload`` handed off in a temporary
    file (written in full first: the caller never waits for the child to read it), as
    the leader of a process group of its own, SIGINT ignored, holding ``lifeline``."""
    with tempfile.TemporaryFile() as handed:
        handed.write(cloudpickle.dumps(header))
        handed.write(payload)
        handed.flush()
        handed.seek(0)  # the child inherits the open file, offset included
        fd = handed.fileno()
        # The child is in the driver's process group from its fork until it takes its
        # own, with SIGINT's default action (subprocess resets handlers): a Ctrl-C then
        # would kill it. Blocked here, SIGINT is blocked in the child too (the mask
        # goes through fork and exec), stays pending, and is dropped by its first line.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return subprocess.Popen(
                [sys.executable, "-c", _IGNORE_SIGINT + entry, str(fd)],
                stdin=subprocess.DEVNULL,
                pass_fds=(*pass_fds, fd, lifeline.read_fd),
                env={**env, **lifeline.child_env()},
                **_OWN_GROUP,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def read_handoff(fd: int | None = None) -> tuple[Any, bytes]:
    """In a child started by :func:`spawn`: its header (unpickled) and its payload, from
    the file it inherited, or from the file ``fd`` written the same way and handed to it
    later (``transports/first_worker.py``)."""
    with open(int(sys.argv[1]) if fd is None else fd, "rb") as handed:
        header = pickle.load(handed)
        return header, handed.read()


def batch_scheduling() -> None:
    """Mark this process a batch job (Linux ``SCHED_BATCH``): a worker woken by its
    response then does not preempt the driver's inference thread, which has other
    workers to wake, so a batch of wake-ups takes a fraction of the time it takes
    without it (``docs/decisions/``). Elsewhere, or if refused, the default policy is a
    little slower."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass  # refused (some sandboxes)


# ---------------------------------------------------------------------- stopping a child


def reap(proc: subprocess.Popen[bytes]) -> int | None:
    """``proc``'s exit code if it has exited (its group killed first, then reaped), else
    None: :meth:`subprocess.Popen.poll` for a child of :func:`spawn`."""
    if proc.returncode is not None or not _exited(proc):
        return proc.returncode
    kill(proc)  # what it started, while its pid still names its group
    return proc.wait()


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to ``proc``'s whole process group (it, and whatever it started), unless it
    was reaped already: its group id may then name another group."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (the leader a zombie), or a member changed its user


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """``proc``'s exit code once it exits within ``timeout`` s (reaped as by
    :func:`reap`), else None."""
    if _wait_exited(proc, timeout):
        return reap(proc)
    return None


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait up to ``timeout`` s in all for ``procs`` to exit (their pipes closed); kill
    each one's group (what it started, and it if it still runs), and wait up to
    ``timeout`` s more for each."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        _wait_exited(proc, max(0.0, deadline - time.monotonic()))
    for proc in procs:
        kill(proc)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass  # unkillable (stuck in the kernel); nothing more can be done


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` has exited, without reaping it (``WNOWAIT``)."""
    if proc.returncode is not None:
        return True
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, proc.pid, flags) is not None
    except ChildProcessError:
        return True  # reaped already (not through Popen): gone


def _wait_exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit, without reaping it; True once it
    has. A pidfd turns readable when its process exits (Linux 5.3); elsewhere, polls."""
    if _exited(proc):
        return True  # (and a reaped pid may name another process by now)
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(max(0, int(timeout * 1000)))
        finally:
            os.close(fd)
        return _exited(proc)
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not _exited(proc):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.05)
    return True


def describe_exit(code: int | None, pipe: str = "report pipe") -> str:
    """How a child ended, from its exit code (None: still running after ``pipe`` closed)."""
    if code is None:
        return f"still running after its {pipe} closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} (its stderr may say more)"


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or traced (``/proc`` state T or
    t); False where that cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")".
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"T", b"t")
