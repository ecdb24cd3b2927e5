"""Reading ahead into the host tier (`TierManager.prefetch`) over a real LMDB tier: blocks
held below land as clean cached host blocks with their bytes, a later load takes them from
the host, the reads in flight stay within their share of the host slots, and blocks the
host holds, nobody holds, or that are being read already are not read again."""

from __future__ import annotations

import time

import pytest
from manager_cases import (
    chain,
    check_idle,
    evict_gpu,
    load,
    random_blocks,
    same_bytes,
    small_manager,
    write,
)

from kvtier.load_path import PREFETCH_SHARE
from kvtier.stats import Direction


def on_disk_only(m, name: str, num_blocks: int, seed: int):
    """`num_blocks` blocks written to disk, then dropped from the GPU and the host."""
    metas, data = chain(m.layout, name, num_blocks), random_blocks(m.layout, num_blocks, seed)
    write(m, metas, data)
    evict_gpu(m)  # flushed to disk on the way
    for meta in metas:
        m.host.remove(meta.block_hash)
    return metas, data


def wait_for_prefetches(m) -> None:
    deadline = time.monotonic() + 30
    while m.load_path.prefetching and time.monotonic() < deadline:
        m.poll()
        time.sleep(0.005)
    assert not m.load_path.prefetching


@pytest.mark.timeout(120)
def test_prefetched_blocks_land_clean_on_the_host_and_a_load_takes_them_there(tmp_path,
                                                                           managers):
    m = small_manager(managers, tmp_path, gpu=16, host=16, io_threads=2)
    metas, data = on_disk_only(m, "doc", 2, seed=1)
    assert not any(m.host.contains(meta.block_hash) for meta in metas)
    assert m.prefetch(metas) == []  # both started
    wait_for_prefetches(m)
    for meta, block in zip(metas, data):
        slot = m.host.lookup(meta.block_hash)
        assert slot is not None and not m.host.is_dirty(slot)  # on disk already
        assert same_bytes(m.host.slot_tensor(slot), block)
    read = m.stats(lower_tiers=False).transfers[Direction.DISK_TO_HOST].num_bytes
    assert read == 2 * m.layout.bytes_per_block
    num_loaded, blocks = load(m, metas)
    assert num_loaded == 2
    for block, expected in zip(blocks, data):
        assert same_bytes(m.kv_cache[block.block_id], expected)
    # The load read nothing more from disk: its bytes came from the host.
    assert m.stats(lower_tiers=False).transfers[Direction.DISK_TO_HOST].num_bytes == read
    m.free(blocks)
    check_idle(m)


@pytest.mark.timeout(120)
def test_prefetch_stays_within_its_share_and_reads_each_block_once(tmp_path, managers,
                                                                   release):
    m = small_manager(managers, tmp_path, gpu=32, host=16, io_threads=2)
    metas, _ = on_disk_only(m, "doc", 6, seed=2)
    strangers = chain(m.layout, "never-written", 2)
    held = metas[:1]
    num_loaded, blocks = load(m, held)  # block 0 back on the host (and the GPU)
    m.free(blocks)
    evict_gpu(m)
    assert m.host.contains(held[0].block_hash)
    # The disk's reads wait until released: what is in flight stays in flight.
    get = m.disk.get_many_into
    m.disk.get_many_into = lambda *args: (release.wait(), get(*args))[1]
    share = max(1, int(16 * PREFETCH_SHARE))  # 2 of 16 slots
    later = m.prefetch(metas + strangers)
    # Block 0 is on the host, the strangers nowhere: of the five others, two start.
    assert len(m.load_path.prefetching) == share and m.prefetch_room == 0
    assert later == metas[1 + share:]
    assert m.prefetch(metas) == metas[1 + share:]  # nothing more while they are in flight
    release.set()
    wait_for_prefetches(m)
    assert [m.host.contains(meta.block_hash) for meta in metas] == \
        [True] * (1 + share) + [False] * (6 - 1 - share)
    rest = m.prefetch(later)  # room again: two more start
    assert rest == later[share:]
    wait_for_prefetches(m)
    assert m.prefetch(rest) == []
    wait_for_prefetches(m)
    assert all(m.host.contains(meta.block_hash) for meta in metas)
    check_idle(m)


def test_without_a_host_tier_nothing_is_prefetched(tmp_path, managers):
    m = small_manager(managers, tmp_path, gpu=16, host=0)  # a staging slab only
    metas = chain(m.layout, "doc", 2)
    write(m, metas, random_blocks(m.layout, 2, seed=3))
    evict_gpu(m)
    assert m.prefetch(metas) == [] and m.prefetch_room == 0
    check_idle(m)
