"""The "bounce" swap method: its chunk plan on the CPU, auto's choice, and the host-function
binding it runs on (GPU)."""

from __future__ import annotations

import threading
import time

import kernel_cases as cases
import numpy as np
import pytest
import torch
from kvtier.kernels import reference, swap_blocks
from kvtier.kernels._bounce import NUM_BUFFERS, chunk_blocks, swap_bounce
from kvtier.kernels._host_copy import HostCopier
from kvtier.kernels._host_fn import host_functions
from kvtier.kernels._swap_plan import coalesce
from kvtier.kernels.swap_blocks import _swap_bounce_share, choose_method


def random_rows(num_rows: int, num_gpu: int, num_host: int, seed: int) -> np.ndarray:
    """[num_rows, 2] (gpu id, host slot): both sides random, slots distinct."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(num_gpu)[:num_rows],
                     rng.permutation(num_host)[:num_rows]], 1).astype(np.int64)


@pytest.mark.parametrize("to_gpu", [False, True], ids=["to-host", "to-gpu"])
@pytest.mark.parametrize("staging_blocks", [1, 3, 4, 7, 1000])
def test_bounce_plan_on_cpu(to_gpu: bool, staging_blocks: int) -> None:
    # Both sides as CPU tensors: the same chunks and index copies the GPU form enqueues.
    generator = torch.Generator().manual_seed(staging_blocks)
    gpu = torch.randn(30, 6, generator=generator)
    host = torch.randn(40, 6, generator=generator)
    rows = random_rows(17, 30, 40, seed=staging_blocks)
    expected_gpu, expected_host = gpu.clone(), host.clone()
    if to_gpu:
        reference.swap_blocks(host, expected_gpu, torch.from_numpy(rows[:, ::-1].copy()))
    else:
        reference.swap_blocks(gpu, expected_host, torch.from_numpy(rows.copy()))
    swap_bounce(gpu, host, rows[:, 0].copy(), rows[:, 1].copy(), to_gpu,
                staging_blocks * 6 * 4, None)
    assert torch.equal(gpu, expected_gpu)
    assert torch.equal(host, expected_host)


def test_bounce_chunks_fit_the_staging() -> None:
    mib = 1 << 20
    # About 12 chunks of at least 4 MiB, all buffers within the staging bound.
    assert chunk_blocks(1000, 256 << 10, 64 * mib) == 83  # 21 MiB chunks
    assert chunk_blocks(1000, 32 << 10, 64 * mib) == 128  # 4 MiB chunks
    assert chunk_blocks(10, 32 << 10, 64 * mib) == 10  # one chunk
    assert chunk_blocks(100, 8 * mib, 64 * mib) == 2  # the bound wins
    assert chunk_blocks(100, 8 * mib, 8 * mib) == 1  # at least one block
    for blocks, size in ((1000, 256 << 10), (4096, 32 << 10), (64, 2 * mib)):
        chunk = chunk_blocks(blocks, size, 64 * mib)
        assert NUM_BUFFERS * chunk * size <= 64 * mib


def test_auto_bounces_small_scattered_copies() -> None:
    rows = random_rows(256, 512, 512, seed=3)
    runs = coalesce(rows[:, 0].copy(), rows[:, 1].copy())
    host = rows[:, 1].copy()
    assert choose_method(runs, host, 256 << 10, can_bounce=True) == "mixed"
    assert choose_method(runs, host, 256 << 10, can_bounce=False) == "dma"
    assert choose_method(runs, host, 2 << 20, can_bounce=True) == "dma"  # large copies
    few = coalesce(rows[:8, 0].copy(), rows[:8, 1].copy())
    assert choose_method(few, host[:8], 64 << 10, can_bounce=True) == "dma"  # few copies
    contiguous = coalesce(np.arange(256), np.arange(256))
    assert choose_method(contiguous, np.arange(256), 32 << 10, can_bounce=True) == "dma"


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_host_function_runs_in_stream_order() -> None:
    # A host function that takes a while writes pinned memory; the copy enqueued after it on
    # the same stream must see the write, and the caller's event must wait for it.
    host_fns = host_functions()
    assert host_fns is not None
    pinned = torch.zeros(1024, dtype=torch.int64).pin_memory()
    device = torch.full((1024,), -1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    ran_on: list[int] = []

    def fill() -> None:
        time.sleep(0.05)
        pinned.fill_(7)
        ran_on.append(threading.get_ident())

    host_fns.launch(stream.cuda_stream, fill)
    with torch.cuda.stream(stream):
        device.copy_(pinned, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    assert ran_on and ran_on[0] != threading.get_ident()
    assert torch.equal(device.cpu(), torch.full((1024,), 7, dtype=torch.int64))
    assert host_fns.collect() == 0


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_failed_host_copy_is_reported_to_the_next_swap() -> None:
    host_fns = host_functions()
    assert host_fns is not None
    stream = torch.cuda.Stream()
    host_fns.launch(stream.cuda_stream, lambda: torch.zeros(2).index_copy_(
        0, torch.tensor([5]), torch.ones(1)))  # an out-of-range slot raises
    stream.synchronize()
    gpu = torch.zeros(4, 8, device="cuda")
    host = torch.zeros(4, 8).pin_memory()
    with pytest.raises(RuntimeError, match="host copies of an earlier swap failed"):
        swap_blocks(gpu, host, torch.tensor([[0, 1]]), method="bounce", stream=stream)
    swap_blocks(gpu, host, torch.tensor([[0, 1]]), method="bounce", stream=stream)  # once
    stream.synchronize()


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("block_bytes", [32 << 10, 256 << 10], ids=lambda b: f"{b >> 10}K")
def test_gpu_bounce_round_trip_on_one_stream(block_bytes: int) -> None:
    # GPU -> host then host -> GPU of the same slots, queued back to back: the second
    # call's CPU gathers must wait for the first call's CPU scatters.
    num = 96
    elements = block_bytes // 4
    generator = torch.Generator(device="cuda").manual_seed(block_bytes)
    gpu = torch.randn((2 * num, elements), generator=generator, device="cuda")
    host = torch.zeros((2 * num, elements)).pin_memory()
    rows = torch.from_numpy(random_rows(num, num, 2 * num, seed=9))
    back = torch.stack([rows[:, 1], rows[:, 0] + num], 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    staging = 4 * block_bytes  # one block per chunk: every buffer reused many times
    swap_blocks(gpu, host, rows, method="bounce", stream=stream, staging_bytes=staging)
    swap_blocks(host, gpu, back, method="bounce", stream=stream, staging_bytes=staging)
    stream.synchronize()
    assert torch.equal(gpu[num + rows[:, 0]], gpu[rows[:, 0]])
    assert torch.equal(host[rows[:, 1]], gpu[rows[:, 0]].cpu())


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("to_gpu", [False, True], ids=["to-host", "to-gpu"])
def test_bounce_share_splits_rows_between_both_ways_on_cpu(share: float, to_gpu: bool) -> None:
    # The "mixed" plan on CPU tensors: the first share of the rows (by host slot) bounced,
    # the rest copied as runs; every block lands once.
    generator = torch.Generator().manual_seed(11)
    gpu = torch.randn(50, 4, 3, generator=generator)
    host = torch.randn(60, 4, 3, generator=generator)
    rows = random_rows(40, 50, 60, seed=12)
    rows[:5] = np.stack([np.arange(5) + 10, np.arange(5) + 20], 1)  # a run on both sides
    rows = rows[np.unique(rows[:, 1], return_index=True)[1]]
    src, dst = (host, gpu) if to_gpu else (gpu, host)
    mapping = rows[:, ::-1].copy() if to_gpu else rows.copy()
    expected = dst.clone()
    reference.swap_blocks(src, expected, torch.from_numpy(mapping))
    _swap_bounce_share(src, dst, mapping[:, 0].copy(), mapping[:, 1].copy(), 5 * 48, None,
                       share)
    assert torch.equal(dst, expected)


def test_host_copier_splits_over_threads() -> None:
    copier = HostCopier(3)
    rng = np.random.default_rng(13)
    slab = rng.integers(0, 1 << 40, size=(120, 20000), dtype=np.int64)  # 160 KB rows
    slots = rng.permutation(120)[:50]  # 3 parts of at least 1 MiB
    rows = np.zeros((50, 20000), dtype=np.int64)
    copier.gather(slab, slots, rows)
    assert np.array_equal(rows, slab[slots])
    target = np.zeros_like(slab)
    copier.scatter(target, slots, rows)
    assert np.array_equal(target[slots], slab[slots])
    assert not target[np.setdiff1d(np.arange(120), slots)].any()
    with pytest.raises(ValueError, match="positive"):
        HostCopier(0)
