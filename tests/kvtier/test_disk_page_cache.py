"""A disk tier opened by a TierManager keeps none of its file in memory: a page-cache drop
(or the kernel's reclaim) leaves its records cold, so a cold restore reads them from disk."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from kvtier.cli.bench.diskread import resident_fraction
from manager_cases import chain, config, load, random_blocks, same_bytes, write

from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Tier


def _evict(path: Path) -> float | None:
    """Ask the kernel to drop `path`'s cached pages (as a dropped page cache would, for the
    pages it can drop); returns the share still cached."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return resident_fraction(path)


def test_an_opened_disk_tier_keeps_none_of_its_file_from_a_page_cache_drop(tmp_path,
                                                                           managers):
    """A page mapped into a process outlives a dropped page cache, and the kernel maps
    whole folios: a start that walked the index through LMDB's map kept a just-written
    file's records in memory, so a "cold" restore read them from memory. Nothing at start
    touches the file through the map now; lookups after the drop fault in tree pages only."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.float32)  # 32 KiB blocks, on LMDB's overflow pages
    metas = chain(layout, "cold", 48)
    data = random_blocks(layout, 48, seed=9)
    first = TierManager(layout, config(layout, tmp_path, gpu=48, host=48))
    write(first, metas, data)
    first.close()  # the host tier's blocks are written back to disk
    data_file = tmp_path / "disk" / "data.mdb"
    control = tmp_path / "control.bin"
    control.write_bytes(os.urandom(1 << 20))
    if (_evict(control) or 0.0) > 0.5:
        pytest.skip("this filesystem keeps evicted pages (tmpfs?)")
    assert (resident_fraction(data_file) or 0.0) > 0.5  # just written: cached
    m = TierManager(layout, config(layout, tmp_path, gpu=48, host=48))
    managers.append(m)
    time.sleep(0.5)  # a background walk at start, if there were one, would have run
    assert _evict(data_file) < 0.25
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.DISK] * 48
    num_ok, blocks = load(m, metas)
    assert num_ok == 48
    assert all(same_bytes(m.kv_cache[b.block_id], d) for b, d in zip(blocks, data))
