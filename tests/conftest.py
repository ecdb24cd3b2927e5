"""Test-suite wide hooks: tests marked `@pytest.mark.gpu` are skipped without CUDA, and
tests marked `@pytest.mark.slow` are run first."""

import os
from pathlib import Path

import pytest
import torch

from tests.model_cache import shared_conversion


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked slow run first: pytest-xdist (`make test` runs it) hands tests out in
    # this order, so the longest start at once instead of leaving one worker busy at the end.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's conversion, made once per test run (tests/model_cache.py). Under
    pytest-xdist every worker's base directory sits in the run's one shared directory."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return shared_conversion(root / "smollm2-conversion")


# Real Redis servers for the remote-tier tests (skipped where redis-server is missing).
from tests.redis_servers import (  # noqa: E402, F401
    _session_redis,
    redis_cluster,
    redis_factory,
    redis_server,
)
