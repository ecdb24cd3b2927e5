"""TierManager scenarios where host slots run short, on tiny capacities with a real LMDB
disk tier in a temp directory: pins that outlive host exhaustion, write-back before a slot
is freed, write-throughs deferred (never waited for) and dropped, disk reads that keep a
slot and an I/O thread while writes outpace the disk, and the stores' hold on GPU blocks.
"""

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
    write,
)

from kvtier.stats import Direction, Tier
from kvtier.tiers.host import SlotState

# ---- pins, write-back and backpressure ---------------------------------------------------

@pytest.mark.timeout(120)
def test_a_slot_pinned_by_a_load_survives_host_exhaustion(tmp_path, managers, release):
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2)
    layout = m.layout
    block_a, data_a = chain(layout, "a", 1), random_blocks(layout, 1, seed=1)
    write(m, block_a, data_a)
    m.flush()
    # Two more blocks push the (clean) block A out of the two host slots; it is on disk.
    write(m, chain(layout, "b", 2), random_blocks(layout, 2, seed=2))
    evict_gpu(m)
    assert m.lookup([block_a[0].block_hash]).locations == [Tier.DISK]
    # Hold A's disk read open after its bytes landed in a host slot.
    real_get, landed = m.disk.get_many_into, threading.Event()

    def held_get(metas, dests):
        results = real_get(metas, dests)
        landed.set()
        release.wait()
        return results

    m.disk.get_many_into = held_get
    target = m.allocate(1)
    load_id = m.prepare_load(block_a, target)
    assert landed.wait(timeout=60)
    (slot,) = [s for s in range(2) if m.host.state(s) is SlotState.RESERVED]
    assert m.host.num_pins(slot) == 1 and m.host.meta(slot) == block_a[0]
    # Exhaust the host tier with write-throughs; the pinned slot must never be reused.
    for i in range(6):
        write(m, chain(layout, f"filler{i}", 1), random_blocks(layout, 1, seed=100 + i))
        assert m.host.state(slot) is SlotState.RESERVED and m.host.meta(slot) == block_a[0]
        assert same_bytes(m.host.slot_tensor(slot), data_a[0])
    assert not m.is_load_ready(load_id)
    release.set()
    assert m.complete_load(load_id) == 1
    assert same_bytes(m.kv_cache[target[0].block_id], data_a[0])
    m.free(target)
    m.flush()
    check_idle(m)


@pytest.mark.timeout(120)
def test_write_back_commits_before_the_slot_is_freed(tmp_path, managers, release):
    m = small_manager(managers, tmp_path, gpu=8, host=3, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    m.disk.put_counted, entered = held_before(m.disk.put_counted, release)
    metas, data = chain(layout, "wb", 5), random_blocks(layout, 5, seed=3)
    hashes = [meta.block_hash for meta in metas]
    # A, B, C fill the host (dirty). Taking the last free slot starts A's write-back.
    for i in range(3):
        write(m, metas[i:i + 1], data[i:i + 1])
    assert entered.wait(timeout=60)
    # D and E find no slot: A and B are being written back (D's attempt started B's), and
    # C is dirty and must not be dropped. They are skipped, not waited for, and C's
    # write-back starts so that they can follow once the disk has the three.
    write(m, metas[3:4], data[3:4])
    write(m, metas[4:5], data[4:5])
    assert m.stats().tiers[Tier.HOST].rejected == 2
    assert all(m.host.contains(h) for h in hashes[:3])
    assert not m.host.contains(hashes[3]) and not m.host.contains(hashes[4])
    assert all(m.host.num_pins(m.host.lookup(h)) == 1 for h in hashes[:3])  # being written
    assert m.disk.contains(hashes[:3]) == [False] * 3
    release.set()
    m.flush()
    # The three committed, then the deferred D and E (still cached on the GPU) took the
    # least recently used clean slots, A's and B's, and were written back in turn.
    assert m.disk.contains(hashes) == [True] * 5
    assert m.stats().host_dirty == 0
    assert [m.host.contains(h) for h in hashes] == [False, False, True, True, True]
    # Now every slot is clean: a new block evicts the least recently used one, C.
    write(m, chain(layout, "f", 1), random_blocks(layout, 1, seed=4))
    m.flush()
    assert not m.host.contains(hashes[2])
    evict_gpu(m)
    assert m.lookup(hashes).locations == [Tier.DISK] * 3 + [Tier.HOST] * 2
    num_ok, blocks = load(m, metas)
    assert num_ok == 5
    for block, expected in zip(blocks, data):
        assert same_bytes(m.kv_cache[block.block_id], expected)
    m.free(blocks)
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_deferred_write_through_is_dropped_once_its_gpu_block_is_reused(tmp_path, managers,
                                                                         release):
    m = small_manager(managers, tmp_path, gpu=8, host=2, io_threads=2,
                      read_reserve_share=0)  # every slot the stores'
    layout = m.layout
    m.disk.put_counted, _ = held_before(m.disk.put_counted, release)
    metas, data = chain(layout, "gone", 3), random_blocks(layout, 3, seed=5)
    for i in range(3):
        write(m, metas[i:i + 1], data[i:i + 1])
    assert m.stats().tiers[Tier.HOST].rejected == 1  # C: both slots are being written back
    # C's deferred write-through holds its GPU block while the pool has others to give.
    assert m.pool.num_free_blocks == m.pool.num_blocks - 1
    # Another request takes every GPU block and overwrites C's bytes before a slot frees:
    # the deferred store gives its block up, and C is counted skipped, not lost.
    blocks = m.allocate(m.pool.num_blocks)
    assert blocks is not None
    m.kv_cache[[b.block_id for b in blocks]] = 0
    release.set()
    m.flush()
    m.free(blocks)
    assert not m.host.contains(metas[2].block_hash)
    assert m.disk.contains([metas[2].block_hash]) == [False]
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.HOST] * 2
    stores = m.stats().stores
    assert stores.skipped["gpu_reused"] == 1 and stores.written == 2
    assert stores.offered == 3 and stores.pending == 0 and stores.lost == 0
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_disk_read_takes_a_cleaned_slot_before_a_deferred_write_through(tmp_path, managers,
                                                                          release):
    m = small_manager(managers, tmp_path, gpu=8, host=1, io_threads=2)
    layout = m.layout
    x, y, w = (chain(layout, name, 1) for name in ("x", "y", "w"))
    x_data, y_data, w_data = (random_blocks(layout, 1, seed) for seed in (1, 2, 3))
    write(m, x, x_data)
    evict_gpu(m)  # X: on disk, and clean in the one host slot
    m.disk.put_counted, entered = held_before(m.disk.put_counted, release)
    write(m, y, y_data)  # Y evicts X from the host; its write-back is held
    assert entered.wait(timeout=60)
    write(m, w, w_data)  # no slot: W's write-through is deferred
    assert not m.host.contains(w[0].block_hash)
    target = m.allocate(1)
    load_id = m.prepare_load(x, target)  # X waits for a host slot to be read into
    release.set()
    m.transfers.wait_all()  # Y's write-back committed; the next poll cleans its slot
    m.poll()
    # The read got the slot; W stays deferred (it would have taken the slot first before).
    assert not m.host.contains(w[0].block_hash)
    m.transfers.wait_all()
    m.poll()
    assert m.is_load_ready(load_id, advance=False)
    assert m.complete_load(load_id) == 1
    assert same_bytes(m.kv_cache[target[0].block_id], x_data[0])
    m.free(target)
    m.flush()  # W follows once X's slot is clean: nothing was lost
    assert m.disk.contains([y[0].block_hash, w[0].block_hash]) == [True, True]
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_disk_read_gets_a_slot_and_a_thread_while_writes_outpace_the_disk(tmp_path, managers,
                                                                            release):
    m = small_manager(managers, tmp_path, gpu=32, host=16, io_threads=2,
                      read_reserve_share=0.25)
    layout = m.layout
    x, z, w = (chain(layout, name, 1) for name in ("x", "z", "w"))
    z_data = random_blocks(layout, 1, seed=1)
    write(m, x, random_blocks(layout, 1, seed=2))
    write(m, z, z_data)
    evict_gpu(m)  # X and Z: on disk, and clean in the host tier
    assert m.host.remove(z[0].block_hash)  # Z: on disk only
    writing = threading.Semaphore(0)
    put = m.disk.put_counted

    def held_put(*args):
        writing.release()
        release.wait()
        return put(*args)

    m.disk.put_counted = held_put
    # Fifteen dirty blocks fill the free slots; their write-backs cannot finish. They come
    # in two steps, so two write jobs start (the store path keeps writing while any wait).
    y = chain(layout, "y", 15)
    y_data = random_blocks(layout, 15, seed=3)
    write(m, y[:8], y_data[:8])
    assert writing.acquire(timeout=60)
    write(m, y[8:], y_data[8:])
    # The one evictable slot left (X's) is kept for reads: W's write-through is deferred.
    write(m, w, random_blocks(layout, 1, seed=4))
    assert m.host.contains(x[0].block_hash) and not m.host.contains(w[0].block_hash)
    m.stores.write_back_all()
    assert m.stats(lower_tiers=False).num_jobs_in_flight >= 2  # more write jobs than threads
    assert not writing.acquire(timeout=0.3)  # writes hold one of the two threads, not both
    target = m.allocate(1)
    load_id = m.prepare_load(z, target)
    # Z is read into X's slot by the thread writes leave free, the disk's writes still stuck.
    deadline = time.monotonic() + 30
    while not m.is_load_ready(load_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.is_load_ready(load_id) and not release.is_set()
    assert m.complete_load(load_id) == 1
    assert same_bytes(m.kv_cache[target[0].block_id], z_data[0])
    m.free(target)
    release.set()
    m.flush()  # the stores follow once the disk writes again: nothing was lost
    assert m.disk.contains([w[0].block_hash]) == [True]
    check_idle(m)


def test_write_through_holds_the_gpu_block_until_the_copy_is_done(managers):
    m = small_manager(managers, None, gpu=2, host=2)
    layout = m.layout
    blocks = m.allocate(1)
    m.cache_full_blocks(blocks, chain(layout, "x", 1))
    m.free(blocks)
    # Queued, the store holds the block: nothing may overwrite it before its copy starts.
    assert m.num_stores_queued == 1
    assert blocks[0].ref_cnt == 1 and m.allocate(2) is None
    m.poll()  # polling does not start queued stores (the engine starts them mid-step)
    assert blocks[0].ref_cnt == 1 and m.host.num_cached == 0
    m.submit_stores()
    # The copy's reference keeps the block out of reuse until poll() sees it finished.
    assert m.num_stores_queued == 0
    assert blocks[0].ref_cnt == 1 and m.allocate(2) is None
    m.poll()
    assert blocks[0].ref_cnt == 0 and m.host.num_cached == 1
    assert m.allocate(2) is not None


def test_waiting_for_stores_frees_only_blocks_the_copies_alone_hold(managers):
    m = small_manager(managers, None, gpu=4, host=4)
    layout = m.layout
    metas, data = chain(layout, "w", 3), random_blocks(layout, 3, seed=12)
    blocks = m.allocate(3)
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id] = block_data
    m.cache_full_blocks(blocks, metas)
    m.free(blocks[:2])  # the request still holds the third block
    m.submit_stores()
    # Copies in flight (their completion runs in a poll) hold all three blocks; landing,
    # they free two.
    assert m.pool.num_free_blocks == 1 and m.allocate(2) is None
    assert not m.wait_for_stores(3)  # no waiting when it cannot free enough
    assert [b.ref_cnt for b in blocks] == [1, 1, 2]
    assert m.wait_for_stores(2)
    assert [b.ref_cnt for b in blocks] == [0, 0, 1]
    assert all(m.host.contains(meta.block_hash) for meta in metas)
    assert not m.wait_for_stores(1)  # nothing in flight any more
    new = m.allocate(3)
    assert new is not None
    m.free(new + blocks[2:])
    check_idle(m)


def test_the_blocks_of_one_store_are_copied_in_one_job(managers):
    m = small_manager(managers, None, gpu=8, host=6)
    layout = m.layout
    metas, data = chain(layout, "batch", 5), random_blocks(layout, 5, seed=6)
    write(m, metas, data)
    stats = m.stats()
    assert stats.transfers[Direction.GPU_TO_HOST].num_jobs == 1
    assert stats.host_cached == 5
