"""Test-suite wide hooks: tests marked `@pytest.mark.gpu` are skipped without CUDA, and
tests marked `@pytest.mark.slow` are run first."""

import pytest
import torch


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


# Real Redis servers for the remote-tier tests (skipped where redis-server is missing).
from tests.redis_servers import (  # noqa: E402, F401
    _session_redis,
    redis_cluster,
    redis_factory,
    redis_server,
)
