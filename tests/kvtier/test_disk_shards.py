"""A disk tier split over several LMDB environments (`kvtier.tiers.disk.shards`), on real
directories: blocks spread and read back byte-exact, the shards commit side by side on
threads of their own, a directory keeps the count it was written with, bad layouts are
refused without touching a file, and a damaged shard is set aside alone."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from disk_cases import LARGE, SMALL, make_blocks, read_back, same_bytes
from manager_cases import check_idle, load

from kvtier.config import TierConfig
from kvtier.manager import TierManager
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import existing_shards, shard_name, shard_of
from kvtier.tiers.disk.shards import ShardedDiskTier
from kvtier.tiers.disk.tier import DiskTier

BUDGET = 1 << 30


def _open(path, layout=LARGE, shards=4, budget=BUDGET, **options):
    tier, recovery = open_disk_tier(path, layout, budget, shards=shards, **options)
    assert recovery is None
    return tier


def test_blocks_spread_over_the_shards_and_read_back_byte_exact(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=3, num_blocks=48)
    with _open(tmp_path / "kv") as tier:
        assert isinstance(tier, ShardedDiskTier) and len(tier.shards) == 4
        assert tier.put(metas, payloads) == [True] * 48
        assert tier.contains([m.block_hash for m in metas]) == [True] * 48
        stats = tier.stats()
        assert stats.num_blocks == 48 and stats.puts == 48 and stats.budget_bytes == BUDGET
        per_shard = [shard.stats().num_blocks for shard in tier.shards]
        assert sum(per_shard) == 48 and all(per_shard)
        for k, shard in enumerate(tier.shards):
            assert shard.path.name == shard_name(k, 4)
            assert shard.contains([m.block_hash for m in metas]) == \
                [shard_of(m.block_hash, 4) == k for m in metas]
        # One batch over every shard, in the caller's order.
        dests = [torch.empty(LARGE.block_shape, dtype=LARGE.dtype) for _ in metas]
        assert tier.get_many_into(metas[::-1], dests) == [True] * 48
        for dest, payload in zip(dests, payloads[::-1]):
            assert same_bytes(dest, payload)
        assert tier.delete([m.block_hash for m in metas[:5]]) == 5
        assert read_back(tier, metas[0]) is None and tier.stats().num_blocks == 43
    assert not (tmp_path / "kv" / "data.mdb").exists()


def test_the_shards_commit_side_by_side(tmp_path):
    """Each shard's write transaction waits inside itself until all four are open at once:
    a tier that committed one shard after another would break the barrier."""
    metas, payloads = make_blocks(LARGE, seed=5, num_blocks=40)
    assert {shard_of(m.block_hash, 4) for m in metas} == {0, 1, 2, 3}
    all_open = threading.Barrier(4, timeout=20)
    threads: set[str] = set()

    def inside_the_transaction(batch) -> None:
        threads.add(threading.current_thread().name)
        all_open.wait()

    with _open(tmp_path / "kv", write_hook=inside_the_transaction) as tier:
        job, stored = tier.write_job(metas, payloads)
        assert job.run() == 40 * LARGE.bytes_per_block and stored == [True] * 40
        assert len(threads) == 4 and threading.current_thread().name not in threads
        all_open.abort()  # later writes (none here) would not wait


def test_a_directory_keeps_the_count_it_was_written_with(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=7, num_blocks=16)
    with _open(tmp_path / "kv", SMALL, shards=4) as tier:
        tier.put(metas, payloads)
    with _open(tmp_path / "kv", SMALL, shards=2) as tier:  # asks for 2: finds 4
        assert len(tier.shards) == 4
        assert tier.contains([m.block_hash for m in metas]) == [True] * 16
    # One environment written before shards existed opens as it was, whatever is asked.
    with DiskTier(tmp_path / "old", SMALL, BUDGET) as tier:
        tier.put(metas, payloads)
    with _open(tmp_path / "old", SMALL, shards=8) as tier:
        assert isinstance(tier, DiskTier)
        assert all(same_bytes(read_back(tier, m), p) for m, p in zip(metas, payloads))
    assert existing_shards(tmp_path / "old") == 1 and existing_shards(tmp_path / "kv") == 4
    assert existing_shards(tmp_path / "new") is None


def test_mixed_or_incomplete_directories_are_refused_and_left_as_they_are(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=9, num_blocks=8)
    with _open(tmp_path / "kv", SMALL, shards=4) as tier:
        tier.put(metas, payloads)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "kv").rglob("*"))
    with pytest.raises(ValueError, match="sharded disk tier; open it with"):
        DiskTier(tmp_path / "kv", SMALL, BUDGET)  # would add data.mdb beside the shards
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "kv").rglob("*")) == before
    os.rename(tmp_path / "kv" / shard_name(2, 4), tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="lacks shard directories shard-2-of-4; restore"):
        open_disk_tier(tmp_path / "kv", SMALL, BUDGET, shards=4)
    os.rename(tmp_path / "elsewhere", tmp_path / "kv" / shard_name(2, 4))
    (tmp_path / "kv" / shard_name(0, 2)).mkdir()
    with pytest.raises(ValueError, match="mixes layouts .2 shards, 4 shards"):
        open_disk_tier(tmp_path / "kv", SMALL, BUDGET)
    (tmp_path / "kv" / shard_name(0, 2)).rmdir()
    with _open(tmp_path / "kv", SMALL) as tier:  # nothing was lost on the way
        assert tier.contains([m.block_hash for m in metas]) == [True] * 8
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="1 to 64 shards"):
            open_disk_tier(tmp_path / "other", SMALL, BUDGET, shards=bad)


def test_a_damaged_shard_is_moved_aside_and_the_others_keep_their_blocks(tmp_path, caplog):
    metas, payloads = make_blocks(LARGE, seed=11, num_blocks=32)
    with _open(tmp_path / "kv") as tier:
        tier.put(metas, payloads)
    damaged = tmp_path / "kv" / shard_name(1, 4) / "data.mdb"
    damaged.write_bytes(b"\x00" * 8192 + damaged.read_bytes()[8192:])  # both meta pages
    tier, recovery = open_disk_tier(tmp_path / "kv", LARGE, BUDGET, shards=4)
    assert recovery is not None and not recovery.disk_off
    assert recovery.path.name == shard_name(1, 4) and recovery.moved_to.exists()
    with tier:
        found = tier.contains([m.block_hash for m in metas])
        assert found == [shard_of(m.block_hash, 4) != 1 for m in metas]
        assert 0 < sum(found) < 32
        for meta, payload, hit in zip(metas, payloads, found):
            if hit:
                assert same_bytes(read_back(tier, meta), payload)
        assert tier.put(metas, payloads) == [True] * 32  # the fresh shard takes its blocks
    assert "was damaged" in caplog.text


def test_each_shard_keeps_within_its_share_of_the_budget(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=13, num_blocks=64)
    record = SMALL.bytes_per_block + 512  # a record's header is well under 512 bytes
    with _open(tmp_path / "kv", SMALL, budget=4 * 6 * record) as tier:
        for k in range(0, 64, 8):
            tier.put(metas[k:k + 8], payloads[k:k + 8])
        stats = tier.stats()
        assert stats.bytes_used <= stats.budget_bytes and stats.pruned > 0
        assert all(shard.stats().bytes_used <= shard.budget_bytes for shard in tier.shards)
        # The newest blocks survive in every shard.
        assert all(tier.contains([m.block_hash for m in metas[-8:]]))


def test_a_manager_restores_through_a_sharded_disk_after_a_restart(tmp_path):
    """Blocks written back through a manager's host tier into four shards come back,
    byte-exact, into a fresh manager's GPU blocks."""
    config = TierConfig.from_slots(SMALL, 8, 2, disk_path=tmp_path / "kv",
                                   num_disk_blocks=64, disk_shards=4)
    metas, payloads = make_blocks(SMALL, seed=17, num_blocks=6)
    writer = TierManager(SMALL, config)
    assert isinstance(writer.disk, ShardedDiskTier)
    for meta, payload in zip(metas, payloads):  # one at a time: the host has two slots
        (block,) = writer.allocate(1)
        writer.kv_cache[block.block_id] = payload
        writer.cache_full_blocks([block], [meta])
        writer.free([block])
        writer.flush()
    writer.close()
    assert existing_shards(tmp_path / "kv") == 4
    m = TierManager(SMALL, config)
    try:
        assert m.lookup([meta.block_hash for meta in metas]).num_blocks == 6
        num_ok, targets = load(m, metas)
        assert num_ok == 6
        for block, payload in zip(targets, payloads):
            assert same_bytes(m.kv_cache[block.block_id], payload)
        check_idle(m)
        assert m.stats().disk.hits == 6
    finally:
        m.close()



STALL, GO_ON = threading.Event(), threading.Event()


class StallingLookups(DiskTier):
    """A real shard whose lookups from LMDB wait while `STALL` is set (a frozen disk)."""

    def _contains_now(self, block_hashes):
        if STALL.is_set():
            GO_ON.wait(30)
        return super()._contains_now(block_hashes)


def test_a_stalled_disk_costs_one_lookup_deadline_not_one_per_shard(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=11, num_blocks=16)
    STALL.clear()
    GO_ON.clear()
    # keys_fresh_s 0: no lookup is answered from memory, each shard asks its lookup thread.
    tier, _ = open_disk_tier(tmp_path / "kv", SMALL, BUDGET, shards=4,
                             tier_class=StallingLookups, lookup_deadline_s=0.5,
                             keys_fresh_s=0.0)
    try:
        assert sum(tier.put(metas, payloads)) == 16
        assert tier.contains([m.block_hash for m in metas]) == [True] * 16
        STALL.set()
        start = time.monotonic()
        assert tier.contains([m.block_hash for m in metas]) == [False] * 16
        # One shard after another would wait out four deadlines; side by side, one.
        assert time.monotonic() - start < 1.5
        assert all(shard.unavailable is not None for shard in tier.shards)
    finally:
        GO_ON.set()
        STALL.clear()
        tier.close()


def test_a_closed_sharded_tier_refuses_lookups_as_one_shard_does(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=12, num_blocks=8)
    tier = _open(tmp_path / "kv", SMALL)
    tier.put(metas, payloads)
    tier.close()
    with pytest.raises(ValueError, match="is closed"):
        tier.contains([m.block_hash for m in metas])
