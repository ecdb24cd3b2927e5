"""TierManager on CUDA: the round trip with each copy method, loads completed while their
copies still run, and the order between a load's copy and the model's steps. Skipped
without a CUDA device; the CPU scenarios are in test_manager.py."""

import os
from pathlib import Path

import pytest
import torch
from manager_cases import (
    chain,
    check_idle,
    config,
    evict_gpu,
    load,
    random_blocks,
    same_bytes,
    write,
)

from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Direction, Tier

#: 32 KiB blocks in bfloat16, as on a GPU.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=torch.bfloat16)


def cuda_manager(managers: list, disk_dir: Path | None = None, **kwargs) -> TierManager:
    """A manager on CUDA with 8 GPU blocks and 4 host slots (and a disk tier in `disk_dir`),
    closed with the test's other managers."""
    m = TierManager(LAYOUT, config(LAYOUT, disk_dir, gpu=8, host=4, **kwargs), "cuda")
    managers.append(m)
    return m


def computed_blocks(m: TierManager, data: torch.Tensor) -> list:
    """Fresh GPU blocks of `m` holding `data` [n, *block_shape], written on the current
    stream as a step writes them."""
    blocks = m.allocate(data.shape[0])
    assert blocks is not None, "test setup: not enough free GPU blocks"
    for block, block_data in zip(blocks, data):
        m.kv_cache[block.block_id].copy_(block_data.cuda())
    return blocks


@pytest.mark.gpu
@pytest.mark.parametrize("swap_method", ["dma", "staged", "triton"])
def test_round_trip_on_cuda(tmp_path, managers, swap_method):
    if swap_method == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton copy kernel is measured compiled, not interpreted")
    m = cuda_manager(managers, tmp_path, swap_method=swap_method)
    layout = m.layout
    # On CUDA the disk tier runs in a worker process over a shared, page-locked slab.
    assert m.uses_disk_worker and m.host.shared_memory is not None
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


@pytest.mark.gpu
def test_loads_completed_early_on_cuda_free_their_slots_for_the_next_store(managers):
    # On CUDA complete_load returns while the copies may still run (the compute stream waits
    # for them); their host slots stay pinned until a poll reaps the copies. A full host
    # tier then takes the next write-through, and every byte arrived.
    m = cuda_manager(managers)
    layout = m.layout
    for name in ("first", "second"):
        metas, data = chain(layout, name, 4), random_blocks(layout, 4, seed=len(name))
        write(m, metas, data.cuda())
        assert m.stats().tiers[Tier.HOST].rejected == 0, "the write-through found no slot"
        evict_gpu(m)
        num_ok, blocks = load(m, metas)
        assert num_ok == 4
        for block, expected in zip(blocks, data):  # .cpu() runs after the copies
            assert same_bytes(m.kv_cache[block.block_id].cpu(), expected)
        torch.cuda.synchronize()
        m.poll()
        m.free(blocks)
    m.flush()
    check_idle(m)


@pytest.mark.gpu
def test_a_load_on_cuda_follows_the_work_queued_before_it_took_its_blocks(managers):
    # A load's copy waits for the compute stream's work queued before the load took its
    # GPU blocks (that work may still write them) and not for work queued afterwards (the
    # model's next steps, which leave the load's blocks alone).
    m = cuda_manager(managers)
    layout = m.layout
    metas, data = chain(layout, "ordered", 2), random_blocks(layout, 2, seed=3)
    write(m, metas, data.cuda())
    evict_gpu(m)
    blocks = m.allocate(2)
    assert blocks is not None
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # long work queued first, then writes into the load's blocks
        x = x @ x / 64
    for block in blocks:
        m.kv_cache[block.block_id].fill_(7)
    load_id = m.prepare_load(metas, blocks)
    for _ in range(20):  # the model's later steps: the copy need not wait for them
        x = x @ x / 64
    assert m.complete_load(load_id) == 2  # the current stream now waits for the copy
    for block, expected in zip(blocks, data):
        assert same_bytes(m.kv_cache[block.block_id].cpu(), expected)
    torch.cuda.synchronize()
    m.poll()
    copy = m.transfers.stats()[Direction.HOST_TO_GPU]
    assert copy.num_jobs >= 1 and copy.failures == 0
    m.free(blocks)
    check_idle(m)


@pytest.mark.gpu
def test_a_queued_store_on_cuda_follows_its_step_and_not_the_steps_after_it(managers):
    # `cache_full_blocks` records where the compute stream stands (after the work that
    # wrote the blocks); `submit_stores`, called while a later step runs, starts the copy
    # after that point: the bytes are the computed ones, and they land while the later
    # step still runs.
    m = cuda_manager(managers)
    layout = m.layout
    metas, data = chain(layout, "queued", 2), random_blocks(layout, 2, seed=11)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(10):  # the step: long work, then the writes into the blocks
        x = x @ x / 64
    blocks = computed_blocks(m, data)
    m.cache_full_blocks(blocks, metas)
    m.free(blocks)
    assert m.num_stores_queued == 2
    torch.cuda._sleep(2_000_000_000)  # the next step: about a second of GPU time
    later = torch.cuda.Event()
    later.record()
    m.submit_stores()
    while not all(m.host.contains(meta.block_hash) for meta in metas):
        assert not later.query(), "the store waited for the step after its own"
        m.poll()
    for meta, expected in zip(metas, data):
        assert same_bytes(m.host.slab[m.host.lookup(meta.block_hash)], expected)
    torch.cuda.synchronize()
    m.poll()
    check_idle(m)


@pytest.mark.gpu
def test_waiting_for_stores_on_cuda_returns_once_the_copies_landed(managers):
    # A scheduler short of blocks waits for in-flight copies instead of preempting: when
    # `wait_for_stores` returns, the copies have landed and their blocks are free.
    m = cuda_manager(managers)
    layout = m.layout
    metas, data = chain(layout, "wait", 3), random_blocks(layout, 3, seed=13)
    blocks = computed_blocks(m, data)
    torch.cuda._sleep(500_000_000)  # the step still runs when the copies are submitted
    m.cache_full_blocks(blocks, metas)
    m.free(blocks)
    m.submit_stores()
    m.poll()
    assert m.stats().num_jobs_in_flight == 1 and m.pool.num_free_blocks == 5
    assert not m.wait_for_stores(4)
    assert m.wait_for_stores(3)
    assert m.pool.num_free_blocks == 8 and m.stats().num_jobs_in_flight == 0
    for meta, expected in zip(metas, data):
        assert same_bytes(m.host.slab[m.host.lookup(meta.block_hash)], expected)
    check_idle(m)
