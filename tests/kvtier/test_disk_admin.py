"""The `kvtier cache` operations on real disk tier directories."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import lmdb
import pytest
import torch
from disk_cases import SMALL, make_blocks, read_back

from kvtier.layout import KVLayout
from kvtier.tiers.disk import admin as disk_admin
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_header

WIDE = KVLayout(num_layers=1, num_kv_heads=4, head_dim=32, block_size=8, dtype=torch.float32)
BUDGET = 1 << 30


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()


def size_of(layout: KVLayout, meta: BlockMeta) -> int:
    return len(encode_header(meta, layout, layout.bytes_per_block, 0)) + layout.bytes_per_block


@pytest.fixture
def filled(tmp_path) -> tuple[Path, dict]:
    """A directory with 4 SMALL blocks then 2 WIDE blocks, put one by one (oldest first)."""
    path = tmp_path / "cache"
    blocks = {"small": make_blocks(SMALL, seed=1, num_blocks=4),
              "wide": make_blocks(WIDE, seed=2, num_blocks=2)}
    for layout, (metas, payloads) in ((SMALL, blocks["small"]), (WIDE, blocks["wide"])):
        with DiskTier(path, layout, BUDGET) as tier:
            for meta, payload in zip(metas, payloads):
                assert sum(tier.put([meta], [payload])) == 1
    return path, blocks


def all_hashes(blocks: dict) -> list[bytes]:
    """Every block hash, oldest access first."""
    return [m.block_hash for m in blocks["small"][0] + blocks["wide"][0]]


def damage_value(path: Path, key: bytes, how: str) -> None:
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 28)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        value = txn.get(key, db=db)
        value = value[:-3] + bytes([value[-3] ^ 0x10]) + value[-2:] if how == "flip" \
            else value[: len(value) // 2]
        txn.put(key, value, db=db)
    env.close()


def drop_access_entry(path: Path, key: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 28)
    access = env.open_db(b"access")
    with env.begin(write=True) as txn:
        assert txn.delete(key, db=access)
    env.close()


def test_cache_stats_names_each_layout(filled):
    path, blocks = filled
    stats = disk_admin.cache_stats(path)
    assert stats["num_blocks"] == 6 and stats["format_version"] == 1
    assert stats["budget_bytes"] == BUDGET
    expected_bytes = (sum(size_of(SMALL, m) for m in blocks["small"][0])
                      + sum(size_of(WIDE, m) for m in blocks["wide"][0]))
    assert stats["bytes_used"] == expected_bytes
    by_name = {entry["layout"]: entry for entry in stats["layouts"]}
    assert by_name[SMALL.describe()]["num_blocks"] == 4
    assert by_name[WIDE.describe()]["num_blocks"] == 2
    assert by_name[WIDE.describe()]["fingerprint"] == WIDE.fingerprint().hex()
    assert sum(entry["bytes"] for entry in stats["layouts"]) == expected_bytes
    json.dumps(stats)  # plain data for the CLI's --json
    with pytest.raises(FileNotFoundError):
        disk_admin.cache_stats(path.parent / "nothing-here")


def test_inspect_lists_newest_first(filled):
    path, blocks = filled
    rows = disk_admin.inspect(path, limit=3)
    assert [row["hash"] for row in rows] == [h.hex() for h in reversed(all_hashes(blocks))][:3]
    assert [row["layout"] for row in rows] == [WIDE.describe(), WIDE.describe(),
                                               SMALL.describe()]
    assert [row["num_tokens"] for row in rows] == [8, 8, 4]
    assert rows[0]["last_access"] > rows[1]["last_access"] > rows[2]["last_access"]
    # The sequence numbers are times: the blocks were used during this test.
    assert all(time.time() - 3600 < row["last_access_time"] <= time.time() for row in rows)
    assert all(row["status"] == "ok" for row in rows)
    assert len(disk_admin.inspect(path, limit=100)) == 6


def test_verify_finds_damage_and_repair_removes_it(filled):
    path, blocks = filled
    assert disk_admin.verify(path).ok
    small_metas, small_payloads = blocks["small"]
    damage_value(path, small_metas[0].block_hash, "flip")
    damage_value(path, small_metas[2].block_hash, "truncate")
    drop_access_entry(path, small_metas[3].block_hash)
    # Without repair: reported, nothing changed.
    report = disk_admin.verify(path)
    assert not report.ok and report.num_checked == 6 and report.num_removed == 0
    assert dict(report.bad) == {small_metas[0].block_hash.hex(): "bad checksum",
                                small_metas[2].block_hash.hex(): "truncated"}
    assert report.index_errors > 0
    assert disk_admin.verify(path).bad == report.bad
    # With repair: the two bad values go, the index and byte counter add up again.
    repaired = disk_admin.verify(path, repair=True)
    assert repaired.num_removed == 2 and repaired.repaired
    after = disk_admin.verify(path)
    assert after.ok and after.num_checked == 4
    with DiskTier(path, SMALL, BUDGET) as tier:
        assert tier.contains([m.block_hash for m in small_metas]) == [False, True, False, True]
        for i in (1, 3):
            assert same_bytes(read_back(tier, small_metas[i]), small_payloads[i])
        bytes_used = tier.stats().bytes_used
    assert bytes_used == sum(entry["bytes"] for entry in disk_admin.cache_stats(path)["layouts"])


def test_prune_keeps_the_newest_and_clear_empties(filled):
    path, blocks = filled
    hashes = all_hashes(blocks)
    wide_bytes = sum(size_of(WIDE, m) for m in blocks["wide"][0])
    assert disk_admin.prune(path, max_bytes=wide_bytes) == 4  # the 4 older SMALL blocks
    assert [row["hash"] for row in disk_admin.inspect(path, 10)] == \
        [h.hex() for h in reversed(hashes[4:])]
    assert disk_admin.prune(path, max_bytes=wide_bytes) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        disk_admin.prune(path, -1)
    assert disk_admin.clear(path) == 2
    stats = disk_admin.cache_stats(path)
    assert stats["num_blocks"] == 0 and stats["bytes_used"] == 0
    metas, payloads = blocks["small"]
    with DiskTier(path, SMALL, BUDGET) as tier:
        assert sum(tier.put(metas[:1], payloads[:1])) == 1


def test_export_import_round_trip(filled, tmp_path):
    path, blocks = filled
    export = tmp_path / "cache.kvtx"
    assert disk_admin.export_cache(path, export) == 6
    assert export.stat().st_mode & 0o777 == 0o600
    target = tmp_path / "elsewhere" / "cache"
    assert disk_admin.import_cache(target, export, shards=4) == 6
    assert disk_admin.import_cache(target, export) == 0  # already there (still four shards)
    assert disk_admin.cache_stats(target)["shards"] == 4
    # The access order came along, across the shards: newest first is the same list.
    assert [row["hash"] for row in disk_admin.inspect(target, 10)] == \
        [row["hash"] for row in disk_admin.inspect(path, 10)]
    assert disk_admin.cache_stats(target)["layouts"] == disk_admin.cache_stats(path)["layouts"]
    # Exported from the shards, imported into one environment: the same blocks and order.
    single = tmp_path / "single"
    assert disk_admin.export_cache(target, tmp_path / "again.kvtx") == 6
    assert disk_admin.import_cache(single, tmp_path / "again.kvtx") == 6
    assert (single / "data.mdb").exists()
    assert [row["hash"] for row in disk_admin.inspect(single, 10)] == \
        [row["hash"] for row in disk_admin.inspect(path, 10)]
    for layout, key in ((SMALL, "small"), (WIDE, "wide")):
        tier, recovery = open_disk_tier(target, layout, BUDGET)
        assert recovery is None
        with tier:
            for meta, payload in zip(*blocks[key]):
                assert same_bytes(read_back(tier, meta), payload)
    # Only one layout's blocks exported and imported for that layout.
    only_small = tmp_path / "only-small"
    with DiskTier(only_small, SMALL, BUDGET) as tier:
        tier.put(*blocks["small"])
    disk_admin.export_cache(only_small, tmp_path / "small.kvtx")
    assert disk_admin.import_cache(tmp_path / "third", tmp_path / "small.kvtx", SMALL) == 4


def test_import_refuses_another_layout(filled, tmp_path):
    path, _ = filled
    export = tmp_path / "cache.kvtx"
    disk_admin.export_cache(path, export)
    target = tmp_path / "target"
    with pytest.raises(ValueError, match="another layout|holds blocks of layout"):
        disk_admin.import_cache(target, export, layout=SMALL)
    assert not (target / "data.mdb").exists()  # refused before anything was written


def _exported(filled, tmp_path) -> tuple[bytearray, int]:
    path, _ = filled
    export = tmp_path / "cache.kvtx"
    disk_admin.export_cache(path, export)
    data = bytearray(export.read_bytes())
    (meta_len,) = struct.unpack_from("<I", data, 6)
    return data, 10 + meta_len  # offset of the first block's frame


@pytest.mark.parametrize("tamper, message", [
    ("payload byte", "damaged"),
    ("key byte", "trailing checksum"),
    ("truncated", "truncated"),
    ("extra bytes", "after its end"),
    ("version", "version 2"),
    ("magic", "not a kvtier cache export"),
])
def test_import_refuses_a_tampered_file(filled, tmp_path, tamper, message):
    data, first = _exported(filled, tmp_path)
    if tamper == "payload byte":
        data[-40] ^= 0x01  # inside the last block's payload (the trailer is 20 bytes)
    elif tamper == "key byte":
        data[first + 12 + 3] ^= 0x01
    elif tamper == "truncated":
        del data[-1000:]
    elif tamper == "extra bytes":
        data += b"\0"
    elif tamper == "version":
        struct.pack_into("<H", data, 4, 2)
    else:
        data[:4] = b"ZZZZ"
    bad = tmp_path / "bad.kvtx"
    bad.write_bytes(bytes(data))
    target = tmp_path / "target"
    with pytest.raises(ValueError, match=message):
        disk_admin.import_cache(target, bad)
    assert not (target / "data.mdb").exists()


def test_export_refuses_another_disk_format(filled, tmp_path):
    path, _ = filled
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 28)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"format_version", struct.pack("<H", 99), db=meta)
    env.close()
    with pytest.raises(ValueError, match="disk format 99"):
        disk_admin.export_cache(path, tmp_path / "out.kvtx")
    assert not (tmp_path / "out.kvtx").exists()
    assert not (tmp_path / "out.kvtx.partial").exists()
    assert disk_admin.clear(path) == 6
    assert disk_admin.cache_stats(path)["format_version"] == 1
