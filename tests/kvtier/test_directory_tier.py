"""The directory tier (one file per block, the disk tier's record format), on its own and as
the only tier below the host of a manager: byte-exact round trips, and a damaged, truncated
or foreign file is a miss (deleted), never served.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import TierConfig
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Direction, Tier
from kvtier.tiers.base import LowerTier
from kvtier.tiers.directory.tier import DirectoryTier
from kvtier.tiers.record import BlockMeta
from tests.kvtier.disk_cases import LARGE, SMALL, make_blocks, same_bytes
from tests.kvtier.manager_cases import (
    chain,
    check_idle,
    evict_gpu,
    load,
    random_blocks,
    small_layout,
    write,
)
from tests.kvtier.manager_cases import (
    same_bytes as same_block,
)


def read_back(tier: DirectoryTier, meta: BlockMeta) -> torch.Tensor | None:
    dest = torch.empty(tier.layout.block_shape, dtype=tier.layout.dtype)
    return dest if tier.get_many_into([meta], [dest.view(torch.uint8).view(-1)])[0] else None


def test_round_trip_is_byte_exact(tmp_path) -> None:
    tier = DirectoryTier(tmp_path / "blocks", LARGE)
    assert isinstance(tier, LowerTier)
    metas, payloads = make_blocks(LARGE, seed=1, num_blocks=5)
    hashes = [m.block_hash for m in metas]
    assert tier.contains(hashes) == [False] * 5
    assert tier.put(metas[:3], payloads[:3]) == [True] * 3
    assert tier.put(metas[2:4], payloads[2:4]) == [True, True]  # one already there
    assert tier.contains(hashes) == [True] * 4 + [False]
    for meta, payload in zip(metas[:4], payloads[:4]):
        got = read_back(tier, meta)
        assert got is not None and same_bytes(got, payload)
    assert read_back(tier, metas[4]) is None  # never stored: a miss
    assert tier.delete(hashes) == 4
    stats = tier.stats()
    assert (stats.num_blocks, stats.hits, stats.misses, stats.puts) == (0, 4, 1, 4)


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


@pytest.mark.parametrize("damage", [flip_last_byte, lambda data: data[:-7],
                                    lambda data: b"\0" * len(data)],
                         ids=["bad checksum", "truncated", "zeroed"])
def test_a_damaged_file_is_a_miss_and_deleted(tmp_path, damage) -> None:
    tier = DirectoryTier(tmp_path, SMALL)
    metas, payloads = make_blocks(SMALL, seed=2, num_blocks=2)
    tier.put(metas, payloads)
    file = tier.file_of(metas[1].block_hash)
    file.write_bytes(damage(file.read_bytes()))
    assert read_back(tier, metas[1]) is None
    assert not file.exists() and tier.stats().rejected == 1
    got = read_back(tier, metas[0])  # the other block is untouched
    assert got is not None and same_bytes(got, payloads[0])


def test_a_file_for_other_tokens_or_another_layout_is_never_served(tmp_path) -> None:
    tier = DirectoryTier(tmp_path, SMALL)
    metas, payloads = make_blocks(SMALL, seed=3, num_blocks=1)
    impostor = BlockMeta(metas[0].block_hash, metas[0].parent_hash,
                         tuple(t + 1 for t in metas[0].token_ids))
    tier.put([impostor], payloads)  # another block's tokens under this hash
    assert read_back(tier, metas[0]) is None
    other_layout = DirectoryTier(tmp_path, KVLayout(
        num_layers=SMALL.num_layers, num_kv_heads=SMALL.num_kv_heads, head_dim=SMALL.head_dim,
        block_size=SMALL.block_size, dtype=torch.bfloat16))  # same size, other fingerprint
    other_layout.put(metas, payloads)
    assert read_back(tier, metas[0]) is None


def directory_manager(tmp_path, managers, host: int) -> TierManager:
    """A manager whose only tier below the host is a directory tier."""
    layout = small_layout()
    m = TierManager(layout, TierConfig.from_slots(layout, num_gpu_blocks=8, num_host_slots=host,
                                                  directory_path=tmp_path / "blocks"))
    managers.append(m)
    assert [t.name for t in m.lower_tiers] == ["directory"] and m.disk is None
    return m


@pytest.mark.parametrize("host", [0, 4], ids=["staging slab", "host tier"])
def test_manager_round_trip_through_the_directory(tmp_path, managers, host) -> None:
    m = directory_manager(tmp_path, managers, host)
    layout = m.layout
    metas, data = chain(layout, "doc", 6), random_blocks(layout, 6, seed=4)
    write(m, metas, data)
    evict_gpu(m)  # flushes: every block is written to the directory
    assert m.host is not None and m.host.caches == (host > 0)
    if host:  # the host keeps 4 of them: drop those, so the rest comes from the files
        for meta in metas:
            m.host.remove(meta.block_hash)
    hit = m.lookup([meta.block_hash for meta in metas])
    assert hit.locations == [Tier.DISK] * 6
    num_loaded, blocks = load(m, metas)
    assert num_loaded == 6
    for block, block_data in zip(blocks, data):
        assert same_block(m.kv_cache[block.block_id], block_data)
    m.free(blocks)
    stats = m.stats()
    assert stats.bytes_moved(Direction.DISK_TO_HOST) == 6 * layout.bytes_per_block
    assert stats.lower_tiers["directory"].hits == 6 and stats.disk is None
    check_idle(m)


def test_manager_treats_a_damaged_file_as_a_miss(tmp_path, managers) -> None:
    m = directory_manager(tmp_path, managers, host=0)
    metas, data = chain(m.layout, "doc", 4), random_blocks(m.layout, 4, seed=5)
    write(m, metas, data)
    evict_gpu(m)
    directory = m.lower_tiers.named("directory")
    file = directory.file_of(metas[2].block_hash)
    file.write_bytes(flip_last_byte(file.read_bytes()))
    num_loaded, blocks = load(m, metas)
    assert num_loaded == 2  # the prefix ends at the damaged block
    for block, block_data in zip(blocks[:2], data[:2]):
        assert same_block(m.kv_cache[block.block_id], block_data)
    m.free(blocks)
    assert m.stats().tiers[Tier.DISK].failures == 1 and not file.exists()
    check_idle(m)


def test_the_directory_and_the_disk_tier_cannot_both_take_write_backs(tmp_path) -> None:
    layout = small_layout()
    config = TierConfig.from_slots(layout, 8, 4, disk_path=tmp_path / "disk",
                                   num_disk_blocks=16, directory_path=tmp_path / "blocks")
    with pytest.raises(ValueError, match="turn all but one of them off"):
        TierManager(layout, config)
