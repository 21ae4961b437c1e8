"""A collector's lifecycle (rlcollect/collector/lifecycle.py): one stage at a time, the
moves it allows, and one table of refusals."""

import pytest

from rlcollect.collector.lifecycle import Lifecycle, Stage
from rlcollect.errors import CollectorError


def test_a_collector_starts_opens_goes_to_the_background_and_closes_once():
    life = Lifecycle()
    assert life.stage is Stage.STARTING and life.closed
    assert life.move(Stage.OPEN) is Stage.STARTING and not life.closed
    life.enter("start", Stage.BACKGROUND)
    assert life.stage is Stage.BACKGROUND
    assert life.move(Stage.CLOSED) is Stage.BACKGROUND
    assert life.move(Stage.CLOSED) is Stage.CLOSED  # idempotent: the caller sees it was closed
    assert life.closed


def test_a_collector_never_moves_back():
    life = Lifecycle()
    life.move(Stage.OPEN)
    life.move(Stage.CLOSED)
    with pytest.raises(RuntimeError, match="cannot move from CLOSED to OPEN"):
        life.move(Stage.OPEN)


@pytest.mark.parametrize(
    ("stage", "action", "message"),
    [
        (Stage.BACKGROUND, "iterate", "collecting in the background"),
        (Stage.BACKGROUND, "start", "already collecting in the background"),
        (Stage.CLOSED, "start", "the collector is shut down"),
        (Stage.CLOSED, "pause", "the collector is shut down"),
        (Stage.CLOSED, "update", "the collector is shut down"),
        (Stage.STARTING, "update", "the collector is shut down"),
    ],
)
def test_each_stage_refuses_what_it_cannot_do(stage, action, message):
    life = Lifecycle()
    for step in {
        Stage.STARTING: [],
        Stage.BACKGROUND: [Stage.OPEN, Stage.BACKGROUND],
        Stage.CLOSED: [Stage.CLOSED],
    }[stage]:
        life.move(step)
    with pytest.raises(CollectorError, match=message):
        life.refuse(action)


def test_an_open_collector_refuses_nothing():
    life = Lifecycle()
    life.move(Stage.OPEN)
    for action in ("iterate", "start", "pause", "update"):
        life.refuse(action)


def test_start_after_shutdown_is_refused_without_moving():
    life = Lifecycle()
    life.move(Stage.OPEN)
    life.move(Stage.CLOSED)
    with pytest.raises(CollectorError, match="shut down"):
        life.enter("start", Stage.BACKGROUND)
    assert life.stage is Stage.CLOSED
