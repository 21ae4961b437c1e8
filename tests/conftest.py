"""Shared fixtures. Helpers live in helpers.py (this directory is on sys.path)."""

import pytest

TRANSPORTS = ["thread", "process_slots"]

# Under pytest-xdist (make unit), the modules whose tests take 10 to 60 s each (whole
# example scripts, benchmarks and doc pages in fresh processes) go first: the workers
# then end on short tests instead of one worker finishing a long one alone.
SLOW_FIRST = ("tests/test_examples.py", "tests/test_docs.py")


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only in an xdist worker process
        return
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in SLOW_FIRST)
