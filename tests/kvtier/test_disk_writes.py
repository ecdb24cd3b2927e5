"""The disk tier's write path on real LMDB directories and real threads: what a batch
reports, the work it does per batch, and stats that do not hold lookups up."""

from __future__ import annotations

import threading

from disk_cases import BIG_BUDGET, LARGE, make_blocks, read_back, same_bytes

from kvtier.tiers.disk.index import GuardedEnv
from kvtier.tiers.disk.keys import StoredKeys
from kvtier.tiers.disk.tier import DiskTier


def test_a_write_job_reports_presence_and_counts_only_the_bytes_it_wrote(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=1, num_blocks=12)
    with DiskTier(tmp_path, LARGE, BIG_BUDGET) as tier:
        assert tier.put(metas[:4], payloads[:4]) == [True] * 4
        # A batch with four stored blocks, a block twice, and seven new ones.
        batch = metas[:4] + [metas[4]] + metas[4:11]
        job, stored = tier.write_job(batch, payloads[:4] + [payloads[4]] + payloads[4:11])
        assert job.run() == 7 * LARGE.bytes_per_block
        assert stored == [True] * len(batch)
        assert tier.stats().puts == 11
        for meta, payload in zip(metas[:11], payloads[:11]):
            assert same_bytes(read_back(tier, meta), payload)
        # All stored: nothing written, all present.
        job, stored = tier.write_job(metas[:11], payloads[:11])
        assert job.run() == 0
        assert stored == [True] * 11
    with DiskTier(tmp_path, LARGE, BIG_BUDGET, readonly=True) as tier:
        job, stored = tier.write_job(metas, payloads)
        assert job.run() == 0
        assert stored == [True] * 11 + [False]
        assert tier.stats().refused == 1


def test_a_batch_looks_its_hashes_up_once_and_opens_two_transactions(tmp_path, monkeypatch):
    """One lookup finds the blocks to write, one write transaction stores them and says
    which are stored: no lookups after the commit."""
    metas, payloads = make_blocks(LARGE, seed=2, num_blocks=40)
    lookups: list[int] = []
    transactions: list[bool] = []
    contains, txn = StoredKeys.contains, GuardedEnv.txn

    def counted_contains(self, block_hashes):
        lookups.append(len(block_hashes))
        return contains(self, block_hashes)

    def counted_txn(self, write=False):
        transactions.append(write)
        return txn(self, write)

    with DiskTier(tmp_path, LARGE, BIG_BUDGET) as tier:
        assert tier.keys_in_memory(wait=10)
        tier.put(metas[:8], payloads[:8])
        monkeypatch.setattr(StoredKeys, "contains", counted_contains)
        monkeypatch.setattr(GuardedEnv, "txn", counted_txn)
        for start in range(0, 40, 16):  # the first batch half stored already
            job, stored = tier.write_job(metas[start:start + 16], payloads[start:start + 16])
            job.run()
            assert all(stored)
        assert lookups == [16, 16, 8]
        assert transactions == [False, True] * 3
        assert tier.stats().puts == 40


class StatsStuck(DiskTier):
    """A real disk tier whose stats read waits while `stuck` is set (a slow metrics
    scrape on a busy disk)."""

    def __init__(self, *args, **kwargs) -> None:
        self.stuck = threading.Event()
        self.unstuck = threading.Event()
        super().__init__(*args, **kwargs)

    def _stored_figures(self):
        if self.stuck.is_set():
            assert self.unstuck.wait(30), "the test never let the stats read go"
        return super()._stored_figures()


def test_a_stalled_stats_read_holds_no_lookup_up(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=4, num_blocks=6)
    with StatsStuck(tmp_path, LARGE, BIG_BUDGET, lookup_deadline_s=0.2) as tier:
        tier.put(metas[:3], payloads[:3])
        assert tier.stats().num_blocks == 3
        tier.stuck.set()
        tier.put(metas[3:], payloads[3:])
        # Past its deadline the stats read answers with the figures last read...
        assert tier.stats().num_blocks == 3
        # ...and lookups, on their own thread, still answer: the disk is not set aside.
        assert tier.contains([m.block_hash for m in metas]) == [True] * 6
        assert tier.unavailable is None
        assert tier.stats().num_blocks == 3  # still stalled: not asked again
        tier.unstuck.set()
        tier.stuck.clear()
        for _ in range(100):
            if tier.stats().num_blocks == 6:
                break
            threading.Event().wait(0.02)
        assert tier.stats().num_blocks == 6
        assert tier.stats().puts == 6
