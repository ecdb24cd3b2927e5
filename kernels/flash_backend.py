"""Optional flash-attn backend for paged attention, fed the same metadata as the kernels.

flash-attn 2's paged KV path (`flash_attn_varlen_func(..., block_table=...)`) needs block
sizes divisible by 256, float16 / bfloat16 and CUDA; `flash_available` says whether a
configuration qualifies. Its causal mask is bottom-right aligned when a request has fewer
queries than keys, which is the contract of `kernels.paged_attention`.
"""

from __future__ import annotations

import importlib.util

import torch
from kvtier.kernels import _checks

#: flash-attn 2 pages must hold a multiple of this many tokens.
FLASH_BLOCK_MULTIPLE = 256


def flash_available(block_size: int) -> bool:
    """True when flash-attn imports, CUDA is present and `block_size` is a multiple of 256."""
    if block_size <= 0 or block_size % FLASH_BLOCK_MULTIPLE != 0:
        return False
    if not torch.cuda.is_available():
        return False
    return importlib.util.find_spec("flash_attn") is not None


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                    softmax_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.paged_attention` through flash-attn; same arguments, same result.

    Unlike the Triton kernel, rows of `out` past `query_start_loc[-1]` are overwritten with
    unspecified values. Raises ValueError when flash-attn cannot serve the configuration
    (see `flash_available`) or the dtype is not float16 / bfloat16.
    """
    block_size = k_cache.shape[1]
    if not flash_available(block_size):
        raise ValueError(f"flash-attn cannot serve block_size={block_size}: it needs the "
                         f"flash_attn package, CUDA and a block size divisible by "
                         f"{FLASH_BLOCK_MULTIPLE}; use kernels.paged_attention instead")
    _checks.check_dtype("query", query, (torch.float16, torch.bfloat16))
    _checks.check_same_dtype("query", query, k_cache=k_cache, v_cache=v_cache)
    from flash_attn import flash_attn_varlen_func

    cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32,
                               device=seq_lens.device)  # [num_reqs + 1]
    cu_seqlens_k[1:] = torch.cumsum(seq_lens, 0)
    result = flash_attn_varlen_func(
        query, k_cache, v_cache, cu_seqlens_q=query_start_loc, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len, softmax_scale=softmax_scale,
        causal=True, block_table=block_tables)
    if out is None:
        return result
    return out.copy_(result)
