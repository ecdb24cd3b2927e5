"""DiskTier on real LMDB directories: exact bytes, bad arguments, restarts, several
processes and threads, damaged values, old formats, read-only tiers and bad directories.
The byte budget, a full map and a full disk are in test_disk_tier_limits.py; the shared
builders in disk_cases.py."""

from __future__ import annotations

import os
import random
import struct
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch
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

from kvtier.layout import KVLayout
from kvtier.tiers.disk.index import DataFileWatch
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_record


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
        assert sum(tier.put(metas, kinds)) == len(metas)
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
        assert sum(tier.put(metas[:2], payloads[:2])) == 2
        # Re-putting block 0 with other bytes keeps the stored bytes; the batch reports 3.
        assert sum(tier.put(metas, [payloads[2], payloads[1], payloads[2]])) == 3
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
        num_present = sum(tier.put(metas, payloads))
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
        assert sum(tier.put(extra, extra_payloads)) == 1
        assert tier.contains([metas[0].block_hash, metas[1].block_hash]) == [True, False]


def _write_and_read_other(path: Path, own: int, other: int) -> dict:
    metas, payloads = make_blocks(LARGE, seed=own, num_blocks=30)
    other_metas, other_payloads = make_blocks(LARGE, seed=other, num_blocks=30)
    seen = wrong = 0
    with DiskTier(path, LARGE, BIG_BUDGET, initial_map_bytes=1 << 20) as tier:
        for start in range(0, 30, 3):
            assert sum(tier.put(metas[start:start + 3], payloads[start:start + 3])) == 3
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
        assert sum(tier.put(metas, payloads)) == 3
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
        assert sum(tier.put(metas[:1], payloads[:1])) == 1
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        assert not tier.format_reset
        assert same_bytes(read_back(tier, metas[0]), payloads[0])


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
        assert sum(tier.put(metas, payloads)) == 1
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



def _bytes_fetched() -> int:
    """Bytes this process has made the kernel read from storage (page faults included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def _evict_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _storage_reads_are_counted(tmp_path: Path) -> bool:
    """Whether a cold read of a file here shows in `_bytes_fetched` (not on tmpfs, or
    without I/O accounting)."""
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(1 << 20))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = _bytes_fetched()
        os.pread(fd, 1 << 20, 0)
        return _bytes_fetched() - before >= 1 << 19
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_lookups_read_no_values_and_reads_read_each_value_once(tmp_path):
    # py-lmdb's get touches every page of a value: a lookup that used it would read whole
    # blocks from disk to answer yes or no, and a read would fetch each block twice.
    if not _storage_reads_are_counted(tmp_path):
        pytest.skip("cold reads of this filesystem are not counted in /proc/self/io")
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16,
                      dtype=torch.float32)  # 256 KiB blocks
    metas, payloads = make_blocks(layout, seed=3, num_blocks=24)
    with DiskTier(tmp_path, layout, BIG_BUDGET) as tier:
        assert sum(tier.put(metas, payloads)) == len(metas)
    stored = len(metas) * layout.bytes_per_block
    _evict_from_page_cache(tmp_path / "data.mdb")
    with DiskTier(tmp_path, layout, BIG_BUDGET) as tier:
        before = _bytes_fetched()
        assert tier.contains([m.block_hash for m in metas]) == [True] * len(metas)
        looked_up = _bytes_fetched() - before
        dests = [torch.empty(layout.bytes_per_block, dtype=torch.uint8) for _ in metas]
        assert tier.get_many_into(metas, dests) == [True] * len(metas)
        read = _bytes_fetched() - before - looked_up
    for dest, payload in zip(dests, payloads):
        assert same_bytes(dest, payload)
    assert looked_up < stored // 8, f"a lookup read {looked_up} of {stored} stored bytes"
    assert read < stored * 5 // 4, f"reading {stored} bytes fetched {read}"


def test_checks_on_several_threads_while_the_file_grows_see_no_cut(tmp_path):
    # Writers grow data.mdb while lookups, reads and writes each check it first: a check must
    # never take the file for one cut short because another thread saw it larger meanwhile.
    path = tmp_path / "data.mdb"
    path.write_bytes(bytes(4096))
    watch = DataFileWatch(path)
    stop = threading.Event()
    found: list[str] = []

    def grow() -> None:
        with open(path, "ab") as f:
            while not stop.is_set():
                f.write(bytes(4096))
                f.flush()

    def check() -> None:
        while not stop.is_set():
            what = watch.check()
            if what is not None:
                found.append(what)
                return

    threads = [threading.Thread(target=grow)] + [threading.Thread(target=check)
                                                  for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    watch.close()
    assert found == []


def test_the_lookup_thread_runs_before_the_first_lookup(tmp_path):
    # Started at the first call, it put its own start (milliseconds on a loaded machine)
    # on a fresh engine's first prefix lookup.
    with DiskTier(tmp_path, SMALL, BIG_BUDGET) as tier:
        deadline = time.monotonic() + 10
        while not any(t.name.startswith("kvtier-disk-lookup") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "no lookup thread after the tier opened"
            time.sleep(0.01)
        metas, payloads = make_blocks(SMALL, seed=4, num_blocks=2)
        tier.put(metas[:1], payloads[:1])
        assert tier.contains([m.block_hash for m in metas]) == [True, False]
