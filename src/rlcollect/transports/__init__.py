"""Transports: how workers run and how their messages reach the driver."""

from rlcollect.transports.base import (
    RequestEnd,
    ServerEnd,
    Transport,
    WorkerEnd,
    WorkerProgram,
)
from rlcollect.transports.layout import Field, RingLayout
from rlcollect.transports.process_slots import ProcessSlotTransport
from rlcollect.transports.thread_queue import ThreadQueueTransport

__all__ = [
    "Field",
    "ProcessSlotTransport",
    "RequestEnd",
    "RingLayout",
    "ServerEnd",
    "ThreadQueueTransport",
    "Transport",
    "WorkerEnd",
    "WorkerProgram",
]
