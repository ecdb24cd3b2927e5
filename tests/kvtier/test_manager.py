"""TierManager scenarios on tiny capacities, with a real LMDB disk tier in a temp directory.

On the CPU the "GPU" cache is a CPU tensor and GPU <-> host copies run synchronously, but
they go through the same jobs, completions and pins as on a GPU. Blocks hold random bit
patterns (NaNs included), so every comparison is byte for byte.
"""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kvtier.config import TierConfig
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Direction, Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import SlotState
from kvtier.tiers.record import BlockMeta, metas_for

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def small_layout(dtype: torch.dtype = torch.float16) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)


def chain(layout: KVLayout, name: str, num_blocks: int) -> list[BlockMeta]:
    """Metas of `num_blocks` chained blocks of a sequence named `name`."""
    root = namespace_hash(name, layout)
    offset = sum(map(ord, name))  # stable across processes, unlike hash()
    token_ids = [offset + i for i in range(num_blocks * layout.block_size)]
    return metas_for(root, hash_blocks(root, token_ids, layout.block_size), token_ids,
                     layout.block_size)


def random_blocks(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, *block_shape] of random bit patterns."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * layout.bytes_per_block,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(layout.dtype).view(num_blocks, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def write(m: TierManager, metas: list[BlockMeta], data: torch.Tensor) -> list[KVCacheBlock]:
    """Compute blocks (copy `data` into fresh GPU blocks), cache them and free them."""
    blocks = m.allocate(len(metas))
    assert blocks is not None, "test setup: not enough free GPU blocks"
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id] = block_data
    m.cache_full_blocks(blocks, metas)
    m.free(blocks)
    m.poll()
    return blocks


def evict_gpu(m: TierManager) -> None:
    """Reuse every GPU block once, so nothing stays cached on the GPU."""
    m.flush()
    blocks = m.allocate(m.pool.num_blocks)
    assert blocks is not None, "test setup: a GPU block is still held"
    m.free(blocks)
    assert m.stats().pool.num_cached == 0


def load(m: TierManager, metas: list[BlockMeta]) -> tuple[int, list[KVCacheBlock]]:
    blocks = m.allocate(len(metas))
    assert blocks is not None
    return m.complete_load(m.prepare_load(metas, blocks)), blocks


def check_idle(m: TierManager) -> None:
    """Pool and host invariants; nothing in flight, so no slot may be pinned or reserved."""
    m.pool.check_invariants()
    stats = m.stats()
    assert stats.num_jobs_in_flight == 0 and stats.num_loads_in_flight == 0
    if m.host is not None:
        m.host.check_invariants(idle=True)


def config(layout: KVLayout, tmp_path: Path | None, gpu: int, host: int, **kwargs) -> TierConfig:
    disk = {} if tmp_path is None else {"disk_path": tmp_path / "disk", "num_disk_blocks": 64}
    return TierConfig.from_slots(layout, gpu, host, **disk, **kwargs)


@pytest.fixture
def managers():
    """Managers made by a test, closed at its end even when it fails."""
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close()


@pytest.fixture
def release():
    """The event a held disk call waits for. Requested after `managers`, it is set first at
    teardown, so a failing test cannot leave close() waiting on a held call."""
    event = threading.Event()
    yield event
    event.set()


# ---- the round trip ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_gpu_host_disk_host_gpu(tmp_path, managers, dtype):
    layout = small_layout(dtype)
    m = TierManager(layout, config(layout, tmp_path, gpu=4, host=2))
    managers.append(m)
    metas, data = chain(layout, "doc", 6), random_blocks(layout, 6, seed=11)
    # Compute and cache two blocks at a time; flush writes every host block back to disk.
    for i in range(0, 6, 2):
        write(m, metas[i:i + 2], data[i:i + 2])
        m.flush()
    check_idle(m)
    assert m.disk.contains([meta.block_hash for meta in metas]) == [True] * 6
    evict_gpu(m)
    # The host holds the last two blocks; the rest come from disk.
    hit = m.lookup([meta.block_hash for meta in metas])
    assert hit.locations == [Tier.DISK] * 4 + [Tier.HOST] * 2
    assert hit.gpu_blocks == [None] * 6
    # Load the first four (disk -> host slots -> GPU, two slots at a time), then the rest.
    for lo, hi in ((0, 4), (4, 6)):
        num_ok, blocks = load(m, metas[lo:hi])
        assert num_ok == hi - lo
        for block, expected in zip(blocks, data[lo:hi]):
            assert same_bytes(m.kv_cache[block.block_id], expected)
            assert block.block_hash is not None  # cached on the GPU now
        m.free(blocks)
        check_idle(m)
    stats = m.stats()
    assert stats.tiers[Tier.DISK].hits == 4 and stats.tiers[Tier.HOST].hits == 2
    block_bytes = layout.bytes_per_block
    assert stats.transfers[Direction.GPU_TO_HOST].num_bytes == 6 * block_bytes
    assert stats.transfers[Direction.HOST_TO_DISK].num_bytes == 6 * block_bytes
    assert stats.transfers[Direction.DISK_TO_HOST].num_bytes >= 4 * block_bytes
    assert stats.transfers[Direction.HOST_TO_GPU].num_bytes == 6 * block_bytes
    assert stats.tiers[Tier.HOST].failures == stats.tiers[Tier.DISK].failures == 0


@pytest.mark.gpu
@pytest.mark.parametrize("swap_method", ["dma", "triton"])
def test_round_trip_on_cuda(tmp_path, managers, swap_method):
    if swap_method == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton copy kernel is measured compiled, not interpreted")
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.bfloat16)
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=4, swap_method=swap_method),
                    "cuda")
    managers.append(m)
    assert m.host.slab.is_pinned()
    metas, data = chain(layout, "cuda", 6), random_blocks(layout, 6, seed=7)
    for i in range(0, 6, 2):
        write(m, metas[i:i + 2], data[i:i + 2].cuda())
        m.flush()
    evict_gpu(m)
    assert m.lookup([meta.block_hash for meta in metas]).locations == \
        [Tier.DISK] * 2 + [Tier.HOST] * 4
    num_ok, blocks = load(m, metas)  # six blocks through four host slots
    assert num_ok == 6
    for block, expected in zip(blocks, data):
        assert same_bytes(m.kv_cache[block.block_id].cpu(), expected)
    m.free(blocks)
    check_idle(m)
    assert m.stats().transfers[Direction.HOST_TO_GPU].seconds > 0


CHILD = textwrap.dedent("""
    import sys
    import torch
    from tests.kvtier.test_manager import chain, config, random_blocks, small_layout, write
    from kvtier.manager import TierManager
    from pathlib import Path

    layout = small_layout(torch.bfloat16)
    m = TierManager(layout, config(layout, Path(sys.argv[1]), gpu=4, host=8))
    write(m, chain(layout, "restart", 3), random_blocks(layout, 3, seed=5))
    m.close()  # writes the dirty host blocks back to disk
""")


def test_blocks_persist_across_a_process_restart(tmp_path, managers):
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=REPO_ROOT, check=True,
                   timeout=120)
    layout = small_layout(torch.bfloat16)
    m = TierManager(layout, config(layout, tmp_path, gpu=4, host=0))
    managers.append(m)
    metas = chain(layout, "restart", 3)
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.DISK] * 3
    num_ok, blocks = load(m, metas)
    assert num_ok == 3
    for block, expected in zip(blocks, random_blocks(layout, 3, seed=5)):
        assert same_bytes(m.kv_cache[block.block_id], expected)


# ---- pins, write-back and backpressure ---------------------------------------------------

@pytest.mark.timeout(120)
def test_a_slot_pinned_by_a_load_survives_host_exhaustion(tmp_path, managers, release):
    layout = small_layout()
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=2, io_threads=2))
    managers.append(m)
    block_a, data_a = chain(layout, "a", 1), random_blocks(layout, 1, seed=1)
    write(m, block_a, data_a)
    m.flush()
    # Two more blocks push the (clean) block A out of the two host slots; it is on disk.
    write(m, chain(layout, "b", 2), random_blocks(layout, 2, seed=2))
    evict_gpu(m)
    assert m.lookup([block_a[0].block_hash]).locations == [Tier.DISK]
    # Hold A's disk read open after its bytes landed in a host slot.
    real_get, landed = m.disk.get_many_into, threading.Event()

    def held_get(metas, dests):
        results = real_get(metas, dests)
        landed.set()
        release.wait()
        return results

    m.disk.get_many_into = held_get
    target = m.allocate(1)
    load_id = m.prepare_load(block_a, target)
    assert landed.wait(timeout=60)
    (slot,) = [s for s in range(2) if m.host.state(s) is SlotState.RESERVED]
    assert m.host.num_pins(slot) == 1 and m.host.meta(slot) == block_a[0]
    # Exhaust the host tier with write-throughs; the pinned slot must never be reused.
    for i in range(6):
        write(m, chain(layout, f"filler{i}", 1), random_blocks(layout, 1, seed=100 + i))
        assert m.host.state(slot) is SlotState.RESERVED and m.host.meta(slot) == block_a[0]
        assert same_bytes(m.host.slot_tensor(slot), data_a[0])
    assert not m.is_load_ready(load_id)
    release.set()
    assert m.complete_load(load_id) == 1
    assert same_bytes(m.kv_cache[target[0].block_id], data_a[0])
    m.free(target)
    m.flush()
    check_idle(m)


@pytest.mark.timeout(120)
def test_write_back_commits_before_the_slot_is_freed(tmp_path, managers, release):
    layout = small_layout()
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=3, io_threads=2))
    managers.append(m)
    real_put, entered = m.disk.put, threading.Event()

    def held_put(metas, payloads):
        entered.set()
        release.wait()
        return real_put(metas, payloads)

    m.disk.put = held_put
    metas, data = chain(layout, "wb", 5), random_blocks(layout, 5, seed=3)
    hashes = [meta.block_hash for meta in metas]
    # A, B, C fill the host (dirty). Taking the last free slot starts A's write-back.
    for i in range(3):
        write(m, metas[i:i + 1], data[i:i + 1])
    assert entered.wait(timeout=60)
    # D and E find no slot: A and B are being written back (D's attempt started B's), and
    # C is dirty and must not be dropped. They are skipped; the manager does not block.
    write(m, metas[3:4], data[3:4])
    write(m, metas[4:5], data[4:5])
    assert m.stats().tiers[Tier.HOST].rejected == 2
    slot_c = m.host.lookup(hashes[2])
    assert slot_c is not None and m.host.is_dirty(slot_c) and m.host.num_pins(slot_c) == 0
    assert all(m.host.contains(h) for h in hashes[:3])
    assert m.disk.contains(hashes[:3]) == [False] * 3
    release.set()
    m.flush()
    assert m.disk.contains(hashes[:3]) == [True] * 3
    assert m.stats().host_dirty == 0
    # Now the three are clean: a new block evicts the least recently used one, A.
    write(m, chain(layout, "f", 1), random_blocks(layout, 1, seed=4))
    m.flush()
    assert not m.host.contains(hashes[0])
    evict_gpu(m)
    assert m.lookup(hashes[:3]).locations == [Tier.DISK, Tier.HOST, Tier.HOST]
    num_ok, blocks = load(m, metas[:3])
    assert num_ok == 3
    for block, expected in zip(blocks, data[:3]):
        assert same_bytes(m.kv_cache[block.block_id], expected)
    m.free(blocks)
    check_idle(m)


def test_write_through_holds_the_gpu_block_until_the_copy_is_done(managers):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=2, host=2))
    managers.append(m)
    blocks = m.allocate(1)
    m.cache_full_blocks(blocks, chain(layout, "x", 1))
    m.free(blocks)
    # The copy's reference keeps the block out of reuse until poll() sees it finished.
    assert blocks[0].ref_cnt == 1 and m.allocate(2) is None
    m.poll()
    assert blocks[0].ref_cnt == 0 and m.host.num_cached == 1
    assert m.allocate(2) is not None


# ---- fail closed ---------------------------------------------------------------------------

def disk_only(tmp_path: Path, managers: list, layout: KVLayout, names: dict[str, int],
              **kwargs) -> tuple[TierManager, dict[str, tuple[list[BlockMeta], torch.Tensor]]]:
    """A manager with the host tier off (staging only) whose blocks are on disk only."""
    m = TierManager(layout, config(layout, tmp_path, gpu=8, host=0, **kwargs))
    managers.append(m)
    blocks = {}
    for seed, (name, num_blocks) in enumerate(names.items()):
        blocks[name] = (chain(layout, name, num_blocks), random_blocks(layout, num_blocks, seed))
        write(m, *blocks[name])
        m.flush()
    evict_gpu(m)
    return m, blocks


def test_a_failed_disk_read_is_a_miss_and_releases_its_slot(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"a": 2})
    metas, data = blocks["a"]

    def broken_get(metas, dests):
        raise OSError("I/O error")

    m.disk.get_many_into = broken_get
    num_ok, targets = load(m, metas)
    assert num_ok == 0
    assert all(t.block_hash is None and t.ref_cnt == 1 for t in targets)  # caller recomputes
    stats = m.stats()
    assert stats.tiers[Tier.DISK].failures == 2
    assert stats.transfers[Direction.DISK_TO_HOST].failures == 2  # one job per I/O thread
    check_idle(m)  # no staging slot left pinned or reserved
    m.free(targets)
    del m.disk.get_many_into  # the disk recovers: the blocks are still there
    num_ok, targets = load(m, metas)
    assert num_ok == 2 and same_bytes(m.kv_cache[targets[1].block_id], data[1])
    m.free(targets)


def test_a_record_for_other_tokens_is_never_served(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"ab": 2})
    (meta_a, meta_b), data = blocks["ab"]
    # Store another block's tokens under A's hash (as a hash collision would).
    impostor = BlockMeta(meta_a.block_hash, meta_a.parent_hash,
                         tuple(t + 1 for t in meta_a.token_ids))
    m.disk.delete([meta_a.block_hash])
    assert m.disk.put([impostor], [random_blocks(layout, 1, seed=9)[0]]) == 1
    assert m.lookup([meta_a.block_hash, meta_b.block_hash]).locations == [Tier.DISK] * 2
    num_ok, targets = load(m, [meta_a, meta_b])
    # A is a miss. B arrived intact, but only leading blocks count: B stays uncached too,
    # since the caller recomputes from A onwards.
    assert num_ok == 0
    assert targets[0].block_hash is None and targets[1].block_hash is None
    assert same_bytes(m.kv_cache[targets[1].block_id], data[1])
    assert m.stats().tiers[Tier.DISK].failures == 1
    assert m.lookup([meta_a.block_hash]).num_blocks == 0  # the bad record was deleted
    m.free(targets)
    check_idle(m)


def test_failed_gpu_copies_release_pins_and_count(managers, monkeypatch):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=4, host=2))
    managers.append(m)
    metas, data = chain(layout, "a", 1), random_blocks(layout, 1, seed=1)
    write(m, metas, data)
    evict_gpu(m)

    def broken_swap(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(m.transfers, "_swap", broken_swap)
    num_ok, targets = load(m, metas)
    assert num_ok == 0 and targets[0].block_hash is None
    m.free(targets)
    # A failed write-through leaves nothing in the host and gives the GPU block back.
    stored = write(m, chain(layout, "b", 1), random_blocks(layout, 1, seed=2))
    assert stored[0].ref_cnt == 0 and m.host.num_cached == 1
    assert m.stats().tiers[Tier.HOST].failures == 2
    check_idle(m)
    monkeypatch.undo()
    num_ok, targets = load(m, metas)  # the host copy of A was never harmed
    assert num_ok == 1 and same_bytes(m.kv_cache[targets[0].block_id], data[0])
    m.free(targets)


def test_only_leading_blocks_count(tmp_path, managers):
    layout = small_layout()
    m, blocks = disk_only(tmp_path, managers, layout, {"abc": 3})
    metas, data = blocks["abc"]
    m.disk.delete([metas[1].block_hash])
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.DISK]
    num_ok, targets = load(m, metas)
    # A arrives; B is nowhere, so B and everything after it are recomputed.
    assert num_ok == 1
    assert targets[0].block_hash == metas[0].block_hash
    assert targets[1].block_hash is None and targets[2].block_hash is None
    assert same_bytes(m.kv_cache[targets[0].block_id], data[0])
    assert m.lookup([metas[0].block_hash]).locations == [Tier.GPU]
    m.free(targets)
    check_idle(m)


def test_a_block_freed_before_complete_load_is_not_cached(managers):
    layout = small_layout()
    m = TierManager(layout, config(layout, None, gpu=4, host=2))
    managers.append(m)
    metas = chain(layout, "a", 1)
    write(m, metas, random_blocks(layout, 1, seed=1))
    evict_gpu(m)
    targets = m.allocate(1)
    load_id = m.prepare_load(metas, targets)
    m.free(targets)  # the request went away; the manager still holds the block
    assert targets[0].ref_cnt == 1
    assert m.complete_load(load_id) == 1
    assert targets[0].block_hash is None and targets[0].ref_cnt == 0
    assert m.lookup([metas[0].block_hash]).locations == [Tier.HOST]
    check_idle(m)


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


# ---- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
    ({"num_gpu_blocks": 4, "host_capacity_bytes": -1}, "host_capacity_bytes"),
    ({"num_gpu_blocks": 4, "disk_path": "/tmp/x"}, "disk_budget_bytes is required"),
    ({"num_gpu_blocks": 4, "disk_budget_bytes": 100}, "disk_path is None"),
    ({"num_gpu_blocks": 4, "disk_path": "/tmp/x", "disk_budget_bytes": 0}, "positive"),
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
    rounded = TierConfig(4, host_capacity_bytes=3 * layout.bytes_per_block + 1)
    assert rounded.num_host_slots(layout) == 3
    assert TierConfig(4).num_host_slots(layout) == 0 and not TierConfig(4).host_enabled
    with pytest.raises(ValueError, match="smaller than one block"):
        TierConfig(4, host_capacity_bytes=layout.bytes_per_block - 1).num_host_slots(layout)


# ---- the round-trip benchmark (cli/bench/roundtrip.py) on tiny sizes -----------------------

def test_roundtrip_bench_smoke_run(tmp_path):
    from cli.bench.roundtrip import run_roundtrip_bench

    result = run_roundtrip_bench(total_mib=1, repeats=1, num_layers=2, num_kv_heads=2,
                                 head_dim=16, block_size=4, disk_dir=tmp_path, device="cpu")
    assert result["num_blocks"] == 1024 and result["bytes_each_way"] == 1 << 20
    assert result["manager"]["verified"] and result["disk"]["verified"]
    assert result["manager"]["roundtrip_vs_ceiling"] > 0 and result["disk"]["restore_gbps"] > 0
