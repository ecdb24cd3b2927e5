"""The optional flash-attn backend: availability rules, and results equal to the reference."""

from __future__ import annotations

import importlib.util

import kernel_cases as cases
import pytest
import torch
from kvtier.kernels import flash_available, flash_paged_attention, reference

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def test_flash_needs_block_sizes_divisible_by_256() -> None:
    assert not flash_available(16)
    assert not flash_available(128)
    assert not flash_available(0)
    assert flash_available(512) == (HAS_FLASH and torch.cuda.is_available())


def test_flash_refuses_what_it_cannot_serve() -> None:
    case = cases.build_attention_case([5], [5], num_kv_heads=1, group=2, head_dim=16,
                                      block_size=16, dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match="divisible by 256"):
        flash_paged_attention(*case.args(), 0.25)


@pytest.mark.gpu
@cases.requires_cuda
@pytest.mark.skipif(not HAS_FLASH, reason="flash-attn is not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_flash_matches_reference(dtype: torch.dtype) -> None:
    case = cases.build_attention_case([1500, 700, 2049, 0, 600], [1500, 128, 1, 0, 1],
                                      num_kv_heads=4, group=4, head_dim=128, block_size=256,
                                      dtype=dtype, device="cuda", seed=1)
    out = flash_paged_attention(*case.args(), 128 ** -0.5)
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args()]
    expected = reference.paged_attention(*cpu_args, 128 ** -0.5)
    num_valid = int(case.query_start_loc[-1])
    torch.testing.assert_close(out[:num_valid].cpu(), expected[:num_valid],
                               **cases.TOLERANCES[dtype])
