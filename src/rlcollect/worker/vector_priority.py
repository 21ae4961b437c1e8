"""How the thread driving a worker's vector envs is scheduled (Linux).

A worker process runs as ``SCHED_BATCH``, and so do the threads of its vector envs;
:func:`schedule_as_the_envs_driver` moves the thread that drives them (the vector
loop's) back to the normal policy and, where it also runs the policy beside an env
driven with send/recv, to a lower niceness (:data:`DRIVER_NICE`). Elsewhere it does
nothing. Each step is best effort: refused, the thread keeps what it had, which works,
only slower.

This module imports no torch: it runs in worker processes.
"""

from __future__ import annotations

import os
import threading

__all__ = ["DRIVER_NICE", "schedule_as_the_envs_driver"]

# The niceness the thread driving a vector env through send/recv asks for when it also
# runs the policy: weight 9548 against its env threads' 1024 (nice 0). See
# schedule_as_the_envs_driver.
DRIVER_NICE = -10


def schedule_as_the_envs_driver(*, raise_priority: bool) -> None:
    """Put this thread back on the normal scheduling policy if it runs as ``SCHED_BATCH``,
    and, where it runs the policy itself beside an env driven with send/recv
    (``raise_priority``), ask for ``DRIVER_NICE``.

    Worker processes run as ``SCHED_BATCH`` (``transports/process_slots.py``: a woken
    worker does not preempt the driver), and a vector env's threads, started after,
    inherit it. This thread is what keeps those threads fed: when its actions arrive
    with every core stepping sub-envs, as a batch task it would wait for one of them to
    yield before it could ``send``, and the sub-envs whose actions it holds would idle
    meanwhile. On the normal policy it preempts them on waking; they stay batch tasks.

    That is not enough where the policy runs in this worker (``inference_backend=
    "worker"``): the thread then also runs each forward and writes every transition,
    and is busy about as much of the time as an env thread. The fair scheduler then no
    longer counts it owed time when its result is ready, and it waits for a core on
    each ``recv`` far longer than the thread of a hand-written loop, asleep most of the
    time, does. A lower niceness restores the preemption on waking: nice -5 shortened
    that wait, nice -10 took most of it away and with it most of the collector's gap to
    a hand-written loop (the measurements: ``docs/tuning.md``). Served by a server, the
    thread does little besides ``send`` and ``recv``, and raising it showed no gain.
    Only this thread is raised: the env's threads keep their niceness, so they still
    share the cores fairly with other programs, and this one takes no more than its own
    work (it sleeps in ``recv``).

    Lowering a niceness needs ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` of ``20 - nice``
    or more. Where ``DRIVER_NICE`` is refused, the thread takes the lowest niceness its
    ``RLIMIT_NICE`` allows, if that is below its own; otherwise it keeps its own, which
    works, only slower.
    """
    get, set_ = getattr(os, "sched_getscheduler", None), getattr(os, "sched_setscheduler", None)
    batch = getattr(os, "SCHED_BATCH", None)
    if get is None or set_ is None or batch is None:
        return  # not Linux: nothing was changed
    try:
        if get(0) != batch:
            return  # not a worker process (worker threads share the driver's policy)
        set_(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return  # refused (some sandboxes): the batch policy works, only slower
    if raise_priority:
        _lower_niceness(DRIVER_NICE)


def _lower_niceness(wanted: int) -> None:
    """Set this thread's niceness (on Linux a thread's own: not the env's threads) to
    ``wanted``, or, where that is refused, to the lowest ``RLIMIT_NICE`` allows; never
    higher than the thread's own."""
    import resource  # here: only Linux comes this far, and Windows has no such module

    me = threading.get_native_id()
    own = os.getpriority(os.PRIO_PROCESS, me)
    if own <= wanted:
        return  # started lower already (a user's `nice -n -15`): never raised the other way
    try:
        os.setpriority(os.PRIO_PROCESS, me, wanted)
        return
    except OSError:
        pass  # neither CAP_SYS_NICE nor an RLIMIT_NICE of 20 - wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    lowest = 20 - soft  # what the limit allows; RLIM_INFINITY would have allowed wanted
    if wanted < lowest < own:
        try:
            os.setpriority(os.PRIO_PROCESS, me, lowest)
        except OSError:
            pass  # refused after all (a security module): the thread keeps its own
