"""Transport capabilities: the collector asks a transport what it can do through its class
attributes, never through its type, so a transport of one's own gets everything the
built-in process transport gets."""

import os
import threading

import pytest
from helpers import (
    CountingPolicy,
    check_counting_streams,
    collect,
    counting_collector,
    counting_envs,
    process_gone,
    shm_exists,
    wait_until,
)

from rlcollect import AsyncBatchedCollector
from rlcollect.errors import CollectorError
from rlcollect.testing import CountingEnv
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport, Transport


class Delegating(Transport):
    """A process transport that is not a ProcessSlotTransport: it hands everything to one."""

    pickles_programs = True
    supports_restart = True
    supports_request_channel = True

    def __init__(self):
        self.inner = ProcessSlotTransport()

    def start(self, layout, programs):
        return self.inner.start(layout, programs)

    def close(self):
        self.inner.close()

    def restart_worker(self, worker, program):
        self.inner.restart_worker(worker, program)

    def request_channel(self):
        return self.inner.request_channel()


class Minimal(Transport):
    def start(self, layout, programs):
        raise AssertionError("never started in these tests")

    def close(self):
        pass


def test_the_base_class_claims_nothing():
    transport = Minimal()
    assert not transport.pickles_programs
    assert not transport.supports_restart
    assert not transport.supports_request_channel
    with pytest.raises(CollectorError, match=r"Minimal .*request_channel"):
        transport.request_channel()


def test_built_in_transports_declare_what_they_do():
    assert ProcessSlotTransport.pickles_programs and ProcessSlotTransport.supports_request_channel
    assert not ThreadQueueTransport.pickles_programs
    assert not ThreadQueueTransport.supports_request_channel


def test_an_own_process_transport_gets_the_process_inference_backend():
    transport = Delegating()
    with counting_collector(
        transport, inference_backend="process", total_frames=320, frames_per_batch=32
    ) as c:
        assert c.server.pid != os.getpid()
        data = collect(c)
    assert data.batch_size[0] == 320
    check_counting_streams(data)
    inner = transport.inner
    wait_until(lambda: all(process_gone(p) for p in inner.pids), what="worker processes")
    wait_until(lambda: process_gone(c.server.pid), what="the inference process")
    assert not shm_exists(inner.shm_name)


def test_an_own_process_transport_gets_the_pickle_check_before_any_probe():
    lock = threading.Lock()
    built = []

    def make():
        with lock:
            built.append(1)
            return CountingEnv(0)

    fns = [make, *counting_envs(2)]
    with pytest.raises(TypeError, match=r"env_fns\[0\] cannot be pickled for a worker process"):
        AsyncBatchedCollector(
            fns, CountingPolicy(), frames_per_batch=8, transport=Delegating(), policy_device="cpu"
        )
    assert built == []  # refused before env 0 was built to probe it


def test_a_transport_without_a_request_channel_refuses_the_process_backend():
    with pytest.raises(ValueError, match="inference_backend='process' needs transport="):
        counting_collector(ThreadQueueTransport(), inference_backend="process")
