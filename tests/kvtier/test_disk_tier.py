"""DiskTier on real LMDB directories: exact bytes, restarts, several processes and threads,
damaged values, old formats, the byte budget, a full map and a full disk."""

from __future__ import annotations

import multiprocessing
import random
import resource
import signal
import struct
import threading
import traceback
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import BlockMeta, encode_header, encode_record, metas_for

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
# 32 KiB blocks: LMDB stores them on overflow pages, like real blocks.
LARGE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
BIG_BUDGET = 1 << 30


def make_blocks(layout: KVLayout, seed: int, num_blocks: int
                ) -> tuple[list[BlockMeta], list[torch.Tensor]]:
    """`num_blocks` chained blocks of one sequence with seeded random K/V, `[*block_shape]`."""
    parent = namespace_hash(f"model-{seed}", layout)
    token_ids = [(seed * 7919 + 31 * i) % 50_000 for i in range(num_blocks * layout.block_size)]
    hashes = hash_blocks(parent, token_ids, layout.block_size)
    metas = metas_for(parent, hashes, token_ids, layout.block_size)
    generator = torch.Generator().manual_seed(seed)
    payloads = [torch.randn(layout.block_shape, generator=generator).to(layout.dtype)
                for _ in metas]
    return metas, payloads


def record_size(layout: KVLayout, meta: BlockMeta) -> int:
    return len(encode_header(meta, layout, layout.bytes_per_block, 0)) + layout.bytes_per_block


def read_back(tier: DiskTier, meta: BlockMeta) -> torch.Tensor | None:
    dest = torch.empty(tier.layout.block_shape, dtype=tier.layout.dtype)
    return dest if tier.get_into(meta, dest) else None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()


def run_in_children(*calls) -> list:
    """Run each `(function, *args)` in its own forked process, all at once; their results.

    Forking (not spawning) keeps a child's start cheap: it does not import torch again. Each
    child opens its own LMDB environment; none is open in this process while they run.
    """
    context = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for function, *args in calls:
        receiver, sender = context.Pipe(duplex=False)
        proc = context.Process(target=_child_main, args=(sender, function, args))
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    results = []
    for receiver, proc in zip(pipes, procs):
        assert receiver.poll(120), "a child process did not answer within 120 s"
        ok, value = receiver.recv()
        proc.join(30)
        assert ok, f"child failed:\n{value}"
        assert proc.exitcode == 0
        results.append(value)
    return results


def _child_main(sender, function, args) -> None:
    try:
        sender.send((True, function(*args)))
    except BaseException:
        sender.send((False, traceback.format_exc()))
    finally:
        sender.close()


class RawLmdb:
    """Direct access to a closed tier's LMDB files, to damage values as a bad disk would."""

    def __init__(self, path: Path) -> None:
        self.env = lmdb.open(str(path), max_dbs=8, map_size=1 << 28)
        self.blocks = self.env.open_db(b"blocks")
        self.meta = self.env.open_db(b"meta")

    def get(self, key: bytes) -> bytes:
        with self.env.begin() as txn:
            return txn.get(key, db=self.blocks)

    def put(self, key: bytes, value: bytes, db: str = "blocks") -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, value, db=self.blocks if db == "blocks" else self.meta)

    def total_value_bytes(self) -> int:
        with self.env.begin() as txn:
            return sum(len(value) for _, value in txn.cursor(db=self.blocks))

    def close(self) -> None:
        self.env.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_put_get_is_byte_exact_for_every_payload_kind(tmp_path, dtype):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype=dtype)
    metas, payloads = make_blocks(layout, seed=1, num_blocks=8)
    # The same bytes arrive as a tensor, numpy array, bytes, memoryview.
    kinds = [payloads[0], payloads[1].view(torch.uint8).numpy(),
             payloads[2].view(torch.uint8).numpy().tobytes(),
             memoryview(payloads[3].view(torch.uint8).numpy()), *payloads[4:]]
    with DiskTier(tmp_path / "cache", layout, BIG_BUDGET) as tier:
        assert tier.put(metas, kinds) == len(metas)
        for meta, payload in zip(metas, payloads):
            got = read_back(tier, meta)
            assert got is not None and same_bytes(got, payload)
        # A batch read into uint8 host slots.
        slots = torch.empty((len(metas), layout.bytes_per_block), dtype=torch.uint8)
        assert tier.get_many_into(metas, list(slots)) == [True] * len(metas)
        for slot, payload in zip(slots, payloads):
            assert slot.numpy().tobytes() == payload.view(torch.uint8).numpy().tobytes()
        stats = tier.stats()
    assert (stats.num_blocks, stats.puts, stats.hits, stats.misses) == (8, 8, 16, 0)
    assert stats.bytes_used == sum(record_size(layout, m) for m in metas)


def test_existing_hashes_are_kept_and_bad_arguments_raise(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=2, num_blocks=3)
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert tier.put(metas[:2], payloads[:2]) == 2
        # Re-putting block 0 with other bytes keeps the stored bytes; the batch reports 3.
        assert tier.put(metas, [payloads[2], payloads[1], payloads[2]]) == 3
        assert same_bytes(read_back(tier, metas[0]), payloads[0])
        assert tier.stats().puts == 3
        with pytest.raises(ValueError, match="bytes"):
            tier.put(metas[:1], [b"\0" * (SMALL.bytes_per_block - 1)])
        with pytest.raises(ValueError, match="payloads"):
            tier.put(metas, payloads[:1])
        with pytest.raises(ValueError, match="contiguous"):
            tier.get_into(metas[0], torch.empty(SMALL.block_shape).transpose(0, 1))
        with pytest.raises(ValueError, match="bytes"):
            tier.get_into(metas[0], torch.empty(3, dtype=torch.uint8))
        assert tier.delete([metas[0].block_hash, b"x" * 16]) == 1
        assert tier.contains([m.block_hash for m in metas]) == [False, True, True]
    tier.close()  # a second close is harmless
    with pytest.raises(ValueError, match="closed"):
        tier.contains([metas[0].block_hash])


def _write_blocks(path: Path, seed: int, num_blocks: int) -> int:
    metas, payloads = make_blocks(LARGE, seed, num_blocks)
    with DiskTier(path, LARGE, BIG_BUDGET) as tier:
        num_present = tier.put(metas, payloads)
        assert read_back(tier, metas[0]) is not None  # block 0 is now the newest
    return num_present


def test_blocks_survive_a_process_restart(tmp_path):
    # Another process writes 12 blocks and exits.
    assert run_in_children((_write_blocks, tmp_path, 3, 12)) == [12]
    # This one reads them all back, read-only.
    metas, payloads = make_blocks(LARGE, seed=3, num_blocks=12)
    with DiskTier(tmp_path, LARGE, BIG_BUDGET, readonly=True) as tier:
        for meta, payload in zip(metas, payloads):
            assert same_bytes(read_back(tier, meta), payload)
    # The access order was written too: block 0 is the newest, block 1 the oldest.
    with DiskTier(tmp_path, LARGE, 12 * record_size(LARGE, metas[0])) as tier:
        extra, extra_payloads = make_blocks(LARGE, seed=4, num_blocks=1)
        assert tier.put(extra, extra_payloads) == 1
        assert tier.contains([metas[0].block_hash, metas[1].block_hash]) == [True, False]


def _write_and_read_other(path: Path, own: int, other: int) -> dict:
    metas, payloads = make_blocks(LARGE, seed=own, num_blocks=30)
    other_metas, other_payloads = make_blocks(LARGE, seed=other, num_blocks=30)
    seen = wrong = 0
    with DiskTier(path, LARGE, BIG_BUDGET, initial_map_bytes=1 << 20) as tier:
        for start in range(0, 30, 3):
            assert tier.put(metas[start:start + 3], payloads[start:start + 3]) == 3
            for meta, payload in zip(other_metas, other_payloads):
                got = read_back(tier, meta)
                if got is not None:
                    seen += 1
                    wrong += not same_bytes(got, payload)
    return {"seen": seen, "wrong": wrong}


def test_two_processes_share_one_directory(tmp_path):
    # Two processes write their own blocks and read the other's, at the same time; both
    # start with a small map, so each grows it under the other's feet.
    reports = run_in_children((_write_and_read_other, tmp_path, 10, 11),
                              (_write_and_read_other, tmp_path, 11, 10))
    assert [report["wrong"] for report in reports] == [0, 0]
    with DiskTier(tmp_path, LARGE, BIG_BUDGET) as tier:
        for seed in (10, 11):
            metas, payloads = make_blocks(LARGE, seed=seed, num_blocks=30)
            for meta, payload in zip(metas, payloads):
                assert same_bytes(read_back(tier, meta), payload)
        assert tier.stats().num_blocks == 60


def _store_wrong_tokens(meta, payload):
    tokens = meta.token_ids[:-1] + (meta.token_ids[-1] + 1,)  # what a hash collision looks like
    return encode_record(BlockMeta(meta.block_hash, meta.parent_hash, tokens), SMALL, payload)


def _old_record_version(meta, payload):
    record = bytearray(encode_record(meta, SMALL, payload))
    record[4:6] = struct.pack("<H", 0)
    return bytes(record)


DAMAGES = {
    "payload byte flipped": lambda value, meta, payload: value[:-7] + bytes([value[-7] ^ 1])
    + value[-6:],
    "header byte flipped": lambda value, meta, payload: value[:50] + bytes([value[50] ^ 4])
    + value[51:],
    "truncated": lambda value, meta, payload: value[:-100],
    "foreign layout": lambda value, meta, payload: encode_record(
        meta, KVLayout(2, 2, 16, 4, torch.bfloat16), payload),
    "wrong token ids": lambda value, meta, payload: _store_wrong_tokens(meta, payload),
    "old record version": lambda value, meta, payload: _old_record_version(meta, payload),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_values_are_misses_deleted_and_counted(tmp_path, damage):
    metas, payloads = make_blocks(SMALL, seed=5, num_blocks=3)
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert tier.put(metas, payloads) == 3
    raw = RawLmdb(tmp_path)
    key = metas[1].block_hash
    raw.put(key, DAMAGES[damage](raw.get(key), metas[1], payloads[1].view(torch.uint8).numpy()))
    raw.close()
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert tier.contains([key]) == [True]  # contains does not validate
        assert read_back(tier, metas[1]) is None
        stats = tier.stats()
        assert (stats.rejected, stats.misses, stats.hits) == (1, 1, 0)
        assert tier.contains([m.block_hash for m in metas]) == [True, False, True]
        assert same_bytes(read_back(tier, metas[2]), payloads[2])
        assert stats.num_blocks == 2
        bytes_used = stats.bytes_used
    raw = RawLmdb(tmp_path)
    if damage not in ("truncated", "wrong token ids"):  # same length: the counter still adds up
        assert raw.total_value_bytes() == bytes_used
    raw.close()


def test_another_disk_format_is_never_served(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=6, num_blocks=4)
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        tier.put(metas, payloads)
    raw = RawLmdb(tmp_path)
    raw.put(b"format_version", struct.pack("<H", 0), db="meta")
    raw.close()
    # A reader serves nothing and changes nothing.
    with DiskTier(tmp_path, SMALL, BIG_BUDGET, readonly=True) as tier:
        assert tier.contains([m.block_hash for m in metas]) == [False] * 4
        assert read_back(tier, metas[0]) is None
        assert tier.stats().num_blocks == 4
    # A writer starts fresh and says so.
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert tier.format_reset
        assert tier.stats().num_blocks == 0 and tier.stats().bytes_used == 0
        assert tier.put(metas[:1], payloads[:1]) == 1
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert not tier.format_reset
        assert same_bytes(read_back(tier, metas[0]), payloads[0])


def test_budget_prunes_least_recently_used_first_across_reopen(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=7, num_blocks=8)
    hashes = [m.block_hash for m in metas]
    budget = 4 * record_size(SMALL, metas[0])
    with DiskTier(tmp_path, SMALL, budget) as tier:
        for meta, payload in zip(metas[:4], payloads[:4]):
            assert tier.put([meta], [payload]) == 1
        assert read_back(tier, metas[0]) is not None  # 0 is now the newest
    with DiskTier(tmp_path, SMALL, budget) as tier:
        assert tier.put(metas[4:5], payloads[4:5]) == 1  # evicts 1, the oldest
        assert tier.contains(hashes[:5]) == [True, False, True, True, True]
        tier.touch([hashes[2]])
    with DiskTier(tmp_path, SMALL, budget) as tier:
        assert tier.put(metas[5:6], payloads[5:6]) == 1  # evicts 3 (2 was touched)
        assert tier.contains(hashes[:6]) == [True, False, True, False, True, True]
        # A batch larger than the budget: the first blocks that fit are kept, never the
        # blocks of the batch itself evicted for the others.
        assert tier.put(metas[1:7], payloads[1:7]) == 4
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
        assert tier.put([metas[1], metas[2]], [payloads[1], payloads[2]]) == 2
        assert tier.contains(hashes[:4]) == [True, True, True, False]
        # Order now 0, 1, 2: block 4 evicts 0, not 1.
        assert tier.put(metas[4:5], payloads[4:5]) == 1
        assert tier.contains(hashes) == [False, True, True, False, True]


def test_map_full_prunes_or_refuses_without_losing_committed_blocks(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=8, num_blocks=80)
    tier = DiskTier(tmp_path, LARGE, BIG_BUDGET, max_map_bytes=1 << 20,
                    initial_map_bytes=256 << 10)
    with tier:
        for start in range(0, 40, 4):
            batch = slice(start, start + 4)
            num_present = tier.put(metas[batch], payloads[batch])
            assert num_present == sum(tier.contains([m.block_hash for m in metas[batch]]))
            assert num_present == 4
        stats = tier.stats()
        assert stats.pruned > 0 and stats.num_blocks < 40
        # One batch larger than the whole map: some blocks are refused, nothing raises.
        num_present = tier.put(metas[40:], payloads[40:])
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
    assert tier.put(metas[:10], payloads[:10]) == 10
    # The file may grow by about 3 blocks more: the disk is "full" long before the budget.
    limit = (path / "data.mdb").stat().st_size + 100_000
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    stored = [tier.put(metas[i:i + 5], payloads[i:i + 5]) for i in range(10, 50, 5)]
    ok = []
    for meta, payload in zip(metas, payloads):
        got = read_back(tier, meta)
        ok.append(got is not None and same_bytes(got, payload))
    stats = tier.stats()
    tier.close()
    return {"stored": stored, "ok": ok, "pruned": stats.pruned, "num_blocks": stats.num_blocks}


def test_full_disk_prunes_instead_of_crashing(tmp_path):
    (report,) = run_in_children((_fill_a_small_disk, tmp_path))
    assert report["pruned"] > 0
    assert report["stored"] == [5] * 8  # every batch was stored, by pruning older blocks
    assert report["ok"][-5:] == [True] * 5  # the newest batch is readable
    assert sum(report["ok"]) == report["num_blocks"]


def test_threads_put_and_get_at_once(tmp_path):
    num_threads, num_blocks = 4, 24
    blocks = [make_blocks(LARGE, seed=20 + t, num_blocks=num_blocks) for t in range(num_threads)]
    budget = num_threads * num_blocks * record_size(LARGE, blocks[0][0][0]) // 2
    # A small first map makes the map grow while other threads are inside transactions.
    tier = DiskTier(tmp_path, LARGE, budget, initial_map_bytes=256 << 10, touch_flush_every=8)
    errors: list[BaseException] = []
    wrong = []

    def worker(index: int) -> None:
        rng = random.Random(index)
        metas, payloads = blocks[index]
        try:
            for start in range(0, num_blocks, 2):
                tier.put(metas[start:start + 2], payloads[start:start + 2])
                other_metas, other_payloads = blocks[rng.randrange(num_threads)]
                for i in rng.sample(range(num_blocks), 4):
                    got = read_back(tier, other_metas[i])
                    if got is not None and not same_bytes(got, other_payloads[i]):
                        wrong.append(other_metas[i])
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and not wrong
    with tier:
        stats = tier.stats()
        assert stats.bytes_used <= budget and stats.rejected == 0
        assert stats.num_blocks * record_size(LARGE, blocks[0][0][0]) == stats.bytes_used
        assert stats.puts == stats.num_blocks + stats.pruned
        present = 0
        for metas, payloads in blocks:
            for meta, payload in zip(metas, payloads):
                got = read_back(tier, meta)
                present += got is not None
                assert got is None or same_bytes(got, payload)
        assert present == stats.num_blocks


def test_read_only_tier_stores_nothing(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=12, num_blocks=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DiskTier(tmp_path / "missing", SMALL, BIG_BUDGET, readonly=True)
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        tier.put(metas[:1], payloads[:1])
    with DiskTier(tmp_path, SMALL, BIG_BUDGET, readonly=True) as tier:
        assert tier.put(metas, payloads) == 1
        assert tier.stats().refused == 1 and tier.stats().num_blocks == 1
        with pytest.raises(ValueError, match="read-only"):
            tier.delete([metas[0].block_hash])


def test_refuses_a_bad_directory(tmp_path):
    file_path = tmp_path / "file"
    file_path.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        DiskTier(file_path, SMALL, BIG_BUDGET)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        DiskTier(shared, SMALL, BIG_BUDGET)
    with pytest.raises(ValueError, match="budget_bytes"):
        DiskTier(tmp_path / "ok", SMALL, 0)
    with DiskTier(tmp_path / "new" / "cache", SMALL, BIG_BUDGET):
        pass
    assert (tmp_path / "new" / "cache").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "new" / "cache" / "data.mdb").stat().st_mode & 0o777 == 0o600


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
                assert tier.put([metas[i] for i in batch], [payloads[i] for i in batch]) == \
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
    # little or no room either. Reads still return the committed bytes and close does not raise; only the
    # (advisory) access order is not updated.
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
