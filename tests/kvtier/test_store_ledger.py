"""Where computed blocks go on their way to the disk tier when the host tier is small:
placement hints, deferred blocks held on the GPU, gaps in a lookup, the ledger and the
bounded flush. Scenarios on tiny capacities over a real LMDB tier."""

from __future__ import annotations

import threading
import time

import pytest
from manager_cases import (
    chain,
    check_idle,
    evict_gpu,
    held_before,
    load,
    random_blocks,
    same_bytes,
    small_manager,
)

from kvtier import stores as stores_module
from kvtier.stats import Tier
from kvtier.store_ledger import SkipReason


def compute(m, metas, data, load_ranks=None):
    """Blocks computed into fresh GPU blocks, cached with their hints, freed (as a finished
    request frees them); the stores start at once."""
    blocks = m.allocate(len(metas))
    assert blocks is not None
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id] = block_data
    m.cache_full_blocks(blocks, metas, load_ranks)
    m.submit_stores()
    m.free(blocks)
    m.poll()  # the copies landed (on the CPU at once)
    return blocks


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("share", "read_first", "taken"), [
    (0, False, 8), (0, True, 8),
    # Reads from below wanted within the hold: the whole reserve is left to them.
    (0.25, True, 6), (0.5, True, 4),
    # No read yet (a run of fresh prompts): an eighth of the reserve, one slot at least.
    (0.25, False, 7), (0.5, False, 7)])
def test_write_throughs_leave_the_read_reserve_to_reads(tmp_path, managers, release,
                                                       monkeypatch, share, read_first, taken):
    monkeypatch.setattr(stores_module, "READ_RESERVE_HOLD_S", 60.0)  # no lapse mid-test
    # 8 host slots, a disk that takes nothing yet: the stores get what the reserve leaves.
    m = small_manager(managers, tmp_path, gpu=16, host=8, io_threads=2,
                      read_reserve_share=share)
    if read_first:
        read_one_block_from_disk(m)
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas, data = chain(m.layout, "doc", 8), random_blocks(m.layout, 8, seed=2)
    compute(m, metas, data)
    assert sum(m.host.contains(meta.block_hash) for meta in metas) == taken
    assert m.stores.num_deferred == 8 - taken
    release.set()
    assert m.flush().num_written == 8  # the deferred ones follow once slots come clean
    check_idle(m)


@pytest.mark.timeout(120)
def test_the_read_reserve_lapses_after_its_hold(tmp_path, managers, release, monkeypatch):
    monkeypatch.setattr(stores_module, "READ_RESERVE_HOLD_S", 0.2)
    m = small_manager(managers, tmp_path, gpu=16, host=8, io_threads=2,
                      read_reserve_share=0.5)
    read_one_block_from_disk(m)
    time.sleep(0.3)  # no read since: the stores may take all but one slot again
    m.poll()
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas, data = chain(m.layout, "doc", 8), random_blocks(m.layout, 8, seed=2)
    compute(m, metas, data)
    assert sum(m.host.contains(meta.block_hash) for meta in metas) == 7
    release.set()
    assert m.flush().num_written == 8
    check_idle(m)


def read_one_block_from_disk(m) -> None:
    """A block written to disk, dropped from the GPU and the host, then loaded back: a
    read from the tier below, as a restore makes."""
    metas, data = chain(m.layout, "read", 1), random_blocks(m.layout, 1, seed=9)
    compute(m, metas, data)
    evict_gpu(m)  # flushed to disk on the way
    assert m.host.remove(metas[0].block_hash)
    num_loaded, blocks = load(m, metas)
    assert num_loaded == 1 and same_bytes(m.kv_cache[blocks[0].block_id], data[0])
    m.free(blocks)


@pytest.mark.timeout(120)
def test_blocks_a_restore_will_load_take_the_host_slots_first(tmp_path, managers, release):
    m = small_manager(managers, tmp_path, gpu=16, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    # The disk takes nothing for now.
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas, data = chain(layout, "doc", 6), random_blocks(layout, 6, seed=1)
    # The last two blocks are past the expected meeting point of a later restore's fronts.
    compute(m, metas, data, load_ranks=[None] * 4 + [4, 5])
    assert [m.host.contains(meta.block_hash) for meta in metas] == [False] * 4 + [True] * 2
    # The head waits, deferred, still held on the GPU (no silent drop).
    stores = m.stats().stores
    assert stores.offered == 6 and stores.pending == 6 and stores.lost == 0
    assert m.stores.num_deferred == 4 and m.stores.num_held == 4
    release.set()
    report = m.flush()
    assert report.num_unwritten == 0 and report.num_written == 6
    assert m.disk.contains([meta.block_hash for meta in metas]) == [True] * 6
    stores = m.stats().stores
    assert (stores.written, stores.pending, stores.num_skipped, stores.lost) == (6, 0, 0, 0)
    check_idle(m)


@pytest.mark.timeout(120)
def test_the_deepest_blocks_of_a_tail_reach_the_disk_first(tmp_path, managers, release):
    """A restore loads a stored tail from the prompt's end backward: when the disk cannot
    take every block, the ones it gets are the deepest, not those right past the meeting
    point that came first."""
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas = chain(layout, "doc", 6)
    # The whole prompt past the meeting point, ranked by position.
    compute(m, metas, random_blocks(layout, 6, seed=4), load_ranks=list(range(6)))
    # The two host slots went to the last two blocks; the four before wait on the GPU.
    assert [m.host.contains(meta.block_hash) for meta in metas] == [False] * 4 + [True] * 2
    assert m.stores.num_held == 4
    # The GPU needs two of them back: the shallowest give theirs up.
    taken = m.allocate(6)
    assert taken is not None and m.stores.num_held == 2
    assert m.stats().stores.skipped[SkipReason.GPU_REUSED.value] == 2
    m.free(taken)
    release.set()
    m.flush()
    assert m.disk.contains([meta.block_hash for meta in metas]) == [False] * 2 + [True] * 4
    stores = m.stats().stores
    assert stores.lost == 0 and stores.written == 4
    check_idle(m)


@pytest.mark.timeout(120)
def test_load_ranks_must_name_each_block(tmp_path, managers):
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2)
    metas = chain(m.layout, "doc", 2)
    blocks = m.allocate(2)
    with pytest.raises(ValueError, match="load ranks"):
        m.cache_full_blocks(blocks, metas, [0])
    with pytest.raises(ValueError, match="None or >= 0"):
        m.cache_full_blocks(blocks, metas, [0, -1])
    m.free(blocks)
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_short_pool_evicts_stored_blocks_before_deferred_ones(tmp_path, managers, release):
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    stored = chain(layout, "stored", 2)
    compute(m, stored, random_blocks(layout, 2, seed=2))
    m.flush()  # on disk and on the host; cached on the GPU, free
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    new, new_data = chain(layout, "new", 4), random_blocks(layout, 4, seed=3)
    compute(m, new, new_data, load_ranks=[None, None, 2, 3])
    # Two of the new blocks wait for a slot; the pool has 8 - 2 held = 6 to give.
    assert m.stores.num_held == 2 and m.pool.num_free_blocks == 6
    # Taking all 6 evicts the stored blocks (and the copied ones): not one deferred.
    taken = m.allocate(6)
    assert taken is not None and m.stores.num_held == 2
    assert m.stats().stores.skipped[SkipReason.GPU_REUSED.value] == 0
    assert m.pool.get_cached_block(stored[0].block_hash) is None
    # One more: the oldest deferred block gives its block up, and is counted.
    more = m.allocate(1)
    assert more is not None and m.stores.num_held == 1
    assert m.stats().stores.skipped[SkipReason.GPU_REUSED.value] == 1
    m.free(taken + more)
    release.set()
    m.flush()
    assert m.disk.contains([meta.block_hash for meta in new]) == [False, True, True, True]
    stores = m.stats().stores
    assert stores.lost == 0 and stores.pending == 0
    assert stores.written + stores.num_skipped == stores.offered == 6
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_short_pool_releases_deferred_blocks_that_come_free(tmp_path, managers, release):
    """A deferred block that a request also holds (a prefix hit) would not come free: a short
    allocation releases another deferred block instead, and gets its blocks."""
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas = chain(layout, "held", 6)
    blocks = compute(m, metas, random_blocks(layout, 6, seed=5))
    deferred = [block for block in blocks if block.ref_cnt == 1]  # held by their deferral
    assert len(deferred) == 4 == m.stores.num_held and m.pool.num_free_blocks == 4
    m.touch(deferred[:1])  # a request's prefix hit on the first deferred one
    taken = m.allocate(5)  # one short: a deferred block the deferral alone holds comes free
    assert taken is not None and deferred[0] not in taken
    assert m.stores.num_held == 3
    m.free(taken + deferred[:1])
    release.set()
    m.flush()
    stores = m.stats().stores
    assert stores.lost == 0 and stores.pending == 0
    assert stores.written + stores.num_skipped == stores.offered == 6
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_lookup_with_gaps_finds_a_stored_tail(tmp_path, managers):
    m = small_manager(managers, tmp_path, gpu=8, host=2)
    layout = m.layout
    metas, data = chain(layout, "tail", 6), random_blocks(layout, 6, seed=4)
    compute(m, metas, data)
    evict_gpu(m)  # flushed to disk; the host keeps the last two
    for meta in metas:
        m.host.remove(meta.block_hash)
    assert m.disk.delete([metas[0].block_hash, metas[2].block_hash]) == 2
    hashes = [meta.block_hash for meta in metas]
    assert m.lookup(hashes).locations == []  # the prefix ends at the first gap
    hit = m.lookup(hashes, gaps=True)
    assert hit.locations == [None, Tier.DISK, None, Tier.DISK, Tier.DISK, Tier.DISK]
    # A trailing gap is no part of a prefix.
    m.disk.delete([metas[5].block_hash])
    assert m.lookup(hashes, gaps=True).num_blocks == 5
    # The blocks behind the gaps load as any others.
    targets = m.allocate(3)
    arrived = m.complete_load_blocks(m.prepare_load(metas[3:5] + metas[1:2], targets))
    assert arrived == [True] * 3
    for block, index in zip(targets, (3, 4, 1)):
        assert same_bytes(m.kv_cache[block.block_id], data[index])
    m.free(targets)
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_flush_out_of_time_counts_what_it_gave_up(tmp_path, managers, release):
    m = small_manager(managers, tmp_path, gpu=16, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    m.disk.put_counted, entered = held_before(m.disk.put_counted, release)
    metas = chain(layout, "late", 5)
    compute(m, metas, random_blocks(layout, 5, seed=5))
    assert entered.wait(timeout=30)  # the first write-back is under way and held
    # Two blocks took the two host slots and their write-back is held; three wait.
    seen = []
    # The held write ends once flush is waiting for it (when exactly changes nothing: the
    # deadline of 0 s has passed by the time anything more could be written).
    threading.Timer(0.05, release.set).start()
    report = m.flush(timeout_s=0.0, progress=lambda written, left: seen.append((written, left)))
    assert seen == [(0, 5)]  # the deadline had passed at the first look
    assert (report.num_written, report.num_unwritten) == (2, 3)
    stores = m.stats().stores
    assert stores.skipped[SkipReason.FLUSH_TIMEOUT.value] == 3
    assert stores.pending == 0 and stores.lost == 0 and stores.written == 2
    assert m.stores.num_held == 0
    check_idle(m)
