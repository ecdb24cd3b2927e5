"""The Triton store_kv kernel against kernels.reference.store_kv, on strided layer views."""

from __future__ import annotations

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import reference, store_kv


def check_store(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    # [num_blocks, num_layers, 2, block_size, kv_heads, dim], NaN where nothing is written.
    cache = torch.full((num_blocks, 3, 2, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=dtype, device=device)
    expected = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.2] = -1  # skipped tokens
    key, value, slots = key.to(device), value.to(device), slots.to(device)
    store_kv(key, value, cache[:, 1, 0], cache[:, 1, 1], slots)
    reference.store_kv(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    # Bitwise equal, NaN where both left the poison: nothing else of the cache was touched.
    assert torch.equal(cache.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert torch.equal(cache.isnan(), expected.isnan())


@cases.needs_interpreter
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_store_kv_matches_reference(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    check_store(37, 3, head_dim, block_size, dtype, "cpu", seed=head_dim + block_size)


@cases.needs_interpreter
def test_store_kv_many_heads_split_over_programs() -> None:
    # 40 heads x 128 dims exceeds one program's tile, so heads spread over a 2-D grid.
    check_store(9, 40, 128, 16, torch.float16, "cpu", seed=1)


@cases.needs_interpreter
def test_store_kv_rejects_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = torch.zeros(4, 2, 2, 16, 2, 8)
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    key = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 5, -1])
    with pytest.raises(ValueError, match="dtype"):
        store_kv(key.half(), key.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="num_tokens=3"):
        store_kv(key, key, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="head_dim=8"):
        store_kv(key, key, cache[:, 0, 0, :, :, :4], v_cache, slots)
    with pytest.raises(ValueError, match="stride 1"):
        store_kv(key, key, k_cache.transpose(2, 3).contiguous().transpose(2, 3), v_cache,
                 slots)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        store_kv(key, key, k_cache, v_cache, slots)


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_store_kv_matches_reference(dtype: torch.dtype) -> None:
    check_store(5000, 8, 128, 16, dtype, "cuda", seed=2)
    check_store(777, 3, 64, 128, dtype, "cuda", seed=3)
