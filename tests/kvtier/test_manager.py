"""TierManager scenarios on tiny capacities, with a real LMDB disk tier in a temp directory:
the round trip through every tier, and failing closed.

On the CPU the "GPU" cache is a CPU tensor and GPU <-> host copies run synchronously, but
they go through the same jobs, completions and pins as on a GPU. Blocks hold random bit
patterns (NaNs included), so every comparison is byte for byte. Tier combinations and the
argument and config checks live in test_manager_tiers.py, host slots under pressure (pins,
write-back, stores against reads) in test_manager_pressure.py, the CUDA scenarios in
test_manager_cuda.py, the shared builders in manager_cases.py.
"""

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from manager_cases import (
    DTYPES,
    REPO_ROOT,
    chain,
    check_idle,
    config,
    disk_only,
    evict_gpu,
    held_before,
    load,
    random_blocks,
    same_bytes,
    small_layout,
    write,
)

from kvtier.manager import TierManager
from kvtier.stats import Direction, Tier
from kvtier.tiers.record import BlockMeta

# ---- the round trip ----------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "disk_worker"),
                         [(dtype, False) for dtype in DTYPES] + [(torch.bfloat16, True)])
def test_round_trip_gpu_host_disk_host_gpu(tmp_path, managers, dtype, disk_worker):
    """Also with the disk tier in a worker process, reading into and writing from the
    shared host slab."""
    layout = small_layout(dtype)
    m = TierManager(layout, config(layout, tmp_path, gpu=4, host=2, disk_worker=disk_worker))
    managers.append(m)
    assert m.uses_disk_worker is disk_worker
    metas, data = chain(layout, "doc", 6), random_blocks(layout, 6, seed=11)
    # Compute and cache two blocks at a time; flush writes every host block back to disk.
    for i in range(0, 6, 2):
        write(m, metas[i:i + 2], data[i:i + 2])
        m.flush()
    check_idle(m)
    assert m.disk.contains([meta.block_hash for meta in metas]) == [True] * 6
    evict_gpu(m)
    # The host holds the last two blocks; the rest come from disk.
    hit = m.lookup([meta.block_hash for meta in metas])
    assert hit.locations == [Tier.DISK] * 4 + [Tier.HOST] * 2
    assert hit.gpu_blocks == [None] * 6
    # Load the first four (disk -> host slots -> GPU, two slots at a time), then the rest.
    for lo, hi in ((0, 4), (4, 6)):
        num_ok, blocks = load(m, metas[lo:hi])
        assert num_ok == hi - lo
        for block, expected in zip(blocks, data[lo:hi]):
            assert same_bytes(m.kv_cache[block.block_id], expected)
            assert block.block_hash is not None  # cached on the GPU now
        m.free(blocks)
        check_idle(m)
    stats = m.stats()
    assert stats.tiers[Tier.DISK].hits == 4 and stats.tiers[Tier.HOST].hits == 2
    block_bytes = layout.bytes_per_block
    assert stats.transfers[Direction.GPU_TO_HOST].num_bytes == 6 * block_bytes
    assert stats.transfers[Direction.HOST_TO_DISK].num_bytes == 6 * block_bytes
    assert stats.transfers[Direction.DISK_TO_HOST].num_bytes >= 4 * block_bytes
    assert stats.transfers[Direction.HOST_TO_GPU].num_bytes == 6 * block_bytes
    assert stats.tiers[Tier.HOST].failures == stats.tiers[Tier.DISK].failures == 0


CHILD = textwrap.dedent("""
    import sys
    import torch
    from tests.kvtier.manager_cases import chain, config, random_blocks, small_layout, write
    from kvtier.manager import TierManager
    from pathlib import Path

    layout = small_layout(torch.bfloat16)
    m = TierManager(layout, config(layout, Path(sys.argv[1]), gpu=4, host=8))
    write(m, chain(layout, "restart", 3), random_blocks(layout, 3, seed=5))
    m.close()  # writes the dirty host blocks back to disk
""")


def test_stats_without_lower_tiers_leave_lmdb_alone(tmp_path, managers, monkeypatch):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"a": 2})
    full = m.stats()
    assert full.disk is not None and full.disk.num_blocks == 2

    def no_lmdb():
        raise AssertionError("the disk tier's stats were read")

    monkeypatch.setattr(m.disk, "stats", no_lmdb)
    light = m.stats(lower_tiers=False)
    assert light.disk is None and light.remote is None
    assert light.tiers == full.tiers and light.pool == full.pool
    assert light.host_cached == full.host_cached
    with pytest.raises(AssertionError, match="were read"):
        m.stats()


def test_a_close_waits_for_a_lower_tier_read_on_another_thread(tmp_path, managers,
                                                                monkeypatch):
    layout = small_layout()
    m, _ = disk_only(tmp_path, managers, layout, {"a": 2})
    entered, release, results = threading.Event(), threading.Event(), []
    real_stats = m.disk.stats

    def slow_stats():  # an LMDB read that takes a while (cold pages)
        entered.set()
        assert release.wait(30)
        return real_stats()

    monkeypatch.setattr(m.disk, "stats", slow_stats)
    reader = threading.Thread(target=lambda: results.append(m.lower_tiers.stats()))
    reader.start()
    assert entered.wait(30)
    closer = threading.Thread(target=m.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # the disk stays open while its stats are read
    release.set()
    reader.join(30)
    closer.join(30)
    [(disk, remote)] = results
    assert disk.num_blocks == 2 and remote is None
    assert m.lower_tiers.stats() == (None, None)  # closed: nothing below to read
    assert m.stats().disk is None


def test_blocks_persist_across_a_process_restart(tmp_path, managers):
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO_ROOT, check=True,
                   timeout=120)
    layout = small_layout(torch.bfloat16)
    m = TierManager(layout, config(layout, tmp_path, gpu=4, host=0))
    managers.append(m)
    metas = chain(layout, "restart", 3)
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.DISK] * 3
    num_ok, blocks = load(m, metas)
    assert num_ok == 3
    for block, expected in zip(blocks, random_blocks(layout, 3, seed=5)):
        assert same_bytes(m.kv_cache[block.block_id], expected)


@pytest.mark.timeout(60)
def test_a_completion_that_raises_leaves_the_jobs_after_it_to_the_next_poll(tmp_path, managers,
                                                                           monkeypatch):
    # A completion callback that raises is a bug, and the poll that ran it raises. The jobs
    # that finished with it must still complete in the next poll, or flush and close would
    # wait for them forever.
    layout = small_layout()
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=8))
    managers.append(m)
    metas, data = chain(layout, "raising", 4), random_blocks(layout, 4, seed=9)
    blocks = m.allocate(4)
    assert blocks is not None
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id] = block_data
    finish = m.stores._finish_copy
    calls = []

    def first_raises(job_id, items, ok):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("a bug in a completion")
        return finish(job_id, items, ok)

    monkeypatch.setattr(m.stores, "_finish_copy", first_raises)
    m.cache_full_blocks(blocks[:2], metas[:2])  # two write-through jobs, finished at once
    m.submit_stores()  # on the CPU (stores queued together would go as one job)
    m.cache_full_blocks(blocks[2:], metas[2:])
    m.submit_stores()
    with pytest.raises(RuntimeError, match="a bug"):
        m.poll()
    m.poll()
    assert calls == [2, 2]
    assert [m.host.contains(meta.block_hash) for meta in metas[2:]] == [True, True]
    m.free(blocks)
    m.flush()  # returns: nothing is left waiting for a completion that never comes


# ---- fail closed ---------------------------------------------------------------------------

def test_a_failed_disk_read_is_a_miss_and_releases_its_slot(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"a": 2})
    metas, data = blocks["a"]

    def broken_get(metas, dests):
        raise OSError("I/O error")

    m.disk.get_many_into = broken_get
    num_ok, targets = load(m, metas)
    assert num_ok == 0
    assert all(t.block_hash is None and t.ref_cnt == 1 for t in targets)  # caller recomputes
    stats = m.stats()
    assert stats.tiers[Tier.DISK].failures == 2
    assert stats.transfers[Direction.DISK_TO_HOST].failures == 2  # one job per I/O thread
    check_idle(m)  # no staging slot left pinned or reserved
    m.free(targets)
    del m.disk.get_many_into  # the disk recovers: the blocks are still there
    num_ok, targets = load(m, metas)
    assert num_ok == 2 and same_bytes(m.kv_cache[targets[1].block_id], data[1])
    m.free(targets)


@pytest.mark.timeout(120)
def test_a_read_that_missed_counts_failed_even_if_its_load_was_cancelled(tmp_path, managers,
                                                                         release):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"a": 2})
    metas, data = blocks["a"]
    m.disk.delete([metas[1].block_hash])  # pruned between the lookup and the read
    m.disk.get_many_into, entered = held_before(m.disk.get_many_into, release)
    targets = m.allocate(2)
    load_id = m.prepare_load(metas, targets, split_reads=False, known_on_disk=True)
    assert entered.wait(timeout=60)
    m.cancel_load(load_id)  # the read is under way: it goes on
    release.set()
    while not m.is_load_ready(load_id):
        m.poll()
    m.complete_load_blocks(load_id)
    stats = m.stats()
    # The disk missed block 1; the manager counts that read failed, as the soak checks.
    assert stats.disk.misses == 1 and stats.disk.hits == 1
    assert stats.tiers[Tier.DISK].failures == 1
    m.free(targets)
    check_idle(m)


def test_a_record_for_other_tokens_is_never_served(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"ab": 2})
    (meta_a, meta_b), data = blocks["ab"]
    # Store another block's tokens under A's hash (as a hash collision would).
    impostor = BlockMeta(meta_a.block_hash, meta_a.parent_hash,
                         tuple(t + 1 for t in meta_a.token_ids))
    m.disk.delete([meta_a.block_hash])
    assert sum(m.disk.put([impostor], [random_blocks(layout, 1, seed=9)[0]])) == 1
    assert m.lookup([meta_a.block_hash, meta_b.block_hash]).locations == [Tier.DISK] * 2
    num_ok, targets = load(m, [meta_a, meta_b])
    # A is a miss. B arrived intact, but only leading blocks count: B stays uncached too,
    # since the caller recomputes from A onwards.
    assert num_ok == 0
    assert targets[0].block_hash is None and targets[1].block_hash is None
    assert same_bytes(m.kv_cache[targets[1].block_id], data[1])
    assert m.stats().tiers[Tier.DISK].failures == 1
    assert m.lookup([meta_a.block_hash]).num_blocks == 0  # the bad record was deleted
    m.free(targets)
    check_idle(m)


def test_failed_gpu_copies_release_pins_and_count(managers, monkeypatch):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=4, host=2))
    managers.append(m)
    metas, data = chain(layout, "a", 1), random_blocks(layout, 1, seed=1)
    write(m, metas, data)
    evict_gpu(m)

    def broken_swap(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(m.transfers, "_swap", broken_swap)
    num_ok, targets = load(m, metas)
    assert num_ok == 0 and targets[0].block_hash is None
    m.free(targets)
    # A failed write-through leaves nothing in the host and gives the GPU block back.
    stored = write(m, chain(layout, "b", 1), random_blocks(layout, 1, seed=2))
    assert stored[0].ref_cnt == 0 and m.host.num_cached == 1
    assert m.stats().tiers[Tier.HOST].failures == 2
    check_idle(m)
    monkeypatch.undo()
    num_ok, targets = load(m, metas)  # the host copy of A was never harmed
    assert num_ok == 1 and same_bytes(m.kv_cache[targets[0].block_id], data[0])
    m.free(targets)


def test_only_leading_blocks_count(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"abc": 3})
    metas, data = blocks["abc"]
    m.disk.delete([metas[1].block_hash])
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.DISK]
    num_ok, targets = load(m, metas)
    # A arrives; B is nowhere, so B and everything after it are recomputed.
    assert num_ok == 1
    assert targets[0].block_hash == metas[0].block_hash
    assert targets[1].block_hash is None and targets[2].block_hash is None
    assert same_bytes(m.kv_cache[targets[0].block_id], data[0])
    assert m.lookup([metas[0].block_hash]).locations == [Tier.GPU]
    m.free(targets)
    check_idle(m)


def test_a_block_freed_before_complete_load_is_not_cached(managers):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=4, host=2))
    managers.append(m)
    metas = chain(layout, "a", 1)
    write(m, metas, random_blocks(layout, 1, seed=1))
    evict_gpu(m)
    targets = m.allocate(1)
    load_id = m.prepare_load(metas, targets)
    m.free(targets)  # the request went away; the manager still holds the block
    assert targets[0].ref_cnt == 1
    assert m.complete_load(load_id) == 1
    assert targets[0].block_hash is None and targets[0].ref_cnt == 0
    assert m.lookup([metas[0].block_hash]).locations == [Tier.HOST]
    check_idle(m)
