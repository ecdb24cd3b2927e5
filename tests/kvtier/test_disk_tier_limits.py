"""DiskTier at its limits, on real LMDB directories: the byte budget pruning least recently
used blocks first (checked against an LRU model), a map that cannot grow, and a full disk.
The shared builders live in disk_cases.py."""

from __future__ import annotations

import resource
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from disk_cases import (
    BIG_BUDGET,
    LARGE,
    SMALL,
    make_blocks,
    read_back,
    record_size,
    run_in_children,
    same_bytes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tiers.disk.tier import DiskTier


def test_budget_prunes_least_recently_used_first_across_reopen(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=7, num_blocks=8)
    hashes = [m.block_hash for m in metas]
    budget = 4 * record_size(SMALL, metas[0])
    with DiskTier(tmp_path, SMALL, budget) as tier:
        for meta, payload in zip(metas[:4], payloads[:4]):
            assert sum(tier.put([meta], [payload])) == 1
        assert read_back(tier, metas[0]) is not None  # 0 is now the newest
    with DiskTier(tmp_path, SMALL, budget) as tier:
        assert sum(tier.put(metas[4:5], payloads[4:5])) == 1  # evicts 1, the oldest
        assert tier.contains(hashes[:5]) == [True, False, True, True, True]
        tier.touch([hashes[2]])
    with DiskTier(tmp_path, SMALL, budget) as tier:
        assert sum(tier.put(metas[5:6], payloads[5:6])) == 1  # evicts 3 (2 was touched)
        assert tier.contains(hashes[:6]) == [True, False, True, False, True, True]
        # A batch larger than the budget: the first blocks that fit are kept, never the
        # blocks of the batch itself evicted for the others.
        assert sum(tier.put(metas[1:7], payloads[1:7])) == 4
        stats = tier.stats()
        assert stats.bytes_used <= budget and stats.num_blocks == 4
        # 2, 4, 5 were present; 0 (not in the batch) made room for 1; 3 and 6 are refused.
        assert tier.contains(hashes[1:7]) == [True, True, False, True, True, False]
        assert tier.contains(hashes[:1]) == [False]
        assert stats.refused == 2 and stats.pruned == 2


def test_a_read_is_older_than_a_later_put_of_a_present_block(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=13, num_blocks=5)
    hashes = [m.block_hash for m in metas]
    with DiskTier(tmp_path, SMALL, 3 * record_size(SMALL, metas[0])) as tier:
        for i in (0, 1, 3):  # oldest first: 0, 1, 3
            tier.put(metas[i:i + 1], payloads[i:i + 1])
        assert read_back(tier, metas[0]) is not None  # pending access: 1, 3, 0
        # Re-putting 1 is a later use than the read of 0: 3, 0, 1; block 2 evicts 3.
        assert sum(tier.put([metas[1], metas[2]], [payloads[1], payloads[2]])) == 2
        assert tier.contains(hashes[:4]) == [True, True, True, False]
        # Order now 0, 1, 2: block 4 evicts 0, not 1.
        assert sum(tier.put(metas[4:5], payloads[4:5])) == 1
        assert tier.contains(hashes) == [False, True, True, False, True]


def test_map_full_prunes_or_refuses_without_losing_committed_blocks(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=8, num_blocks=80)
    tier = DiskTier(tmp_path, LARGE, BIG_BUDGET, max_map_bytes=1 << 20,
                    initial_map_bytes=256 << 10)
    with tier:
        for start in range(0, 40, 4):
            batch = slice(start, start + 4)
            num_present = sum(tier.put(metas[batch], payloads[batch]))
            assert num_present == sum(tier.contains([m.block_hash for m in metas[batch]]))
            assert num_present == 4
        stats = tier.stats()
        assert stats.pruned > 0 and stats.num_blocks < 40
        # One batch larger than the whole map: some blocks are refused, nothing raises.
        num_present = sum(tier.put(metas[40:], payloads[40:]))
        assert 0 < num_present < 40 and tier.stats().refused > 0
        assert num_present == sum(tier.contains([m.block_hash for m in metas[40:]]))
        for meta, payload in zip(metas, payloads):
            got = read_back(tier, meta)
            assert got is None or same_bytes(got, payload)
        assert tier.stats().hits >= num_present


def _fill_a_small_disk(path: Path) -> dict:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get short writes / EFBIG, not a kill
    metas, payloads = make_blocks(LARGE, seed=9, num_blocks=50)
    tier = DiskTier(path, LARGE, BIG_BUDGET)
    assert sum(tier.put(metas[:10], payloads[:10])) == 10
    # The file may grow by about 3 blocks more: the disk is "full" long before the budget.
    limit = (path / "data.mdb").stat().st_size + 100_000
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    stored = [sum(tier.put(metas[i:i + 5], payloads[i:i + 5])) for i in range(10, 50, 5)]
    ok = []
    for meta, payload in zip(metas, payloads):
        got = read_back(tier, meta)
        ok.append(got is not None and same_bytes(got, payload))
    stats = tier.stats()
    tier.close()
    return {"stored": stored, "ok": ok, "pruned": stats.pruned, "num_blocks": stats.num_blocks}


def test_writers_growing_the_map_together_prune_nothing_under_budget(tmp_path):
    # Sixteen threads write batches at once into a map that starts at 1 MiB: several of them
    # run out of map together. Each must retry on the map another one grew, not grow it
    # again: the last to grow would find it at its limit and prune blocks that had room.
    metas, payloads = make_blocks(LARGE, seed=23, num_blocks=512)
    total = sum(record_size(LARGE, meta) for meta in metas)
    with DiskTier(tmp_path, LARGE, 2 * total, initial_map_bytes=1 << 20,
                  max_map_bytes=3 * total) as tier:
        start = threading.Barrier(16)

        def write(thread: int) -> None:
            start.wait()
            for i in range(thread * 32, thread * 32 + 32, 8):
                assert sum(tier.put(metas[i:i + 8], payloads[i:i + 8])) == 8

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(write, range(16)))
        stats = tier.stats()
        assert stats.pruned == 0 and stats.refused == 0 and stats.num_blocks == 512
        assert tier.contains([m.block_hash for m in metas]) == [True] * 512


def test_full_disk_prunes_instead_of_crashing(tmp_path):
    (report,) = run_in_children((_fill_a_small_disk, tmp_path))
    assert report["pruned"] > 0
    assert report["stored"] == [5] * 8  # every batch was stored, by pruning older blocks
    assert report["ok"][-5:] == [True] * 5  # the newest batch is readable
    assert sum(report["ok"]) == report["num_blocks"]


class LruModel:
    """The truth the tier must match: an LRU of equal-sized records under a byte budget,
    with reads' access updates applied at the next write (as the tier batches them)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: dict[bytes, int] = {}  # hash -> payload index, oldest first
        self.pending: dict[bytes, None] = {}

    def _use(self, block_hash: bytes) -> None:
        if block_hash in self.order:
            self.order[block_hash] = self.order.pop(block_hash)

    def _flush(self) -> None:
        for block_hash in self.pending:
            self._use(block_hash)
        self.pending.clear()

    def put(self, batch: list[tuple[bytes, int]]) -> int:
        self._flush()
        batch_hashes = {h for h, _ in batch}
        new = [(h, i) for h, i in batch if h not in self.order]
        for h, _ in batch:
            self._use(h)
        over = len(self.order) + len(new) - self.capacity
        for victim in [h for h in self.order if h not in batch_hashes][:max(over, 0)]:
            del self.order[victim]
        for h, i in new[:self.capacity - len(self.order)]:
            self.order[h] = i
        return sum(h in self.order for h in batch_hashes)

    def get(self, block_hash: bytes) -> int | None:
        if block_hash not in self.order:
            return None
        self.pending.pop(block_hash, None)
        self.pending[block_hash] = None
        return self.order[block_hash]

    def delete(self, block_hashes: list[bytes]) -> int:
        self._flush()
        return sum(self.order.pop(h, None) is not None for h in block_hashes)


# Few distinct blocks and small batches, so that hits, re-puts and evictions interleave.
OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.lists(st.integers(0, 6), min_size=1, max_size=3)),
    st.tuples(st.just("put"), st.lists(st.integers(0, 6), min_size=1, max_size=3)),
    st.tuples(st.just("get"), st.integers(0, 6)),
    st.tuples(st.just("get"), st.integers(0, 6)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, 6), max_size=2)),
    st.tuples(st.just("reopen"), st.just(0)),
), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, capacity=st.integers(1, 5))
def test_matches_an_lru_model(tmp_path_factory, ops, capacity):
    path = tmp_path_factory.mktemp("model")
    metas, payloads = make_blocks(SMALL, seed=30, num_blocks=7)
    budget = capacity * record_size(SMALL, metas[0])
    model = LruModel(capacity)
    tier = DiskTier(path, SMALL, budget, touch_flush_every=1000)
    try:
        for op, arg in ops:
            if op == "put":
                batch = list(dict.fromkeys(arg))  # distinct, in order
                assert sum(tier.put([metas[i] for i in batch], [payloads[i] for i in batch])) == \
                    model.put([(metas[i].block_hash, i) for i in batch])
            elif op == "get":
                expected = model.get(metas[arg].block_hash)
                got = read_back(tier, metas[arg])
                assert (got is None) == (expected is None)
                assert got is None or same_bytes(got, payloads[expected])
            elif op == "delete":
                assert tier.delete([metas[i].block_hash for i in arg]) == \
                    model.delete([metas[i].block_hash for i in arg])
            else:
                tier.close()
                model._flush()
                tier = DiskTier(path, SMALL, budget, touch_flush_every=1000)
            assert tier.contains([m.block_hash for m in metas]) == \
                [m.block_hash in model.order for m in metas]
        stats = tier.stats()
        assert stats.num_blocks == len(model.order) <= capacity
        assert stats.bytes_used == len(model.order) * record_size(SMALL, metas[0])
    finally:
        tier.close()


def test_reads_and_close_survive_a_map_with_no_room_for_access_order(tmp_path):
    # Fill a map that cannot grow until stores must prune: recording accesses then has
    # little or no room either. Reads still return the committed bytes and close does not
    # raise; only the (advisory) access order is not updated.
    metas, payloads = make_blocks(LARGE, seed=9, num_blocks=64)
    tier = DiskTier(tmp_path, LARGE, BIG_BUDGET, max_map_bytes=1 << 20,
                    initial_map_bytes=1 << 20, touch_flush_every=1)
    for start in range(0, 64, 8):
        tier.put(metas[start:start + 8], payloads[start:start + 8])
    assert tier.stats().pruned > 0
    present = [m for m, ok in zip(metas, tier.contains([m.block_hash for m in metas])) if ok]
    assert present
    by_hash = {m.block_hash: p for m, p in zip(metas, payloads)}
    for meta in present:
        got = read_back(tier, meta)
        assert got is not None and same_bytes(got, by_hash[meta.block_hash])
    tier.close()


def test_a_writable_map_starts_at_its_limit_and_never_resizes(tmp_path):
    """A resize waits for every transaction (a background sync included) while lookups
    queue behind it: a writable tier maps its whole limit at open, address space only (the
    file grows with the pages written); a read-only one maps what its file holds."""
    metas, payloads = make_blocks(LARGE, seed=23, num_blocks=64)
    budget = 64 * record_size(LARGE, metas[0])
    limit = budget + budget // 4 + (64 << 20)
    with DiskTier(tmp_path, LARGE, budget) as tier:
        assert tier._map.map_size == limit
        file_bytes = (tmp_path / "data.mdb").stat().st_size
        assert file_bytes < limit // 8
        for k in range(0, 64, 8):
            tier.put(metas[k:k + 8], payloads[k:k + 8])
        assert tier._map.map_size == limit and tier.stats().num_blocks == 64
    with DiskTier(tmp_path, LARGE, 1 << 50, readonly=True) as reader:  # a petabyte budget
        assert reader._map.map_size < 1 << 40
        assert all(same_bytes(read_back(reader, m), p) for m, p in zip(metas, payloads))
