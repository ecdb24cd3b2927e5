"""copy_blocks and swap_blocks (every method) against the reference block copies."""

from __future__ import annotations

import kernel_cases as cases
import numpy as np
import pytest
import torch
from kvtier.kernels import SWAP_METHODS, copy_blocks, plan_dma, reference, swap_blocks
from kvtier.kernels._swap_plan import coalesce, growing_slices, run_starts, split_even
from kvtier.kernels.copy_blocks import launch_block_copy
from kvtier.kernels.swap_blocks import _addresses, _swap_staged, choose_method, coalesce_runs

# [num_layers, 2, block_size, kv_heads, head_dim] with an odd element count, so float16
# blocks are 2-byte words only and the last chunk of a block is partial.
ODD_BLOCK = (3, 2, 5, 3, 7)


def random_blocks(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                  seed: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(num_blocks, *block_shape, generator=generator).to(dtype)
    return blocks.pin_memory() if pin else blocks.to(device)


def test_coalesce_runs_merges_consecutive_pairs_in_the_given_order() -> None:
    pairs = [[7, 4], [5, 1], [6, 2], [1, 7], [2, 8], [3, 9], [9, 0]]
    assert coalesce_runs(pairs) == [(7, 4, 1), (5, 1, 2), (1, 7, 3), (9, 0, 1)]
    # Rows are not sorted: a run listed out of order is copied in pieces.
    assert coalesce_runs([[6, 2], [5, 1], [1, 7]]) == [(6, 2, 1), (5, 1, 1), (1, 7, 1)]
    assert coalesce_runs([]) == []


@cases.needs_interpreter
@pytest.mark.parametrize("block_shape", [(2, 2, 16, 2, 8), ODD_BLOCK], ids=["even", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_copy_blocks_matches_reference(dtype: torch.dtype, block_shape: tuple) -> None:
    cache = random_blocks(9, block_shape, dtype, seed=1)
    expected = cache.clone()
    mapping = torch.tensor([[0, 5], [1, 6], [8, 2]])
    copy_blocks(cache, mapping)
    reference.copy_blocks(expected, mapping)
    assert torch.equal(cache, expected)


def scattered_rows(num_rows: int, num_src: int, num_dst: int, seed: int,
                   dst_run: int = 1) -> torch.Tensor:
    """[num_rows, 2] (src, dst) rows: random sources, destinations in runs of `dst_run`
    consecutive blocks placed at random (1: every destination random)."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(num_dst // dst_run) * dst_run
    dst = (starts[:, None] + np.arange(dst_run)).reshape(-1)[:num_rows]
    src = rng.permutation(num_src)[:num_rows]
    return torch.from_numpy(np.stack([src, dst], 1).astype(np.int64))


def bits(blocks: torch.Tensor) -> torch.Tensor:
    """Integer view, so NaN payloads compare bit for bit."""
    return blocks.view(torch.int16) if blocks.element_size() == 2 else blocks.view(torch.int32)


def test_coalesce_matches_a_loop() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(0, 40))
        rows = scattered_rows(n, 60, 60, seed=trial, dst_run=int(rng.integers(1, 5))).numpy()
        rows[: n // 2] = np.stack([np.arange(n // 2) + 3, np.arange(n // 2) + 40], 1)[: n // 2]
        rows = rows[np.unique(rows[:, 1], return_index=True)[1]]  # distinct destinations
        runs = coalesce(rows[:, 0].copy(), rows[:, 1].copy())
        expected: list[list[int]] = []
        for src, dst in rows.tolist():
            if expected and src == sum(expected[-1][::2]) and dst == sum(expected[-1][1:]):
                expected[-1][2] += 1
            else:
                expected.append([src, dst, 1])
        assert [list(r) for r in zip(runs.src_starts.tolist(), runs.dst_starts.tolist(),
                                     runs.lengths.tolist())] == expected
    assert run_starts(np.array([4, 5, 6, 9, 2, 3])).tolist() == [0, 3, 4]
    spread = coalesce(np.array([3, 1, 2]), np.array([5, 7, 8]), dst_dense=False)
    assert spread.lengths.tolist() == [1, 1, 1] and spread.src_starts.tolist() == [3, 1, 2]


def test_split_even_covers_every_run_once() -> None:
    lengths = np.array([1, 7, 2, 2, 9, 1, 1, 4])
    for parts in range(1, 10):
        slices = split_even(lengths, parts)
        assert 1 <= len(slices) <= parts
        assert [i for part in slices for i in range(part.start, part.stop)] == list(range(8))
    assert split_even(np.zeros(0, dtype=np.int64), 4) == []


def test_growing_slices_double_up_to_the_largest_and_cover_every_item_once() -> None:
    slices = growing_slices(1000, 32, 125)
    assert [p.stop - p.start for p in slices] == [32, 64, 125, 125, 125, 125, 125, 125, 125,
                                                  29]
    assert [i for part in slices for i in range(part.start, part.stop)] == list(range(1000))
    assert [p.stop - p.start for p in growing_slices(5, 32, 0)] == [1] * 5
    assert growing_slices(0, 32, 4) == []


def test_copy_addresses_follow_each_side_s_stride() -> None:
    # What the batched DMA call receives: byte addresses of every run's first block on each
    # side and the run's size; the destination's blocks are spaced apart (a strided view).
    src = torch.zeros((10, 3, 4), dtype=torch.float16)
    dst = torch.zeros((8, 2, 3, 4), dtype=torch.float16)[:, 1]  # stride 2 blocks
    runs = coalesce(np.array([7, 2, 3, 4]), np.array([0, 5, 6, 7]), True, False)
    dsts, srcs, sizes = _addresses(src, dst, runs)
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    assert dsts.tolist() == [dst[d].data_ptr() for d in runs.dst_starts.tolist()]
    assert srcs.tolist() == [src[i].data_ptr() for i in runs.src_starts.tolist()]
    assert sizes.tolist() == [24 * n for n in runs.lengths.tolist()]
    # Plans of 32-bit ids give the same addresses (the uint64 view is of int64 values).
    narrow = coalesce(np.array([7, 2, 3, 4], dtype=np.int32),
                      np.array([0, 5, 6, 7], dtype=np.int32), True, False)
    assert [a.tolist() for a in _addresses(src, dst, narrow)] == [dsts.tolist(),
                                                                  srcs.tolist(),
                                                                  sizes.tolist()]


def test_auto_stages_small_blocks_only_when_host_runs_are_longer() -> None:
    rows = scattered_rows(64, 128, 128, seed=1, dst_run=16).numpy()  # GPU -> host runs
    runs = coalesce(rows[:, 0].copy(), rows[:, 1].copy())
    host = rows[:, 1].copy()
    assert choose_method(runs, host, 64 << 10) == "staged"
    assert choose_method(runs, host, 2 << 20) == "dma"  # copies already large
    assert choose_method(runs, host, 256 << 10) == "dma"
    assert choose_method(runs, None, 64 << 10) == "dma"  # no dense host side
    random_host = scattered_rows(64, 128, 4096, seed=1).numpy()  # few slots adjacent
    random_runs = coalesce(random_host[:, 0].copy(), random_host[:, 1].copy())
    assert choose_method(random_runs, random_host[:, 1].copy(), 64 << 10) == "dma"
    # Half the slots taken at random: host runs of about 2 blocks are not worth a staging pass.
    dense_random = scattered_rows(64, 128, 128, seed=2).numpy()
    dense_runs = coalesce(dense_random[:, 0].copy(), dense_random[:, 1].copy())
    assert choose_method(dense_runs, dense_random[:, 1].copy(), 32 << 10) == "dma"
    contiguous = coalesce(np.arange(64), np.arange(64))
    assert choose_method(contiguous, np.arange(64), 32 << 10) == "dma"


# Tiny blocks of several sizes: 1 element, odd (2-byte words, partial last chunk), one chunk
# of the Triton kernel plus a partial one, and a model-shaped block.
CPU_BLOCKS = {"1": (1,), "odd": ODD_BLOCK, "chunk+": (4096 + 24,), "model": (2, 2, 16, 2, 8)}


@cases.needs_interpreter
@pytest.mark.parametrize("method", SWAP_METHODS)
@pytest.mark.parametrize("block", list(CPU_BLOCKS), ids=str)
@pytest.mark.parametrize("dst_run", [1, 4], ids=["scattered", "dst-runs"])
def test_swap_blocks_on_cpu_matches_reference(block: str, method: str, dst_run: int) -> None:
    block_shape = CPU_BLOCKS[block]
    src = random_blocks(13, block_shape, torch.float16, seed=2)
    dst = torch.full((16, *block_shape), float("nan"), dtype=torch.float16)
    expected = dst.clone()
    mapping = scattered_rows(11, 13, 16, seed=3, dst_run=dst_run)
    mapping[:3] = torch.tensor([[1, 4], [2, 5], [3, 6]])  # one run adjacent on both sides
    mapping = mapping[np.unique(mapping[:, 1].numpy(), return_index=True)[1]]
    # A staging area of 3 blocks: several chunks, the last one partial.
    staging = 3 * src[0].numel() * src.element_size()
    swap_blocks(src, dst, mapping, method=method, staging_bytes=staging)
    reference.swap_blocks(src, expected, mapping)
    assert torch.equal(bits(dst), bits(expected))


@pytest.mark.parametrize("scatter", [False, True], ids=["gather", "scatter"])
@pytest.mark.parametrize("staging_blocks", [1, 2, 5, 100])
def test_staged_plan_on_cpu(scatter: bool, staging_blocks: int) -> None:
    # The CPU form of both staged directions: gather src blocks and copy the runs of dst
    # slots, or copy the runs of src slots and scatter into dst blocks.
    block_shape = (3, 5)
    src = random_blocks(20, block_shape, torch.float32, seed=7)
    dst = torch.full((24, *block_shape), float("nan"))
    if scatter:  # host runs on the source side
        mapping = scattered_rows(14, 20, 24, seed=8, dst_run=3).flip(1)
        mapping = torch.stack([mapping[:, 0] % 20, mapping[:, 1]], 1)
        mapping = mapping[np.unique(mapping[:, 1].numpy(), return_index=True)[1]]
    else:
        mapping = scattered_rows(14, 20, 24, seed=8, dst_run=3)
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    _swap_staged(src, dst, mapping[:, 0].numpy().copy(), mapping[:, 1].numpy().copy(),
                 staging_blocks * 2 * 15 * 4, scatter)
    assert torch.equal(bits(dst), bits(expected))


@cases.needs_interpreter
@pytest.mark.parametrize("max_programs", [1, 3])
def test_capped_grid_strides_over_every_chunk(max_programs: int) -> None:
    # Blocks of 3 chunks (the last one partial): 2 or 3 programs each copy several chunks.
    block_shape = (2 * 4096 * 3 - 100,)
    src = random_blocks(4, block_shape, torch.float32, seed=6)
    dst = torch.full((5, *block_shape), float("nan"))
    mapping = torch.tensor([[3, 0], [0, 4], [2, 2]])
    launch_block_copy(src, dst, mapping, max_programs=max_programs)
    expected = torch.full_like(dst, float("nan"))
    reference.swap_blocks(src, expected, mapping)
    assert torch.equal(dst.nan_to_num(9.0), expected.nan_to_num(9.0))


def test_a_dma_plan_checks_first_and_copies_when_enqueued() -> None:
    src = random_blocks(13, CPU_BLOCKS["model"], torch.float16, seed=5)
    dst = torch.full((16, *CPU_BLOCKS["model"]), float("nan"), dtype=torch.float16)
    mapping = torch.tensor([[1, 4], [2, 5], [3, 6], [9, 0], [0, 15]])
    plan = plan_dma(src, dst, mapping)
    assert plan.runs.num_runs == 3  # rows 1-3 adjacent on both sides: one run
    assert torch.isnan(dst.float()).all()  # nothing moves before `enqueue`
    plan.enqueue()
    expected = torch.full_like(dst, float("nan"))
    reference.swap_blocks(src, expected, mapping)
    assert torch.equal(bits(dst), bits(expected))
    with pytest.raises(ValueError, match="out of range"):
        plan_dma(src, dst, torch.tensor([[13, 0]]))


@cases.needs_interpreter
def test_block_copies_reject_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_blocks(4, (2, 3), torch.float32, seed=3)
    dst = torch.zeros(4, 2, 3)
    good = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="method"):
        swap_blocks(src, dst, good, method="fastest")
    with pytest.raises(ValueError, match="block shape"):
        swap_blocks(src, torch.zeros(4, 3, 2), good)
    with pytest.raises(ValueError, match="dtype"):
        swap_blocks(src, dst.half(), good)
    with pytest.raises(ValueError, match="out of range"):
        swap_blocks(src, dst, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="int64"):
        swap_blocks(src, dst, good.int())
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        swap_blocks(src, dst, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous span"):
        swap_blocks(src.transpose(1, 2), dst.transpose(1, 2), good)
    with pytest.raises(ValueError, match="staging_bytes"):
        swap_blocks(src, dst, good, staging_bytes=0)
    with pytest.raises(ValueError, match="distinct"):
        copy_blocks(src, torch.tensor([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match="also be sources"):
        copy_blocks(src, torch.tensor([[0, 1], [1, 2]]))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        swap_blocks(src, dst, good, method="triton")
    with pytest.raises(ValueError, match="CUDA"):
        copy_blocks(src, good)


# --- GPU <-> pinned host -----------------------------------------------------------------

GPU_BLOCK_BYTES = [1 << s for s in range(15, 24)]  # 32 KiB ... 8 MiB


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("method", SWAP_METHODS)
@pytest.mark.parametrize("block_bytes", GPU_BLOCK_BYTES, ids=lambda b: f"{b >> 10}K")
@pytest.mark.parametrize("host_run", [1, 8], ids=["scattered", "host-runs"])
def test_gpu_swap_every_size_both_ways_at_once(block_bytes: int, method: str,
                                               host_run: int) -> None:
    # 16 MiB each way (at least 4 blocks), scattered GPU blocks, host slots random or in
    # runs; a staging area of a few blocks so the staged path cycles both halves. Only the
    # callers' streams are synchronized: side streams must have joined them.
    num = max(4, (16 << 20) // block_bytes)
    elements = block_bytes // 2
    gpu = random_blocks(2 * num, (elements,), torch.bfloat16, seed=block_bytes, device="cuda")
    host = random_blocks(2 * num, (elements,), torch.bfloat16, seed=block_bytes + 1, pin=True)
    gpu_before, host_before = gpu.cpu(), host.clone()
    out_rows = scattered_rows(num, 2 * num, 2 * num, seed=5, dst_run=host_run)
    gpu_taken = set(out_rows[:, 0].tolist())
    free_gpu = torch.tensor([i for i in range(2 * num) if i not in gpu_taken])
    host_taken = set(out_rows[:, 1].tolist())
    free_host = torch.tensor([i for i in range(2 * num) if i not in host_taken])
    in_rows = torch.stack([free_host, free_gpu[torch.randperm(num, generator=torch.Generator()
                                                              .manual_seed(6))]], 1)
    out_stream, in_stream = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (out_stream, in_stream):
        stream.wait_stream(torch.cuda.current_stream())
    staging = 3 * block_bytes
    swap_blocks(gpu, host, out_rows, method=method, stream=out_stream, staging_bytes=staging)
    swap_blocks(host, gpu, in_rows, method=method, stream=in_stream, staging_bytes=staging)
    out_stream.synchronize()
    in_stream.synchronize()
    expected_host, expected_gpu = host_before.clone(), gpu_before.clone()
    reference.swap_blocks(gpu_before, expected_host, out_rows)
    reference.swap_blocks(host_before, expected_gpu, in_rows)
    assert torch.equal(bits(host), bits(expected_host))
    assert torch.equal(bits(gpu.cpu()), bits(expected_gpu))


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_dma_plan_enqueues_on_the_stream_it_is_given() -> None:
    block_shape = (4, 2, 16, 8, 128)
    gpu = random_blocks(32, block_shape, torch.bfloat16, seed=6, device="cuda")
    other = torch.zeros_like(gpu)
    rows = torch.tensor([[3, 0], [4, 1], [5, 2], [30, 31], [10, 20]])
    plan = plan_dma(gpu, other, rows)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    plan.enqueue(stream)
    stream.synchronize()
    for src, dst in rows.tolist():
        assert torch.equal(other[dst], gpu[src])
    assert int(other[6:20].count_nonzero()) == 0


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("method", SWAP_METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_swap_both_directions_on_a_stream(dtype: torch.dtype, method: str) -> None:
    block_shape = (4, 2, 16, 8, 128)  # 4 layers of an 8-kv-head model, 16-token blocks
    gpu = random_blocks(64, block_shape, dtype, seed=4, device="cuda")
    host = torch.full((48, *block_shape), float("nan"), dtype=dtype).pin_memory()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out_rows = [[3, 0], [4, 1], [5, 2], [60, 47], [10, 20], [11, 21], [0, 5]]
    swap_blocks(gpu, host, torch.tensor(out_rows), method=method, stream=stream)
    stream.synchronize()
    for src, dst in out_rows:
        assert torch.equal(host[dst], gpu[src].cpu())
    back = torch.full_like(gpu, float("nan"))
    in_rows = [[src, dst] for dst, src in out_rows]  # host -> other GPU slots
    swap_blocks(host, back, torch.tensor(in_rows), method=method, stream=stream)
    stream.synchronize()
    expected = torch.full_like(back, float("nan"))
    reference.swap_blocks(host, expected, torch.tensor(in_rows))
    assert torch.equal(back.nan_to_num(9.0), expected.nan_to_num(9.0))


@pytest.mark.gpu
@cases.requires_cuda
def test_gpu_copy_blocks_and_pageable_host_rejected() -> None:
    cache = random_blocks(32, ODD_BLOCK, torch.float16, seed=5, device="cuda")
    expected = cache.clone()
    mapping = torch.tensor([[0, 9], [1, 10], [31, 2]])
    copy_blocks(cache, mapping)
    copy_blocks(cache, torch.tensor([[3, 20]], device="cuda"))
    reference.copy_blocks(expected, mapping)
    reference.copy_blocks(expected, torch.tensor([[3, 20]]))
    assert torch.equal(cache, expected)
    pageable = torch.zeros(4, *ODD_BLOCK, dtype=torch.float16)
    for method in SWAP_METHODS:
        with pytest.raises(ValueError, match="pin_memory"):
            swap_blocks(cache, pageable, torch.tensor([[0, 1]]), method=method)
