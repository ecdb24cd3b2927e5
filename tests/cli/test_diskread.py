"""`kvtier.cli.bench.diskread` on a real disk tier: one document's blocks are found from the
records' parent hashes and read back in a restore's order, every byte verified."""

from __future__ import annotations

import os

import pytest
import torch
from kvtier.cli.bench.diskread import (
    disk_tier_read,
    forget_blocks,
    longest_chain,
    read_into_page_cache,
    resident_fraction,
    stored_flags,
    stored_spans,
    tier_metas,
    tier_resident_fraction,
)

from kvtier.layout import KVLayout
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import shard_dirs
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=torch.float16)  # 16 KiB blocks: on overflow pages


def chain(length: int) -> list[BlockMeta]:
    """`length` blocks of one document: each one's parent is the block before."""
    metas, parent = [], os.urandom(16)  # the first block's parent is not stored
    for i in range(length):
        meta = BlockMeta(os.urandom(16), parent, tuple(range(i * 16, i * 16 + 16)))
        metas.append(meta)
        parent = meta.block_hash
    return metas


def test_one_document_is_read_as_a_restore_reads_it(tmp_path) -> None:
    long_doc, short_doc = chain(7), chain(3)
    payloads = [torch.randint(0, 255, (LAYOUT.bytes_per_block,), dtype=torch.uint8)
                for _ in range(7)]
    with DiskTier(tmp_path, LAYOUT, 1 << 30) as disk:
        assert sum(disk.put(short_doc, payloads[:3])) == 3
        assert sum(disk.put(long_doc, payloads)) == 7
        stored = tier_metas(disk)
    assert longest_chain(stored) == long_doc
    document = disk_tier_read(tmp_path, LAYOUT, threads=2, group_blocks=3, order="document")
    assert (document["blocks"], document["verified"], document["order"]) == (7, 7, "document")
    assert document["gb_s"] > 0
    # The document's last blocks only, and blocks in key order (scattered over the file).
    tail = disk_tier_read(tmp_path, LAYOUT, threads=2, group_blocks=3, max_blocks=4,
                          order="document")
    assert (tail["blocks"], tail["verified"]) == (4, 4)
    scattered = disk_tier_read(tmp_path, LAYOUT, threads=2, group_blocks=3, max_blocks=5)
    assert (scattered["blocks"], scattered["verified"], scattered["order"]) == (5, 5, "key")
    with pytest.raises(ValueError, match="order must be"):
        disk_tier_read(tmp_path, LAYOUT, order="random")


def test_a_cycle_of_parents_does_not_hang() -> None:
    a, b = os.urandom(16), os.urandom(16)
    looped = [BlockMeta(a, b, (1,)), BlockMeta(b, a, (2,))]
    assert longest_chain(looped) == []  # no block starts a chain


def test_resident_fraction_sees_a_file_read_and_one_evicted(tmp_path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    assert path.read_bytes()  # every page read once: cached
    assert resident_fraction(path) == 1.0
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    after = resident_fraction(path)
    assert after is not None and 0.0 <= after <= 1.0  # tmpfs keeps its pages; disks drop them
    assert resident_fraction(tmp_path / "missing") is None
    (tmp_path / "empty").touch()
    assert resident_fraction(tmp_path / "empty") is None


def test_a_tier_s_resident_share_weighs_every_shard_file(tmp_path) -> None:
    """Over a sharded disk tier the share counts each shard's data file by its size: one
    file cached and one of three times its size evicted is 0.25 (where the file system
    drops pages on request), never None for want of a data.mdb at the root."""
    root = tmp_path / "kv"
    sizes = {0: 1 << 20, 1: 3 << 20}
    for index, size in sizes.items():
        (root / f"shard-{index}-of-2").mkdir(parents=True)
        (root / f"shard-{index}-of-2" / "data.mdb").write_bytes(os.urandom(size))
    assert tier_resident_fraction(root) == 1.0  # both just written: cached
    evicted = root / "shard-1-of-2" / "data.mdb"
    with open(evicted, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    expected = (1.0 * sizes[0] + resident_fraction(evicted) * sizes[1]) / sum(sizes.values())
    assert tier_resident_fraction(root) == pytest.approx(expected)
    assert tier_resident_fraction(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("shards", [1, 3])
def test_stored_spans_name_the_tail_and_the_runs_of_each_document(tmp_path, shards) -> None:
    whole, gappy, absent = chain(6), chain(8), chain(3)
    tier, _ = open_disk_tier(tmp_path / "kv", LAYOUT, 1 << 30, shards=shards)
    with tier:
        kept = whole + [gappy[i] for i in (1, 2, 4, 6, 7)]
        payload = torch.zeros(LAYOUT.bytes_per_block, dtype=torch.uint8)
        assert sum(tier.put(kept, [payload] * len(kept))) == len(kept)
    spans = stored_spans(tmp_path / "kv", LAYOUT, [[m.block_hash for m in doc]
                                                    for doc in (whole, gappy, absent)])
    assert spans == [{"blocks": 6, "stored": 6, "tail": 6, "runs": 1},
                     {"blocks": 8, "stored": 5, "tail": 2, "runs": 3},
                     {"blocks": 3, "stored": 0, "tail": 0, "runs": 0}]


@pytest.mark.parametrize("shards", [1, 2])
def test_forgotten_blocks_are_gone_and_the_files_read_whole(tmp_path, shards) -> None:
    doc = chain(5)
    tier, _ = open_disk_tier(tmp_path / "kv", LAYOUT, 1 << 30, shards=shards)
    with tier:
        payload = torch.ones(LAYOUT.bytes_per_block, dtype=torch.uint8)
        assert sum(tier.put(doc, [payload] * 5)) == 5
    hashes = [m.block_hash for m in doc]
    # Blocks 1 and 3, and one the tier never held.
    assert forget_blocks(tmp_path / "kv", LAYOUT, [hashes[1], hashes[3], os.urandom(16)]) == 2
    assert stored_flags(tmp_path / "kv", LAYOUT, [hashes]) == [[True, False, True, False, True]]
    files = [d / "data.mdb" for d in shard_dirs(tmp_path / "kv", shards)]
    assert read_into_page_cache(tmp_path / "kv") == sum(f.stat().st_size for f in files)
