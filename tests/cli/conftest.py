"""Fixtures shared by the CLI and server tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvtier.engine.loader import load_model

from tests.model_cache import seed_model_cache


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, smollm2_conversion: Path):
    """SmolLM2 (float32, CPU) from a private cache dir holding the run's one conversion; one
    torch thread (on a small shared machine two spinning threads per process make each step
    far slower)."""
    cache = seed_model_cache(tmp_path_factory.mktemp("kvtier-cache"), smollm2_conversion)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIER_CACHE_DIR", str(cache))
        torch.set_num_threads(1)
        yield load_model("smollm2-135m", "cpu", "float32")
        torch.set_num_threads(threads)
