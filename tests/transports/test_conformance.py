"""The conformance suite of rlcollect.testing, on every built-in transport."""

import pytest

from rlcollect.errors import CollectorError
from rlcollect.testing import CHECKS, _checks, _responder, check_transport
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport

BUILT_IN = [ThreadQueueTransport, ProcessSlotTransport]


@pytest.mark.parametrize("make", BUILT_IN, ids=lambda t: t.__name__)
@pytest.mark.parametrize("check", list(CHECKS), ids=str)
def test_conformance(make, check):
    CHECKS[check](make)


def test_check_transport_names_the_failed_check(monkeypatch):
    # The broken transport can only wait out the checks' deadline: a short one will do.
    monkeypatch.setattr(_responder, "_DEADLINE", 5.0)
    monkeypatch.setattr(_checks, "_DEADLINE", 5.0)

    class Broken(ThreadQueueTransport):
        def start(self, layout, programs):
            end = super().start(layout, programs)
            end.release = lambda worker, slot: None  # loses every credit
            return end

    with pytest.raises(AssertionError, match="transport check 'round_trip' failed"):
        check_transport(Broken)


def test_transports_serve_one_collector():
    from rlcollect.testing import counting_layout, counting_programs

    for make in BUILT_IN:
        t = make()
        layout = counting_layout(num_workers=1, columns=1, chunk_steps=1, slots=1)
        t.start(layout, counting_programs(layout))
        with pytest.raises(CollectorError, match="serves one collector"):
            t.start(layout, counting_programs(layout))
        t.close()


@pytest.mark.parametrize("make", BUILT_IN, ids=lambda t: t.__name__)
def test_restart_worker_outside_start_and_close_is_a_collector_error(make):
    from rlcollect.testing import counting_layout, counting_programs

    layout = counting_layout(num_workers=1, columns=1, chunk_steps=1, slots=1)
    transport = make()
    with pytest.raises(CollectorError, match=r"cannot restart worker 0: the \w+ was not started"):
        transport.restart_worker(0, counting_programs(layout)[0])
    transport.start(layout, counting_programs(layout))
    transport.close()
    with pytest.raises(CollectorError, match=r"cannot restart worker 0: the \w+ is closed"):
        transport.restart_worker(0, counting_programs(layout)[0])
