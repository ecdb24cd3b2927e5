"""The disk tier without a sync per commit: what a killed process leaves, when the tier
syncs (in the background past `sync_every_bytes`, on `sync`, `close` and the manager's
flush), and how `TierConfig.disk_durable` reaches the tier. Real LMDB in temp directories,
real child processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
from disk_cases import BIG_BUDGET, LARGE, make_blocks, read_back, same_bytes
from manager_cases import chain, random_blocks, small_layout, write

from kvtier.config import TierConfig
from kvtier.manager import TierManager
from kvtier.tiers.disk.tier import DiskTier

NEVER = 1 << 62  # a sync_every_bytes no test reaches: only sync() and close() sync


def wait_for_syncs(tier: DiskTier, count: int) -> int:
    """The tier's sync count once it reaches `count` (the background thread's sync is
    waited for, not timed; the deadline only keeps a broken build from hanging)."""
    deadline = time.monotonic() + 60
    while tier.stats().syncs < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return tier.stats().syncs


def _write_then_wait(path: str, num_blocks: int, conn) -> None:
    """The child: write blocks into a non-durable tier, report once every put returned,
    then wait to be killed (the tier is never closed, nothing synced)."""
    tier = DiskTier(path, LARGE, BIG_BUDGET, durable=False, sync_every_bytes=NEVER)
    metas, payloads = make_blocks(LARGE, 7, num_blocks)
    for start in range(0, num_blocks, 8):
        assert all(tier.put(metas[start:start + 8], payloads[start:start + 8]))
    conn.send(tier.stats().syncs)
    threading.Event().wait()


def test_blocks_of_a_killed_non_durable_writer_all_read_back(tmp_path) -> None:
    path = tmp_path / "kv"
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_write_then_wait, args=(str(path), 40, sender))
    child.start()
    try:
        assert receiver.poll(120), "the writer never reported"
        syncs = receiver.recv()
    finally:
        os.kill(child.pid, signal.SIGKILL)  # right after the writes returned: no close
        child.join()
    assert child.exitcode == -signal.SIGKILL
    assert syncs == 0  # nothing was synced: the blocks sat in the page cache only
    metas, payloads = make_blocks(LARGE, 7, 40)
    with DiskTier(path, LARGE, BIG_BUDGET, durable=False) as tier:
        assert tier.stats().num_blocks == 40
        for meta, payload in zip(metas, payloads):
            stored = read_back(tier, meta)  # validated: header, checksum, token ids
            assert stored is not None and same_bytes(stored, payload)
        assert tier.stats().rejected == 0


def test_the_background_sync_runs_past_sync_every_bytes(tmp_path) -> None:
    every = 3 * LARGE.bytes_per_block
    metas, payloads = make_blocks(LARGE, 1, 10)
    with DiskTier(tmp_path / "kv", LARGE, BIG_BUDGET, durable=False,
                  sync_every_bytes=every) as tier:
        assert tier.put(metas[:2], payloads[:2]) == [True, True]
        assert tier.stats().syncs == 0  # 2 blocks written: under the threshold
        assert tier.put(metas[:2], payloads[:2]) == [True, True]
        assert tier.stats().syncs == 0  # stored already: nothing written, nothing counted
        tier.put(metas[2:4], payloads[2:4])  # 4 blocks written since the start
        assert wait_for_syncs(tier, 1) == 1
        assert "kvtier-disk-sync" in {thread.name for thread in threading.enumerate()}
        tier.put(metas[4:6], payloads[4:6])  # 2 more since that sync began: none due
        assert tier.stats().syncs == 1
        tier.put(metas[6:10], payloads[6:10])
        assert wait_for_syncs(tier, 2) == 2
        for meta, payload in zip(metas, payloads):
            stored = read_back(tier, meta)
            assert stored is not None and same_bytes(stored, payload)
    assert "kvtier-disk-sync" not in {thread.name for thread in threading.enumerate()}


def test_a_durable_tier_needs_no_background_sync(tmp_path) -> None:
    metas, payloads = make_blocks(LARGE, 2, 8)
    with DiskTier(tmp_path / "kv", LARGE, BIG_BUDGET, durable=True,
                  sync_every_bytes=LARGE.bytes_per_block) as tier:
        assert tier.durable and tier.stats().durable
        assert all(tier.put(metas, payloads))  # every commit synced on the writer's thread
        assert tier.stats().syncs == 0


@pytest.mark.parametrize("durable", [False, True])
def test_close_and_sync_put_everything_on_the_disk(tmp_path, durable) -> None:
    metas, payloads = make_blocks(LARGE, 3, 6)
    tier = DiskTier(tmp_path / "kv", LARGE, BIG_BUDGET, durable=durable,
                    sync_every_bytes=NEVER)
    assert all(tier.put(metas[:3], payloads[:3]))
    assert tier.stats().syncs == 0
    tier.sync()
    assert tier.stats().syncs == 1
    assert all(tier.put(metas[3:], payloads[3:]))
    tier.close()
    assert tier.num_syncs == 2  # close synced after its last write
    tier.close()
    assert tier.num_syncs == 2
    with DiskTier(tmp_path / "kv", LARGE, BIG_BUDGET, readonly=True) as reader:
        assert all(read_back(reader, meta) is not None for meta in metas)
    assert reader.num_syncs == 0  # a read-only tier has nothing to sync


def test_sync_every_bytes_must_be_positive(tmp_path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="sync_every_bytes must be a positive integer"):
            DiskTier(tmp_path / "kv", LARGE, BIG_BUDGET, sync_every_bytes=bad)


def test_tier_config_durability_reaches_the_disk_tier_and_the_flush_syncs(tmp_path) -> None:
    layout = small_layout()
    assert TierConfig(num_gpu_blocks=4).disk_durable is False  # the engine's default
    for durable in (False, True):
        options = {} if not durable else {"disk_durable": True}
        config = TierConfig.from_slots(layout, 8, 2, disk_path=tmp_path / f"kv-{durable}",
                                       num_disk_blocks=64, **options)
        m = TierManager(layout, config)
        try:
            disk = m.lower_tiers.named("disk")
            assert isinstance(disk, DiskTier) and disk.durable is durable
            metas = chain(layout, "a", 4)
            write(m, metas, random_blocks(layout, 4, seed=1))
            before = disk.num_syncs
            m.flush()  # every block written back (the host holds 2 of them), then synced
            assert disk.num_syncs == before + 1
            assert disk.contains([meta.block_hash for meta in metas]) == [True] * 4
        finally:
            m.close()
        assert disk.num_syncs == before + 3  # the close's flush, then the tier's close
