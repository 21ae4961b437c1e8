"""A transport of your own: worker processes talking over ``multiprocessing.Pipe``.

rlcollect's two transports are threads with ``queue.SimpleQueue`` and processes with raw
``os.pipe`` doorbells. This one is built from the standard library's ``multiprocessing``
only, in the way a user would write one:

* each worker is a ``multiprocessing`` process (``spawn``: a fresh interpreter that
  imports numpy, gymnasium and the worker loop, never torch);
* the ring lives in a ``multiprocessing.sharedctypes.RawArray``, which the children
  inherit at start; its backing file is unlinked as soon as it is created, so no
  shared-memory name exists that could outlive the processes;
* each worker has two duplex ``Pipe`` connections: ``requests`` (positions out,
  "go" back when the actions are written) and ``chunks`` (full slots and failure
  reports out, "go" back when a slot is free again).

The script first proves the transport with rlcollect's conformance suite, the same one
the built-in transports pass, then collects CartPole with it::

    python examples/custom_transport.py [--frames 4096] [--envs 4]

The shared-memory protocol (who writes what, in what order, why it is safe):

* A worker writes the observations at position ``p`` of its part of the ring, then
  sends ``p`` on ``requests``. The server reads those cells only after it has received
  ``p``. Sending and receiving are a write and a read on a socket, which the kernel
  orders like a lock release and acquire: the server sees every byte written before
  the message. The server writes the actions at ``p``, then sends "go"; the worker
  reads them after receiving it. A worker's outstanding requests (at most
  ``layout.splits``) name cells no other one names, so no one else touches those cells
  meanwhile.
* A worker fills a whole slot, sends ``("chunk", slot)`` on ``chunks`` and does not
  touch that slot again until it receives a "go" on ``chunks``, which the driver sends
  once it has copied the slot out. ``chunks`` starts with one "go" per slot.
* Stopping: ``abort()`` sends "stop" on every connection, so a worker waiting on
  either one raises ``ChannelClosed`` and exits; if the driver dies instead, the
  worker's receive hits end-of-file, with the same effect. A worker that dies closes
  its connections, and the driver's next wait on ``chunks`` reports it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from rlcollect.errors import ChannelClosed, CollectorError, WorkerError, WorkerFailure
from rlcollect.testing import CHECKS, check_transport
from rlcollect.transports import (
    RingLayout,
    ServerEnd,
    Transport,
    WorkerEnd,
    WorkerProgram,
    failure_from_exception,
)

_GO, _STOP = "go", "stop"  # the driver's two messages to a worker
_JOIN_TIMEOUT = 2.0  # seconds close() gives workers to exit before it kills them

# --8<-- [start:worker_end]


class PipeWorkerEnd(WorkerEnd):
    """The worker's end: runs inside the worker process."""

    def __init__(
        self, index: int, buffers: dict[Any, np.ndarray], requests: Connection, chunks: Connection
    ) -> None:
        self.index = index
        self.buffers = buffers
        self._requests = requests
        self._chunks = chunks

    def request(self, position: int) -> None:
        _send(self._requests, position)

    def wait_response(self) -> None:
        _receive_go(self._requests)

    def hand_over(self, slot: int) -> None:
        _send(self._chunks, ("chunk", slot))

    def wait_slot(self) -> None:
        _receive_go(self._chunks)

    def report(self, failure: WorkerFailure) -> None:
        try:
            self._chunks.send(("failure", failure))
        except OSError:
            pass  # the driver is gone: nobody is left to tell


def _send(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except OSError as exc:
        raise ChannelClosed("the driver closed the transport") from exc


def _receive_go(conn: Connection) -> None:
    try:
        message = conn.recv()
    except (EOFError, OSError) as exc:  # the driver died, or closed its end
        raise ChannelClosed("the driver closed the transport") from exc
    if message != _GO:
        raise ChannelClosed("the driver stopped the transport")


def _worker_main(
    index: int,
    ring: Any,
    layout: RingLayout,
    program: bytes,
    requests: Connection,
    chunks: Connection,
) -> None:
    """A worker process: map the ring, unpickle the program, run it until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    views = layout.views(memoryview(ring))
    end = PipeWorkerEnd(index, {k: v[index] for k, v in views.items()}, requests, chunks)
    try:
        cloudpickle.loads(program)(end)
    except ChannelClosed:
        return  # stopped: the normal way out
    except BaseException as exc:
        end.report(failure_from_exception(index, exc))
        return
    end.report(failure_from_exception(index, RuntimeError("worker program returned")))


# --8<-- [end:worker_end]
# --8<-- [start:server_end]


class PipeServerEnd(ServerEnd):
    """The driver's end. The inference thread uses ``requests`` (under one lock), the
    consuming thread ``chunks`` (under another); ``abort`` and ``close`` take both."""

    def __init__(
        self,
        buffers: dict[Any, np.ndarray],
        requests: list[Connection],
        chunks: list[Connection],
        processes: list[Any],
    ) -> None:
        self.buffers = buffers
        self._requests = requests
        self._chunks = chunks
        self._processes = processes
        self._live = set(range(len(requests)))  # workers whose requests pipe is open
        self._request_lock = threading.Lock()
        self._chunk_lock = threading.Lock()
        # Readable once aborted, and never read: it wakes every wait, then and later.
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._aborted = False
        self._failure: WorkerError | None = None

    # inference thread ------------------------------------------------------------------

    def wait_requests(self, timeout: float) -> list[tuple[int, int]]:
        with self._request_lock:
            conns = {self._requests[w]: w for w in self._live}
            ready = self._wait(list(conns), timeout)
            out = []
            for conn in ready:
                try:
                    while conn.poll():
                        out.append((conns[conn], conn.recv()))
                except (EOFError, OSError):  # that worker is gone; wait_chunks says why
                    self._live.discard(conns[conn])
            return out

    def respond(self, workers: Sequence[int]) -> None:
        with self._request_lock:
            for w in workers:
                self._send_go(self._requests[w])

    # consuming thread ------------------------------------------------------------------

    def wait_chunks(self, timeout: float) -> list[tuple[int, int]]:
        with self._chunk_lock:
            if self._failure is not None:
                raise self._failure
            conns = {conn: w for w, conn in enumerate(self._chunks)}
            out = []
            for conn in self._wait(list(conns), timeout):
                worker = conns[conn]
                try:
                    while conn.poll():
                        kind, value = conn.recv()
                        if kind == "failure":
                            self._failure = WorkerError.from_failure(value)
                            raise self._failure
                        out.append((worker, value))
                except (EOFError, OSError):  # end-of-file, or reset: the worker is gone
                    self._failure = self._died(worker)
                    raise self._failure from None
            return out

    def release(self, worker: int, slot: int) -> None:
        with self._chunk_lock:
            self._send_go(self._chunks[worker])

    # any thread ------------------------------------------------------------------------

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._wake_w.send(_STOP)  # first: a wait holding a lock returns and frees it
        with self._request_lock, self._chunk_lock:
            for conn in (*self._requests, *self._chunks):
                try:
                    conn.send(_STOP)
                except OSError:
                    pass  # that worker is gone already

    def close_connections(self) -> None:
        """Close the driver's connections; only after abort()."""
        with self._request_lock, self._chunk_lock:
            for conn in (*self._requests, *self._chunks, self._wake_r, self._wake_w):
                conn.close()

    # helpers ---------------------------------------------------------------------------

    def _wait(self, conns: list[Connection], timeout: float) -> list[Any]:
        if self._aborted:
            raise ChannelClosed("transport aborted")
        ready = wait([*conns, self._wake_r], timeout)
        if self._wake_r in ready:
            raise ChannelClosed("transport aborted")
        return ready

    def _send_go(self, conn: Connection) -> None:
        if self._aborted:
            return
        try:
            conn.send(_GO)
        except OSError:
            pass  # that worker is gone; wait_chunks reports it

    def _died(self, worker: int) -> WorkerError:
        process = self._processes[worker]
        process.join(_JOIN_TIMEOUT)
        code = process.exitcode
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return WorkerError(
            f"worker {worker} (pid {process.pid}) died without reporting an error: {how}",
            worker_index=worker,
        )


# --8<-- [end:server_end]
# --8<-- [start:transport]


class PipeTransport(Transport):
    """Worker processes (``spawn``), the ring in a ``RawArray``, messages on ``Pipe``s."""

    # Programs travel pickled: the collector checks every env factory with cloudpickle
    # before anything starts.
    pickles_programs = True

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._server: PipeServerEnd | None = None
        self._processes: list[Any] = []
        self._started = False
        self._closed = False

    def start(self, layout: RingLayout, programs: Sequence[WorkerProgram]) -> ServerEnd:
        if self._started:
            raise CollectorError("a PipeTransport serves one collector; create a new one")
        if len(programs) != layout.num_workers:
            raise ValueError(f"{len(programs)} programs for {layout.num_workers} workers")
        self._started = True
        payloads = []
        for i, program in enumerate(programs):
            try:  # cloudpickle: env factories may be lambdas or defined in __main__
                payloads.append(cloudpickle.dumps(program))
            except Exception as exc:
                raise TypeError(f"worker {i}'s program cannot be pickled: {exc}") from exc

        ring = self._ctx.RawArray("B", layout.nbytes)  # zeroed shared memory
        pipes = [(self._ctx.Pipe(), self._ctx.Pipe()) for _ in programs]
        self._server = PipeServerEnd(
            layout.views(memoryview(ring)),
            requests=[requests[0] for requests, _ in pipes],
            chunks=[chunks[0] for _, chunks in pipes],
            processes=self._processes,
        )
        for _, (chunks_driver, _) in pipes:
            for _ in range(layout.slots):
                chunks_driver.send(_GO)  # the ring starts with every slot free
        try:
            for i, (payload, (requests, chunks)) in enumerate(zip(payloads, pipes, strict=True)):
                process = self._ctx.Process(
                    target=_worker_main,
                    args=(i, ring, layout, payload, requests[1], chunks[1]),
                    name=f"pipe-worker-{i}",
                    daemon=True,  # killed at interpreter exit if still running
                )
                process.start()
                self._processes.append(process)
        except BaseException:
            self.close()
            raise
        finally:
            # The driver keeps only its own ends, so that a worker's death shows up as
            # end-of-file on them.
            for requests, chunks in pipes:
                requests[1].close()
                chunks[1].close()
        return self._server

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.abort()
        deadline = time.monotonic() + _JOIN_TIMEOUT
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()  # stuck in an env: SIGKILL, which cannot be ignored
                process.join(_JOIN_TIMEOUT)
        if self._server is not None:
            self._server.close_connections()


# --8<-- [end:transport]
# --8<-- [start:use]


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def collect(frames: int, envs: int) -> None:
    """Collect CartPole with a PipeTransport and a small sampling policy."""
    # torch, which the collector needs, is imported here and not at the top: spawned
    # workers import this file to find _worker_main, and they need no torch.
    import torch

    from rlcollect import AsyncBatchedCollector

    class Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)
            )

        def forward(self, obs: torch.Tensor) -> dict[str, torch.Tensor]:
            dist = torch.distributions.Categorical(logits=self.net(obs))
            action = dist.sample()
            return {"action": action, "log_prob": dist.log_prob(action)}

    collected, episodes, envs_seen = 0, 0, set()
    with AsyncBatchedCollector(
        [make_cartpole] * envs,
        Policy(),
        frames_per_batch=512,
        total_frames=frames,
        transport=PipeTransport(),
        policy_device="cpu",
    ) as collector:
        for batch in collector:
            collected += batch.numel()
            episodes += int(batch["next", "done"].sum())
            envs_seen.update(batch["env_index"].tolist())
        stats = collector.stats()
    print(
        f"collected {collected} frames in {stats['batches']} batches from envs "
        f"{sorted(envs_seen)}; {episodes} episodes ended"
    )
    print(
        f"{stats['frames_per_second']:.0f} frames/s, worker start-up included; "
        f"mean inference batch {stats['server']['mean_batch_size']:.2f} envs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4096)
    parser.add_argument("--envs", type=int, default=4)
    args = parser.parse_args()

    t0 = time.perf_counter()
    check_transport(PipeTransport)  # raises AssertionError naming the failed check
    print(
        f"conformance: all {len(CHECKS)} checks passed ({', '.join(CHECKS)}) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    collect(args.frames, args.envs)


if __name__ == "__main__":
    main()
# --8<-- [end:use]
