"""Damaged disk values are detected, never served, counted and removed.

Values are damaged with LMDB directly, as a failing disk, a buggy writer or someone with
write access to the files would: every single byte of a header flipped in turn, payload
bytes flipped, values cut short or extended, records written for another model or layout,
an old record version, and whole directories of another disk format or not LMDB at all.
The tier manager then treats each damaged block as a miss (the caller recomputes it),
counts it, deletes it, and keeps serving the intact blocks around it byte for byte.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manager_cases import check_idle, load

from kvtier.config import TierConfig
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Tier
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_header, encode_record, metas_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
OTHER_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4,
                        dtype=torch.bfloat16)  # same bytes per block, another layout
BUDGET = 1 << 26


def sequence(model_id: str, num_blocks: int, first_token: int = 3) -> list[BlockMeta]:
    """Metas of one chained sequence of `model_id`."""
    parent = namespace_hash(model_id, LAYOUT)
    token_ids = [first_token + i for i in range(num_blocks * LAYOUT.block_size)]
    return metas_for(parent, hash_blocks(parent, token_ids, LAYOUT.block_size), token_ids,
                     LAYOUT.block_size)


def random_payloads(num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, *block_shape] random bit patterns (NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * LAYOUT.bytes_per_block,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(LAYOUT.dtype).view(num_blocks, *LAYOUT.block_shape)


def as_bytes(payload: torch.Tensor) -> bytes:
    return payload.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def header_len(meta: BlockMeta) -> int:
    return len(encode_header(meta, LAYOUT, LAYOUT.bytes_per_block, 0))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class RawValues:
    """The `blocks` database of a closed disk tier, opened with LMDB directly."""

    def __init__(self, path: Path) -> None:
        self.env = lmdb.open(str(path), max_dbs=8, map_size=BUDGET * 2)
        self.blocks = self.env.open_db(b"blocks")
        self.meta = self.env.open_db(b"meta")

    def __enter__(self) -> RawValues:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.env.close()

    def get(self, key: bytes) -> bytes:
        with self.env.begin() as txn:
            value = txn.get(key, db=self.blocks)
        assert value is not None, "test setup: the block is not stored"
        return bytes(value)

    def put(self, key: bytes, value: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key, value, db=self.blocks)

    def put_meta(self, key: bytes, value: bytes | None) -> None:
        with self.env.begin(write=True) as txn:
            if value is None:
                txn.delete(key, db=self.meta)
            else:
                txn.put(key, value, db=self.meta)


def store(path: Path, metas: list[BlockMeta], payloads: torch.Tensor) -> None:
    with DiskTier(path, LAYOUT, BUDGET) as tier:
        assert sum(tier.put(metas, list(payloads))) == len(metas)


def flip(value: bytes, offset: int, mask: int = 0x01) -> bytes:
    return value[:offset] + bytes([value[offset] ^ mask]) + value[offset + 1:]


# ---- the disk tier alone -------------------------------------------------------------------

def test_every_header_byte_and_sampled_payload_bytes_are_covered(tmp_path):
    """Each block gets one byte flipped: every header byte in turn (magic, version, layout,
    lengths, parent hash, token ids, the header checksum itself), then payload bytes at the
    start, the end and in between. None is served; all are rejected and deleted; intact
    blocks stored next to them are still served byte for byte."""
    num_header = header_len(sequence("m", 1)[0])
    payload_offsets = [0, 1, LAYOUT.bytes_per_block // 2, LAYOUT.bytes_per_block - 1]
    num_damaged = num_header + len(payload_offsets)
    metas = sequence("m", num_damaged + 2)
    payloads = random_payloads(len(metas), seed=1)
    store(tmp_path, metas, payloads)
    offsets = list(range(num_header)) + [num_header + o for o in payload_offsets]
    with RawValues(tmp_path) as raw:
        for meta, offset in zip(metas, offsets):
            raw.put(meta.block_hash, flip(raw.get(meta.block_hash), offset, mask=0x10))
    with DiskTier(tmp_path, LAYOUT, BUDGET) as tier:
        dests = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in metas]
        results = tier.get_many_into(metas, dests)
        assert results == [False] * num_damaged + [True, True]
        assert same_bytes(dests[-1], payloads[-1]) and same_bytes(dests[-2], payloads[-2])
        stats = tier.stats()
        assert stats.rejected == num_damaged and stats.hits == 2
        assert tier.contains([m.block_hash for m in metas]) == [False] * num_damaged + [True] * 2
        assert stats.num_blocks == 2


def _truncations(value: bytes, num_header: int) -> dict[str, bytes]:
    return {
        "empty": b"",
        "magic only": value[:4],
        "fixed header cut": value[:num_header // 2],
        "no header checksum": value[:num_header - 8],
        "header without payload": value[:num_header],
        "one payload byte short": value[:-1],
        "one byte too many": value + b"\x00",
        "payload twice": value + value[num_header:],
    }


def test_cut_and_extended_values_are_misses(tmp_path):
    metas = sequence("m", 9)
    payloads = random_payloads(len(metas), seed=2)
    store(tmp_path, metas, payloads)
    num_header = header_len(metas[0])
    with RawValues(tmp_path) as raw:
        for meta, name in zip(metas, _truncations(b"", num_header)):
            raw.put(meta.block_hash, _truncations(raw.get(meta.block_hash), num_header)[name])
    with DiskTier(tmp_path, LAYOUT, BUDGET) as tier:
        dests = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in metas]
        assert tier.get_many_into(metas, dests) == [False] * 8 + [True]
        assert same_bytes(dests[-1], payloads[-1])
        assert tier.stats().rejected == 8 and tier.stats().num_blocks == 1
        # The byte counter followed the deletes of values whose length had changed.
        record = encode_record(metas[-1], LAYOUT, as_bytes(payloads[-1]))
        assert tier.stats().bytes_used == len(record)


def test_values_grown_behind_the_tiers_back_do_not_wedge_it(tmp_path):
    """Values made longer outside kvtier leave the byte counter short of the truth. Removing
    them (as rejected reads, or as pruned victims) must neither fail nor leave the counter
    wrong: the tier counts the values again."""
    metas = sequence("m", 6)
    payloads = random_payloads(6, seed=7)
    record_bytes = len(encode_record(metas[0], LAYOUT, as_bytes(payloads[0])))
    budget = 4 * record_bytes
    with DiskTier(tmp_path, LAYOUT, budget) as tier:
        assert sum(tier.put(metas[:4], list(payloads[:4]))) == 4
    with RawValues(tmp_path) as raw:
        for meta in metas[:4]:
            raw.put(meta.block_hash, raw.get(meta.block_hash) * 4)
    with DiskTier(tmp_path, LAYOUT, budget) as tier:
        dest = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
        assert not tier.get_into(metas[0], dest)  # rejected and removed
        assert tier.stats().bytes_used == 3 * 4 * record_bytes  # the truth, recounted
        # Two new blocks prune the grown ones (the oldest) to fit the budget.
        assert sum(tier.put(metas[4:], list(payloads[4:]))) == 2
        assert tier.contains([m.block_hash for m in metas]) == [False] * 4 + [True] * 2
        assert tier.stats().bytes_used == 2 * record_bytes
        for meta, payload in zip(metas[4:], payloads[4:]):
            assert tier.get_into(meta, dest) and same_bytes(dest, payload)


def test_records_of_another_model_layout_or_version_are_misses(tmp_path):
    """Well-formed records with valid checksums, but not the block asked for."""
    mine = sequence("model-a", 5)
    theirs = sequence("model-b", 5)  # the same token ids under another model's namespace
    payloads = random_payloads(5, seed=3)
    store(tmp_path, mine, payloads)
    old_version = bytearray(encode_record(mine[3], LAYOUT, as_bytes(payloads[3])))
    old_version[4:6] = struct.pack("<H", 0)
    impostors = {
        0: encode_record(BlockMeta(mine[0].block_hash, theirs[0].parent_hash,
                                   theirs[0].token_ids), LAYOUT, as_bytes(payloads[0])),
        1: encode_record(theirs[1], LAYOUT, as_bytes(payloads[1])),  # B's block under A's key
        2: encode_record(mine[2], OTHER_LAYOUT, as_bytes(payloads[2])),  # right block, other layout
        3: bytes(old_version),
    }
    with RawValues(tmp_path) as raw:
        for i, value in impostors.items():
            raw.put(mine[i].block_hash, value)
    with DiskTier(tmp_path, LAYOUT, BUDGET) as tier:
        dests = [torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in mine]
        assert tier.get_many_into(mine, dests) == [False] * 4 + [True]
        assert tier.stats().rejected == 4
        assert tier.contains([m.block_hash for m in mine]) == [False] * 4 + [True]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_is_a_miss_never_other_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("damage")
    metas = sequence("prop", 2)
    payloads = random_payloads(2, seed=data.draw(st.integers(0, 1000), label="seed"))
    store(path, metas, payloads)
    with RawValues(path) as raw:
        value = raw.get(metas[0].block_hash)
        kind = data.draw(st.sampled_from(["flip", "cut", "append", "splice"]), label="kind")
        if kind == "flip":
            offset = data.draw(st.integers(0, len(value) - 1), label="offset")
            value = flip(value, offset, data.draw(st.integers(1, 255), label="mask"))
        elif kind == "cut":
            value = value[:data.draw(st.integers(0, len(value) - 1), label="length")]
        elif kind == "append":
            value += data.draw(st.binary(min_size=1, max_size=64), label="tail")
        else:  # the other block's payload behind this block's header
            value = value[:header_len(metas[0])] + raw.get(metas[1].block_hash)[
                header_len(metas[1]):]
        raw.put(metas[0].block_hash, value)
    with DiskTier(path, LAYOUT, BUDGET) as tier:
        dest = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
        assert not tier.get_into(metas[0], dest)
        assert tier.stats().rejected == 1 and tier.contains([metas[0].block_hash]) == [False]
        assert tier.get_into(metas[1], dest) and same_bytes(dest, payloads[1])


# ---- whole directories -------------------------------------------------------------------

@pytest.mark.parametrize("version", [None, 0, 2])
def test_a_directory_of_another_disk_format_is_cleared_not_served(tmp_path, version):
    """None: written before the format had a version; 0: an older one; 2: a newer one."""
    metas = sequence("m", 3)
    payloads = random_payloads(3, seed=4)
    store(tmp_path, metas, payloads)
    with RawValues(tmp_path) as raw:
        raw.put_meta(b"format_version", None if version is None else struct.pack("<H", version))
    # A reader serves nothing and changes nothing.
    with DiskTier(tmp_path, LAYOUT, BUDGET, readonly=True) as tier:
        assert tier.contains([m.block_hash for m in metas]) == [False] * 3
        assert not tier.get_into(metas[0], torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype))
    # A writer (the tier manager opens one) clears it and says so.
    manager = TierManager(LAYOUT, TierConfig.from_slots(LAYOUT, 4, 0, tmp_path, 64))
    try:
        assert manager.disk is not None and manager.disk.format_reset
        assert manager.lookup([m.block_hash for m in metas]).num_blocks == 0
        assert manager.stats().disk.num_blocks == 0
    finally:
        manager.close()


@pytest.mark.parametrize("content", ["garbage", "zeros", "truncated"])
def test_a_data_file_that_is_not_lmdb_is_refused_clearly(tmp_path, content):
    store(tmp_path, sequence("m", 2), random_payloads(2, seed=5))
    data_file = tmp_path / "data.mdb"
    size = data_file.stat().st_size
    if content == "garbage":
        data_file.write_bytes(os.urandom(size))
    elif content == "zeros":
        data_file.write_bytes(bytes(size))
    else:
        data_file.write_bytes(data_file.read_bytes()[:100])
    damaged = data_file.read_bytes()
    with pytest.raises(OSError, match="not a kvtier disk cache|damaged|cut short"):
        DiskTier(tmp_path, LAYOUT, BUDGET)
    # The tier manager keeps going: the files are moved aside and a fresh tier replaces them
    # (tests/kvtier/test_disk_damage.py covers every kind of damage).
    manager = TierManager(LAYOUT, TierConfig.from_slots(LAYOUT, 4, 0, tmp_path, 64))
    try:
        recovery = manager.disk_recovery
        assert manager.disk is not None and recovery is not None
        assert (recovery.moved_to / "data.mdb").stat().st_size == len(damaged)
    finally:
        manager.close()


CUT_CHILD = """
import sys, torch
from kvtier.layout import KVLayout
from kvtier.tiers.disk.tier import DiskTier
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
try:
    DiskTier(sys.argv[1], layout, 1 << 26)
except OSError as exc:
    print("refused:", exc)
"""


def test_a_data_file_cut_after_its_meta_pages_does_not_kill_the_process(tmp_path):
    """LMDB maps the file: reading a page past its end is a SIGBUS, which no handler can
    turn into a miss. The open must refuse the file first. (Run in a child process, so a
    regression shows as a failure instead of killing the test run.)"""
    store(tmp_path, sequence("m", 40), random_payloads(40, seed=8))
    data_file = tmp_path / "data.mdb"
    page_size = os.sysconf("SC_PAGESIZE")  # LMDB's page size
    assert data_file.stat().st_size > 4 * page_size
    data_file.write_bytes(data_file.read_bytes()[:2 * page_size])  # the two meta pages
    result = subprocess.run([sys.executable, "-c", CUT_CHILD, str(tmp_path)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the process died ({result.returncode}): {result.stderr}"
    assert "refused:" in result.stdout and "cut short" in result.stdout


# ---- the tier manager --------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["header", "payload", "cut", "other model"])
@pytest.mark.parametrize("host_slots", [0, 2])
def test_manager_recomputes_from_the_first_damaged_block(tmp_path, damage, host_slots):
    """Six blocks written through a manager and flushed to disk; block 3 is damaged. A new
    manager (a restart) restores blocks 0-2, reports block 3 as the first miss, leaves
    blocks 3-5 uncached for the caller to recompute, and deletes the damaged value. After
    the recompute is written back, the whole sequence is served from disk again."""
    metas = sequence("m", 6)
    payloads = random_payloads(6, seed=6)
    config = TierConfig.from_slots(LAYOUT, 8, host_slots, tmp_path, 64)
    writer = TierManager(LAYOUT, config)
    for meta, payload in zip(metas, payloads):  # one at a time: the host has two slots
        (block,) = writer.allocate(1)
        writer.kv_cache[block.block_id] = payload
        writer.cache_full_blocks([block], [meta])
        writer.free([block])
        writer.flush()  # written back to disk, so the slot can be evicted
    writer.close()
    with RawValues(tmp_path) as raw:
        key = metas[3].block_hash
        value = raw.get(key)
        raw.put(key, {
            "header": lambda: flip(value, 30),
            "payload": lambda: flip(value, len(value) - 5),
            "cut": lambda: value[:len(value) // 2],
            "other model": lambda: encode_record(sequence("other", 6)[3], LAYOUT,
                                                 as_bytes(payloads[3])),
        }[damage]())

    m = TierManager(LAYOUT, config)
    try:
        hashes = [meta.block_hash for meta in metas]
        assert m.lookup(hashes).locations == [Tier.DISK] * 6  # presence is not validity
        num_ok, targets = load(m, metas)
        assert num_ok == 3
        for block, payload in zip(targets[:3], payloads[:3]):
            assert same_bytes(m.kv_cache[block.block_id], payload)
            assert block.block_hash is not None
        assert all(block.block_hash is None and block.ref_cnt == 1 for block in targets[3:])
        stats = m.stats()
        assert stats.disk.rejected == 1 and stats.tiers[Tier.DISK].failures == 1
        check_idle(m)
        # The damaged value is gone: the prefix now ends before it.
        assert m.lookup(hashes).num_blocks == 3
        # The caller recomputes blocks 3-5 (here: writes the right bytes) and caches them.
        for block, payload in zip(targets[3:], payloads[3:]):
            m.kv_cache[block.block_id] = payload
        m.cache_full_blocks(targets[3:], metas[3:])
        m.free(targets)
        m.flush()
        assert m.disk.contains(hashes) == [True] * 6
    finally:
        m.close()
    fresh = TierManager(LAYOUT, config)
    try:
        num_ok, targets = load(fresh, metas)
        assert num_ok == 6
        for block, payload in zip(targets, payloads):
            assert same_bytes(fresh.kv_cache[block.block_id], payload)
        assert fresh.stats().disk.rejected == 0
        fresh.free(targets)
        check_idle(fresh)
    finally:
        fresh.close()
