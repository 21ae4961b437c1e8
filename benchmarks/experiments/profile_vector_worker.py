"""Where a vector-env worker's time goes, seen from the env: an experiment, not a figure.

Runs ``benchmarks/atari_throughput.py``'s configuration with one worker whose vector env
is wrapped in :class:`TimedVectorEnv`, a ``gymnasium.vector.VectorWrapper`` (nothing of
rlcollect is patched: the collector sees an ordinary vector env). Per batch it times
``send`` and ``recv`` (the env's own time, as the worker sees it), the gap from a
``recv`` returning to the next ``send`` (the collector's: handling the result, the
request's round trip through the inference server, the actions back) and the gap from
a ``send`` to the next ``recv`` (what the worker does meanwhile: writing the finished
transitions); and, as ``*_queued``, how much of ``recv``, of the first gap and of the
second the thread that drives the env spent runnable but waiting for a core (Linux's
``/proc/thread-self/schedstat``): the share of a window lost to the env's own threads
on a host whose cores they all keep busy. Beside them: the server's phases and request latency
(``collector.stats()``; with ``inference_backend="worker"`` the time of each request
in the worker), the env alone and the hand loop of the same configuration, its env
wrapped the same way. A thread worker at each ``--switch-intervals`` value, then a
worker process with each of ``--backends``; the wrapper writes its running totals to a
file every 0.1 s, read at the start and the end of the timed window. The timers cost a few
microseconds per call: the figures are for finding the cost, not for quoting throughput
(``atari_throughput.py`` does that)::

    python benchmarks/experiments/profile_vector_worker.py --envs 64 --batch 32 \
        --threads 16 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import atari_throughput as at
from common import machine, make_atari_vector

STEPS = ("send", "recv", "recv_to_send", "send_to_recv")
# The same windows' time runnable but waiting for a core (Linux schedstat of the thread
# that drives the env): a thread that shares its core with the env's threads waits here.
QUEUED = tuple(f"{step}_queued" for step in ("recv", "recv_to_send", "send_to_recv"))


class TimedVectorEnv(gym.vector.VectorWrapper):
    """A vector env driven with ``send``/``recv``, with timers around both and the gap
    between a ``recv`` returning and the next ``send``; and the time the driving thread
    spent on a run queue in each of those windows (``QUEUED``; 0 off Linux)."""

    def __init__(self, env: gym.vector.VectorEnv) -> None:
        super().__init__(env)
        self.seconds: dict[str, float] = dict.fromkeys(STEPS + QUEUED, 0.0)
        self.batches = 0
        self._received_at: float | None = None
        self._sent_at: float | None = None
        self._schedstat: int | None = None  # the driving thread's, opened at its first call
        self._queued_at = 0

    def _queued(self) -> int:
        """Nanoseconds the calling thread has waited on a run queue (``schedstat``'s
        second field; a ``pread`` of about 2 us)."""
        if self._schedstat is None:
            try:
                self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                self._schedstat = -1
        if self._schedstat < 0:
            return 0
        return int(os.pread(self._schedstat, 128, 0).split()[1])

    def _charge_queued(self, window: str) -> None:
        now = self._queued()
        self.seconds[window] += (now - self._queued_at) / 1e9
        self._queued_at = now

    @property
    def batch_size(self) -> int:
        size: int = self.env.batch_size  # type: ignore[attr-defined]
        return size

    def send(self, actions: Any) -> None:
        t = time.perf_counter()
        if self._received_at is not None:
            self.seconds["recv_to_send"] += t - self._received_at
            self._received_at = None
            self._charge_queued("recv_to_send_queued")
        try:
            self.env.send(actions)  # type: ignore[attr-defined]
        finally:
            self._sent_at = time.perf_counter()
            self.seconds["send"] += self._sent_at - t
            self._queued_at = self._queued()

    def recv(self) -> Any:
        t = time.perf_counter()
        if self._sent_at is not None:
            self.seconds["send_to_recv"] += t - self._sent_at
            self._sent_at = None
            self._charge_queued("send_to_recv_queued")
        else:
            self._queued_at = self._queued()
        result = self.env.recv()  # type: ignore[attr-defined]
        self._received_at = time.perf_counter()
        self.seconds["recv"] += self._received_at - t
        self._charge_queued("recv_queued")
        self.batches += 1
        return result

    def close(self, **kwargs: Any) -> None:
        if self._schedstat is not None and self._schedstat >= 0:
            os.close(self._schedstat)
        self._schedstat = -1  # read as 0 from here on
        super().close(**kwargs)

    def totals(self) -> dict[str, Any]:
        return {"seconds": dict(self.seconds), "batches": self.batches}


class TimedAtariVector:
    """An env factory (picklable, for worker processes too): ``make_atari_vector``
    wrapped in :class:`TimedVectorEnv`, its totals written to
    ``<report_dir>/env-<pid>-<n>.json`` every 0.1 s until the env is closed."""

    def __init__(self, n: int, b: int, t: int, nice: int, report_dir: str) -> None:
        self.args = (n, b, t, nice)
        self.report_dir = report_dir

    def __call__(self) -> TimedVectorEnv:
        env = TimedVectorEnv(make_atari_vector(*self.args))
        path = Path(self.report_dir) / f"env-{os.getpid()}-{id(env)}.json"

        def report(ref: weakref.ref[TimedVectorEnv]) -> None:
            # A weak reference: the thread must not keep a dropped env alive.
            while (alive := ref()) is not None and not alive.closed:
                tmp = path.with_suffix(".tmp")
                try:
                    tmp.write_text(json.dumps(alive.totals()))
                    tmp.replace(path)  # readers never see a half-written file
                except OSError:  # the report directory is gone: the run is over
                    return
                del alive
                time.sleep(0.1)

        threading.Thread(
            target=report, args=(weakref.ref(env),), name="timer-report", daemon=True
        ).start()
        return env


def read_reports(report_dir: str) -> dict[str, Any]:
    """The wrapped envs' latest totals, summed."""
    seconds: collections.Counter[str] = collections.Counter()
    batches = 0
    for path in Path(report_dir).glob("env-*.json"):
        data = json.loads(path.read_text())
        seconds.update(data["seconds"])
        batches += data["batches"]
    return {"seconds": dict(seconds), "batches": batches}


class Marks:
    """The totals at the start and the end of a collector's timed window."""

    def __init__(self, report_dir: str) -> None:
        self.report_dir = report_dir
        self.at: dict[str, Any] = {}

    def __call__(self, when: str) -> None:
        time.sleep(0.15)  # one report more than the last batch
        self.at[when] = read_reports(self.report_dir)

    def per_batch(self) -> dict[str, float]:
        """Microseconds per env batch (per ``recv``) of each step within the window."""
        start, end = self.at["start"], self.at["end"]
        batches = max(end["batches"] - start["batches"], 1)
        return {
            k: 1e6 * (end["seconds"].get(k, 0.0) - start["seconds"].get(k, 0.0)) / batches
            for k in STEPS + QUEUED
        }


def profiled(
    args: argparse.Namespace, device: torch.device, transport: str, backend: str
) -> dict[str, Any]:
    # A worker may write its last report while the collector shuts down: leftovers
    # there are of no use, and must not fail the run.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as reports:
        n, b, t = at.vector_config(args, 1)
        marks = Marks(reports)
        factory = TimedAtariVector(n, b, t, args.env_nice, reports)
        result = at.collector(
            args,
            device,
            transport,
            1,
            one_worker=False,
            factory=factory,
            on_window=marks,
            backend=backend,
        )
    result["worker_us_per_batch"] = marks.per_batch()
    server_batches = result["fps"] * args.seconds / max(result["mean_batch_size"], 1e-9)
    result["server_us_per_batch"] = {
        k: 1e6 * v / max(server_batches, 1.0) for k, v in result["phase_seconds"].items()
    }
    return result


def hand_loop(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The hand loop, its vector env wrapped as the collector's is; timed by the window
    of ``at.hand_loop`` (its warm-up is added to the marks: read before and after)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as reports:
        n, b, t = at.vector_config(args, 1)
        marks = Marks(reports)
        factory = TimedAtariVector(n, b, t, args.env_nice, reports)
        result: dict[str, Any] = dict(at.hand_loop(args, device, 1, factory=factory))
        marks.at["start"] = {"seconds": {}, "batches": 0}
        marks("end")
    result["worker_us_per_batch"] = marks.per_batch()  # over warm-up and window
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument(
        "--switch-intervals", default="0.005,0.0005", help="thread-worker runs; '' for none"
    )
    p.add_argument("--backends", default="thread,worker", help="worker-process runs")
    p.add_argument("--rounds", type=int, default=1, help="every run this many times, in turn")
    p.add_argument("--policy", choices=["nature_cnn", "noop"], default="nature_cnn")
    p.add_argument("--env-nice", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.repeats = 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the collector's server thread runs a CPU policy
    report: dict[str, Any] = {"config": vars(args), "machine": machine()}
    keys = ("fps", "worker_us_per_batch", "server_us_per_batch", "request_latency_p50")

    def keep(name: str, result: dict[str, Any]) -> None:
        report.setdefault(name, []).append(result)
        shown = {k: result[k] for k in keys if k in result}
        print(name, json.dumps(shown, indent=1), flush=True)
        if args.out:  # after every run: a run stopped short keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            text = json.dumps(report, indent=1, default=str)
            (Path(args.out) / "profile_vector_worker.json").write_text(text)

    for _ in range(args.rounds):
        keep("env_only", at.env_only(args, 1))
        keep("hand_loop", hand_loop(args, device))
        for interval in [float(x) for x in args.switch_intervals.split(",") if x]:
            sys.setswitchinterval(interval)
            keep(f"thread-1w switch={interval}", profiled(args, device, "thread", "thread"))
        sys.setswitchinterval(0.005)
        for backend in [b for b in args.backends.split(",") if b]:
            keep(f"process_slots-1w {backend}", profiled(args, device, "process_slots", backend))


if __name__ == "__main__":
    main()
