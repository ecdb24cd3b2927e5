"""The default model (SmolLM2-135M) converted from its GGUF file once per test run.

Loading the default model converts its GGUF file into a safetensors directory under
`$KVTIER_CACHE_DIR/models` the first time: about a minute of CPU on a 2-core machine. Tests
that hand the engine or a command a private, empty cache directory (for the KV tier files
in it, or a demo that must start cold) get that conversion hard-linked into it first with
`seed_model_cache`, so the conversion runs once per test run however many caches there
are. The loader then finds a valid conversion and reuses it, as it would in a user's cache.
tests/engine/test_loader.py still converts into caches of its own where the conversion is
what it checks.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest
from kvtier.engine.loader import SMOLLM2_ALIAS, converted_model_dir, load_model

_OWNER_ONLY = 0o700


def shared_conversion(root: Path) -> Path:
    """The alias's conversion under `root` (made by the first caller; callers in other
    processes, such as pytest-xdist workers, wait on a lock and reuse it)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVTIER_CACHE_DIR", str(root / "cache"))
            target = converted_model_dir()
            if not target.is_dir():  # a conversion is renamed into place whole, or not at all
                load_model(SMOLLM2_ALIAS, "cpu", "float32")
    assert target.is_dir(), f"loading {SMOLLM2_ALIAS} did not convert it into {target}"
    return target


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def seed_model_cache(cache_dir: Path, conversion: Path) -> Path:
    """Put `conversion` (from `shared_conversion`) into `<cache_dir>/models`, its files hard
    links, the directories owner-only as the engine makes them. Returns `cache_dir`."""
    models = cache_dir / "models"
    for directory in (cache_dir, models):
        directory.mkdir(mode=_OWNER_ONLY, parents=True, exist_ok=True)
        os.chmod(directory, _OWNER_ONLY)
    target = models / conversion.name
    if not target.exists():
        shutil.copytree(conversion, target, copy_function=_link_or_copy)
    return cache_dir
