"""The weights board: every publish is whole or absent for a worker, and bounded.

Real shared memory and real OFD locks, between this process's descriptors and a real
child process that dies holding its lock.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from rlcollect.errors import InferenceError
from rlcollect.inference.board import WeightsBoard
from rlcollect.inference.config import WeightsLayout


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.full((4,), value)}


@pytest.fixture
def boards():
    layout = WeightsLayout.of(weights(0.0))
    driver = WeightsBoard.create(layout, 2, weights(0.0))
    worker = WeightsBoard.attach(driver.name, layout, 2)
    yield driver, worker, layout
    worker.close(unlink=False)
    driver.close(unlink=True)


def test_a_worker_takes_a_new_version_whole_and_only_when_it_changes(boards):
    driver, worker, _ = boards
    params = weights(-1.0)
    assert worker.refresh(1, params, -1, 1.0) == 0  # version 0: the driver's weights
    assert all(bool((t == 0.0).all()) for t in params.values())
    driver.publish(weights(7.0), 1, 1.0)
    params["w"].fill_(-1.0)
    assert worker.refresh(1, params, 1, 1.0) == 1  # already held: nothing copied
    assert bool((params["w"] == -1.0).all())
    assert worker.refresh(1, params, 0, 1.0) == 1
    assert all(bool((t == 7.0).all()) for t in params.values())


def test_publish_waits_for_a_copying_worker_and_gives_up_naming_it(boards):
    driver, worker, _ = boards
    assert worker._lock(1)  # worker 1 in the middle of a copy
    with pytest.raises(InferenceError, match="worker 1 has held the weights board"):
        driver.publish(weights(3.0), 1, 0.2)
    assert int(driver.header[0]) == 0, "a refused publish changed the version"
    params = weights(-1.0)
    worker._unlock(1)
    assert worker.refresh(1, params, -1, 1.0) == 0
    assert all(bool((t == 0.0).all()) for t in params.values()), "a refused publish wrote"
    driver.publish(weights(3.0), 1, 1.0)
    assert worker.refresh(0, params, 0, 1.0) == 1


def test_a_worker_waits_for_a_publish_in_progress_and_gives_up(boards):
    driver, worker, _ = boards
    assert driver._lock(0)  # the driver holds worker 0's lock: publishing
    driver.header[0] = 5
    with pytest.raises(InferenceError, match="the driver has held the weights board"):
        worker.refresh(0, weights(0.0), 0, 0.2)
    driver._unlock(0)


def test_a_dead_holders_lock_is_released(boards):
    driver, _, layout = boards
    # a worker process that takes its lock and dies holding it (SIGKILL)
    where = f"{driver.name!r}, WeightsLayout{layout.entries, layout.slot_bytes!r}, 2"
    code = textwrap.dedent(
        f"""
        import sys
        from rlcollect.inference.board import WeightsBoard
        from rlcollect.inference.config import WeightsLayout
        board = WeightsBoard.attach({where})
        assert board._lock(0)
        print("locked", flush=True)
        sys.stdin.read()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(InferenceError):
            driver.publish(weights(2.0), 1, 0.2)
        child.kill()
        child.wait(30)
        driver.publish(weights(2.0), 1, 5.0)  # the kernel released the dead one's lock
        assert int(driver.header[0]) == 1
    finally:
        child.kill()
        child.wait(30)
