"""TierManager with each combination of tiers switched on or off, the checks of load
arguments and of TierConfig, and a smoke run of the round-trip benchmark; tiny capacities,
with a real LMDB disk tier in a temp directory. The shared builders live in manager_cases.py.
"""

import pytest
import torch
from manager_cases import (
    chain,
    check_idle,
    config,
    disk_only,
    evict_gpu,
    load,
    random_blocks,
    same_bytes,
    small_layout,
    write,
)

from kvtier.config import TierConfig
from kvtier.manager import TierManager
from kvtier.stats import Tier
from kvtier.tiers.disk.tier import LOOKUP_DEADLINE_S, DiskTier

# ---- tier combinations ---------------------------------------------------------------------

def test_with_every_tier_off_the_manager_is_the_pool(managers):
    layout = small_layout()
    m = TierManager(layout, TierConfig(num_gpu_blocks=4))
    managers.append(m)
    assert m.host is None and m.disk is None
    metas = chain(layout, "a", 2)
    write(m, metas, random_blocks(layout, 2, seed=1))
    hashes = [meta.block_hash for meta in metas]
    assert m.lookup(hashes).locations == [Tier.GPU, Tier.GPU]
    evict_gpu(m)
    assert m.lookup(hashes).num_blocks == 0
    stats = m.stats()
    assert all(t.num_jobs == 0 for t in stats.transfers.values())
    assert stats.tiers[Tier.GPU].misses == 1 and stats.host_slots == 0 and stats.disk is None


def test_host_tier_without_disk_evicts_least_recently_used(managers):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=8, host=2))
    managers.append(m)
    metas = {name: chain(layout, name, 1) for name in "abc"}
    for seed, name in enumerate("abc"):
        write(m, metas[name], random_blocks(layout, 1, seed=seed))
    evict_gpu(m)
    found = {name: m.lookup([metas[name][0].block_hash]).locations for name in "abc"}
    assert found == {"a": [], "b": [Tier.HOST], "c": [Tier.HOST]}
    assert m.stats().host_cached == 2


def test_disk_without_host_tier_loads_in_waves_through_staging(tmp_path, managers):
    layout = small_layout(torch.float32)
    m, blocks = disk_only(tmp_path, managers, layout, {"long": 2, "more": 2, "most": 2},
                          staging_slots=2)
    metas = [meta for name in ("long", "more", "most") for meta in blocks[name][0]]
    data = torch.cat([blocks[name][1] for name in ("long", "more", "most")])
    assert m.stats().host_slots == 0
    # Six disk blocks through two staging slots: three waves, no block lost.
    for name in ("long", "more", "most"):
        hashes = [meta.block_hash for meta in blocks[name][0]]
        assert m.lookup(hashes).locations == [Tier.DISK, Tier.DISK]
    num_ok, targets = load(m, metas)
    assert num_ok == 6
    for target, expected in zip(targets, data):
        assert same_bytes(m.kv_cache[target.block_id], expected)
    m.free(targets)
    check_idle(m)


def test_close_writes_dirty_host_blocks_to_disk(tmp_path):
    layout = small_layout()
    m = TierManager(layout, config(layout, tmp_path, gpu=4, host=8))
    metas = chain(layout, "a", 3)
    write(m, metas, random_blocks(layout, 3, seed=1))
    assert m.stats().host_dirty == 3
    m.close()
    m.close()  # idempotent
    with DiskTier(tmp_path / "disk", layout, 1 << 20) as disk:
        assert disk.contains([meta.block_hash for meta in metas]) == [True] * 3


# ---- argument and config checks -------------------------------------------------------------

def test_load_arguments_are_checked(managers):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=4, host=2))
    managers.append(m)
    metas = chain(layout, "a", 2)
    blocks = write(m, metas[:1], random_blocks(layout, 1, seed=1))
    with pytest.raises(ValueError, match="allocated by the caller"):
        m.prepare_load(metas[:1], blocks)  # free (and cached)
    held = m.allocate(1)
    with pytest.raises(ValueError, match="metas but"):
        m.prepare_load(metas, held)
    with pytest.raises(ValueError, match="distinct block"):
        m.prepare_load(metas, held + held)
    with pytest.raises(ValueError, match="unknown or already completed"):
        m.complete_load(99)
    load_id = m.prepare_load(metas[1:], held)
    assert m.is_load_ready(load_id) and m.complete_load(load_id) == 0
    with pytest.raises(ValueError, match="unknown or already completed"):
        m.is_load_ready(load_id)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ({"num_gpu_blocks": 4, "host_capacity_bytes": -1}, "host_capacity_bytes"),
    ({"num_gpu_blocks": 4, "disk_path": "/tmp/x"}, "disk_budget_bytes is required"),
    ({"num_gpu_blocks": 4, "disk_budget_bytes": 100}, "disk_path is None"),
    ({"num_gpu_blocks": 4, "disk_path": "/tmp/x", "disk_budget_bytes": 0},
     "disk_budget_bytes: must be > 0"),
    ({"num_gpu_blocks": 4, "swap_method": "magic"}, "swap_method"),
    ({"num_gpu_blocks": 4, "io_threads": 0}, "io_threads"),
    ({"num_gpu_blocks": 4, "max_pending_io": 0}, "max_pending_io"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TierConfig(**kwargs)


def test_config_capacity_in_bytes_or_slots():
    layout = small_layout()
    by_slots = TierConfig.from_slots(layout, 4, num_host_slots=3, disk_path="/tmp/x",
                                     num_disk_blocks=10)
    assert by_slots.host_capacity_bytes == 3 * layout.bytes_per_block
    assert by_slots.num_host_slots(layout) == 3 and by_slots.disk_enabled
    rounded = TierConfig(num_gpu_blocks=4, host_capacity_bytes=3 * layout.bytes_per_block + 1)
    assert rounded.num_host_slots(layout) == 3
    off = TierConfig(num_gpu_blocks=4)
    assert off.num_host_slots(layout) == 0 and not off.host_enabled
    with pytest.raises(ValueError, match="smaller than one block"):
        TierConfig(num_gpu_blocks=4,
                   host_capacity_bytes=layout.bytes_per_block - 1).num_host_slots(layout)


# ---- the round-trip benchmark (cli/bench/roundtrip.py) on tiny sizes -----------------------

def test_roundtrip_bench_smoke_run(tmp_path):
    from kvtier.cli.bench.roundtrip import run_roundtrip_bench

    result = run_roundtrip_bench(total_mib=1, repeats=1, num_layers=2, num_kv_heads=2,
                                 head_dim=16, block_size=4, disk_dir=tmp_path, device="cpu")
    assert result["num_blocks"] == 1024 and result["bytes_each_way"] == 1 << 20
    assert result["manager"]["verified"] and result["disk"]["verified"]
    assert result["manager"]["roundtrip_vs_ceiling"] > 0 and result["disk"]["restore_gbps"] > 0


def test_the_disk_lookup_deadline_is_a_setting(tmp_path):
    layout = small_layout()
    assert TierConfig(num_gpu_blocks=4).disk_lookup_deadline_s == LOOKUP_DEADLINE_S
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="disk_lookup_deadline_s"):
            TierConfig(num_gpu_blocks=4, disk_lookup_deadline_s=bad)
    config = TierConfig.from_slots(layout, 8, 2, disk_path=tmp_path / "kv", num_disk_blocks=16,
                                   disk_lookup_deadline_s=7.5)
    m = TierManager(layout, config)
    try:
        disk = m.lower_tiers.named("disk")
        assert isinstance(disk, DiskTier) and disk.lookup_deadline_s == 7.5
    finally:
        m.close()
