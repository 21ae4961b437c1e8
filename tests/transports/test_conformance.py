"""The conformance suite of rlcollect.testing, on every built-in transport."""

import pytest

from rlcollect.testing import CHECKS, check_transport
from rlcollect.transports import ProcessSlotTransport, ThreadQueueTransport

BUILT_IN = [ThreadQueueTransport, ProcessSlotTransport]


@pytest.mark.parametrize("make", BUILT_IN, ids=lambda t: t.__name__)
@pytest.mark.parametrize("check", list(CHECKS), ids=str)
def test_conformance(make, check):
    CHECKS[check](make)


def test_check_transport_names_the_failed_check():
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
        layout = counting_layout(1, 1, 1, 1)
        t.start(layout, counting_programs(layout))
        with pytest.raises(RuntimeError, match="serves one collector"):
            t.start(layout, counting_programs(layout))
        t.close()
