"""Fixtures shared by the tier-manager tests."""

import threading

import pytest

from kvtier.manager import TierManager


@pytest.fixture
def managers():
    """Managers made by a test, closed at its end even when it fails."""
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close()


@pytest.fixture
def release():
    """The event a held disk call waits for. Requested after `managers`, it is set first at
    teardown, so a failing test cannot leave close() waiting on a held call."""
    event = threading.Event()
    yield event
    event.set()
