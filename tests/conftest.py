"""Shared fixtures. Helpers live in helpers.py (this directory is on sys.path)."""

import pytest

TRANSPORTS = ["thread", "process_slots"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param
