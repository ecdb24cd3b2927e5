"""copy_blocks and swap_blocks (both methods) against the reference block copies."""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import copy_blocks, reference, swap_blocks
from kvtier.kernels.copy_blocks import launch_block_copy
from kvtier.kernels.swap_blocks import coalesce_runs

# [num_layers, 2, block_size, kv_heads, head_dim] with an odd element count, so float16
# blocks are 2-byte words only and the last chunk of a block is partial.
ODD_BLOCK = (3, 2, 5, 3, 7)


def random_blocks(num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                  seed: int, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randn(num_blocks, *block_shape, generator=generator).to(dtype)
    return blocks.pin_memory() if pin else blocks.to(device)


def test_coalesce_runs_merges_consecutive_pairs() -> None:
    pairs = [[7, 4], [5, 1], [1, 7], [2, 8], [3, 9], [6, 2], [9, 0]]
    assert coalesce_runs(pairs) == [(1, 7, 3), (5, 1, 2), (7, 4, 1), (9, 0, 1)]
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


@cases.needs_interpreter
@pytest.mark.parametrize("method", ["triton", "dma", "auto"])
@pytest.mark.parametrize("block_shape", [(2, 2, 16, 2, 8), ODD_BLOCK], ids=["even", "odd"])
def test_swap_blocks_on_cpu_matches_reference(block_shape: tuple, method: str) -> None:
    src = random_blocks(7, block_shape, torch.float16, seed=2)
    dst = torch.full((9, *block_shape), float("nan"), dtype=torch.float16)
    expected = dst.clone()
    # Rows 1..3 form one run; the others are scattered.
    mapping = torch.tensor([[6, 0], [1, 4], [2, 5], [3, 6], [0, 8]])
    swap_blocks(src, dst, mapping, method=method)
    reference.swap_blocks(src, expected, mapping)
    assert torch.equal(dst.nan_to_num(9.0), expected.nan_to_num(9.0))


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

@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("method", ["triton", "dma", "auto"])
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
    for method in ("triton", "dma", "auto"):
        with pytest.raises(ValueError, match="pin_memory"):
            swap_blocks(cache, pageable, torch.tensor([[0, 1]]), method=method)
