"""Fixtures shared by the tier-manager tests."""

import pytest

from kvtier.manager import TierManager


@pytest.fixture
def managers():
    """Managers made by a test, closed at its end even when it fails."""
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close()
