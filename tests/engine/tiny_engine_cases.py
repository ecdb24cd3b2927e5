"""A random tiny Llama engine in float32 on the CPU, with or without tiers, and the prompts
the disk-tier engine tests feed it."""

from __future__ import annotations

from pathlib import Path

from kvtier.engine import LLM

MODEL = "random:tiny-llama"
BS = 16


def engine(disk_dir: Path | None, **options: object) -> LLM:
    """An engine over a host tier and a disk tier in `disk_dir` (None: every tier off),
    asking the disk for every prefix; `options` override."""
    base: dict[str, object] = dict(model=MODEL, device="cpu", dtype="float32", block_size=BS,
                                   max_num_batched_tokens=128, restore_min_saving_s=0.0)
    if disk_dir is None:
        base.update(host_cache=False, disk_cache=False)
    else:
        base.update(disk_cache_dir=disk_dir, disk_cache_gb=0.25)
    base.update(options)
    return LLM(**base)


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids 3..255 (0..2 are special in the tiny config), a fixed pattern per seed."""
    return [3 + (seed * 7919 + i * 104729) % 253 for i in range(num_tokens)]
