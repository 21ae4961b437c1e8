"""Transports: how workers run and how their messages reach the driver."""

from rlcollect.transports.base import (
    RequestEnd,
    ServerEnd,
    Transport,
    WorkerEnd,
    WorkerProgram,
    failure_from_exception,
)
from rlcollect.transports.layout import (
    Field,
    Key,
    RingLayout,
    Staging,
    request_rows,
    worker_views,
)
from rlcollect.transports.process_slots import ProcessSlotTransport
from rlcollect.transports.thread_queue import ThreadQueueTransport

__all__ = [
    "Field",
    "Key",
    "ProcessSlotTransport",
    "RequestEnd",
    "RingLayout",
    "ServerEnd",
    "Staging",
    "ThreadQueueTransport",
    "Transport",
    "WorkerEnd",
    "WorkerProgram",
    "failure_from_exception",
    "request_rows",
    "worker_views",
]
