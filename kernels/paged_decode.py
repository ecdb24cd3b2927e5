"""Tiling choice for paged attention, and the split-KV (flash-decoding) reduction.

A decode batch with few requests and long contexts gives `paged_attention` too few
(tile, kv head) programs to keep the GPU's memory system busy: batch 1 of Llama-3-8B has
8 kv heads, i.e. 8 programs on a 132-SM GPU. Such batches split each program's keys into
`num_splits` ranges; every range leaves a normalised partial output and its log2-sum-exp,
and `_reduce_splits_kernel` merges them per (token, head):

    out = sum_s 2^(lse_s - M) * out_s / sum_s 2^(lse_s - M),   M = max_s lse_s

An empty range has lse = -inf and weight 0. A prefill chunk of a few tokens after a long
context (a question asked of a restored 32K-token document) is as short of programs as a
decode batch and splits the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

#: A split is worth its scratch traffic only when it covers at least this many keys.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 128
#: Programs per SM a decode launch should reach before splitting stops paying.
_PROGRAMS_PER_SM = 4


#: Shared memory per block (bytes, opt-in) that the wide prefill tiling needs.
_WIDE_PREFILL_SHARED_MEMORY = 200 * 1024


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _num_sms(device_index: int) -> int:
    """Multiprocessors of a CUDA device (a constant, read once: the launcher runs per layer)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _shared_memory(device_index: int) -> int:
    """Shared memory a block of a CUDA device may opt in to, in bytes (0 when unknown)."""
    properties = torch.cuda.get_device_properties(device_index)
    return int(getattr(properties, "shared_memory_per_block_optin", 0))


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tiling of one paged_attention launch.

    block_q: query tokens per program (times the GQA group = rows of the score tile);
    tile_n: keys per inner step; num_splits: key ranges per program (1 = no split-KV);
    num_warps / num_stages: Triton launch options.
    """

    block_q: int
    tile_n: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for field in ("block_q", "tile_n", "num_splits", "num_warps", "num_stages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionConfig.{field} must be a positive integer, "
                                 f"got {value!r}")
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"AttentionConfig.tile_n must be a power of two >= 16, "
                             f"got {self.tile_n}")
        if self.block_q & (self.block_q - 1):
            raise ValueError(f"AttentionConfig.block_q must be a power of two, "
                             f"got {self.block_q}")


# Memoised: the launcher runs per layer per step and the answer depends only on the
# arguments (and on fixed device properties); steps repeat the same shapes.
@functools.lru_cache(maxsize=4096)
def pick_config(device: torch.device, dtype: torch.dtype, num_tokens: int, num_reqs: int,
                num_kv_heads: int, group: int, head_dim: int, max_query_len: int,
                max_seq_len: int) -> AttentionConfig:
    """A tiling for the batch: decode-shaped (short query tiles) when every request has at
    most a few queries, prefill-shaped otherwise; either splits the keys (split-KV) when its
    programs would leave the GPU's SMs idle and the sequences are long enough, e.g. a decode
    batch, or a question of a few tokens asked after a long restored context."""
    group_pad = triton.next_power_of_2(group)
    decode_block_m = max(16, group_pad)
    decode_shaped = max_query_len <= decode_block_m // group_pad
    wide_prefill = False
    if decode_shaped:
        block_q, tile_n, num_warps, num_stages = decode_block_m // group_pad, 64, 4, 2
    elif dtype == torch.float32:
        # Exact float32 dots run on CUDA cores, not tensor cores: big tiles only spill.
        block_q, tile_n, num_warps, num_stages = max(1, decode_block_m // group_pad), 64, 4, 2
    elif head_dim > 128:
        block_q, tile_n = max(1, max(64, group_pad) // group_pad), 64
        num_warps, num_stages = 8, 2
    else:
        # 128 rows, 64 keys, 4 warps, 3 stages: the fastest tiling measured for a chunk
        # after a long prefix (split-KV); one pass over a prompt takes the wide tiling below.
        block_q, tile_n = max(1, max(128, group_pad) // group_pad), 64
        num_warps, num_stages = 4, 3
        wide_prefill = device.type == "cuda" and _shared_memory(_device_index(device)) \
            >= _WIDE_PREFILL_SHARED_MEMORY
    num_splits = 1
    # A prefill chunk splits only when it is short next to its context (a few new tokens
    # after a long cached or restored prefix); a fresh prompt keeps one pass over its keys.
    if device.type == "cuda" and (decode_shaped or max_seq_len >= 4 * max_query_len):
        num_sms = _num_sms(_device_index(device))
        programs = (num_tokens // block_q + num_reqs) * num_kv_heads
        wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, programs)
        num_splits = max(1, min(wanted, max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))
    if decode_shaped and num_splits == 1 and device.type == "cuda":
        # Many requests, one pass each (batch 64 x 2K): 32-key tiles with 3 stages beat
        # 64 x 2 in the tiling sweep (docs/KERNELS.md, "How the kernel works").
        tile_n, num_stages = 32, 3
    if wide_prefill and num_splits == 1:
        # 256 rows, 128 keys, 8 warps, 2 stages: the fastest one-pass tiling of the sweep
        # (docs/KERNELS.md, "How the kernel works"); it needs Hopper-sized shared memory.
        block_q, tile_n = max(1, max(256, group_pad) // group_pad), 128
        num_warps, num_stages = 8, 2
    return AttentionConfig(block_q=block_q, tile_n=tile_n, num_splits=num_splits,
                           num_warps=num_warps, num_stages=num_stages)


#: Splits merged per step of the reduction loop (a constant, so any split count reuses one
#: compiled kernel).
_SPLIT_TILE = 16


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_po_s", "stride_pl_s"])
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_reqs, num_splits,
    stride_po_s, stride_po_t, stride_po_h, stride_pl_s, stride_pl_t, stride_o_t, stride_o_h,
    SPLIT_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Rows past the last request's queries were never computed; leave them untouched.
    if token < tl.load(query_start_loc_ptr + num_reqs):
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        token64 = token.to(tl.int64)
        # Running merge over tiles of splits: max lse, weight sum and weighted output.
        m = tl.full([], float("-inf"), dtype=tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
        for first in range(0, num_splits, SPLIT_TILE):
            splits = first + tl.arange(0, SPLIT_TILE)
            split_ok = splits < num_splits
            lse = tl.load(part_lse_ptr + splits * stride_pl_s + token64 * stride_pl_t + head,
                          mask=split_ok, other=float("-inf"))  # [SPLIT_TILE]
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split seen keys yet
            alpha = tl.exp2(m - m_safe)
            weight = tl.exp2(lse - m_safe)
            parts = tl.load(part_out_ptr + splits[:, None] * stride_po_s + token64 * stride_po_t
                            + head * stride_po_h + dims[None, :],
                            mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
            acc = acc * alpha + tl.sum(parts * weight[:, None], 0)  # [HEAD_DIM_PAD]
            total = total * alpha + tl.sum(weight, 0)
            m = m_new
        tl.store(out_ptr + token64 * stride_o_t + head * stride_o_h + dims,
                 (acc / total).to(out_ptr.dtype.element_ty), mask=dim_ok)


def split_scratch(num_splits: int, num_tokens: int, num_heads: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scratch of one split-KV launch, in one allocation: partial outputs
    [num_splits, num_tokens, num_heads, head_dim], then their log2-sum-exps
    [num_splits, num_tokens, num_heads]. Always laid out the same way for the same sizes
    (prepared launches reuse kernels specialised on these strides and alignments)."""
    num_parts = num_splits * num_tokens * num_heads
    scratch = torch.empty(num_parts * (head_dim + 1), dtype=torch.float32, device=device)
    part_out = scratch[:num_parts * head_dim].view(num_splits, num_tokens, num_heads, head_dim)
    part_lse = scratch[num_parts * head_dim:].view(num_splits, num_tokens, num_heads)
    return part_out, part_lse


def reduce_split_args(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor) -> tuple[tuple[int, int], tuple]:
    """(grid, arguments in parameter order, constexprs included) of `_reduce_splits_kernel`;
    the first four arguments are the tensors passed in, the rest depend only on shapes and
    strides."""
    num_splits, num_tokens, num_heads, head_dim = part_out.shape
    args = (part_out, part_lse, out, query_start_loc, query_start_loc.shape[0] - 1, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            _SPLIT_TILE, head_dim, triton.next_power_of_2(head_dim))
    return (num_tokens, num_heads), args


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                  query_start_loc: torch.Tensor) -> tuple[Any, tuple[int, int], tuple]:
    """Merge split-KV partials into `out`; returns (what the JIT launch returned: the
    compiled kernel on a GPU, grid, arguments) so the caller can prepare the next launch.

    part_out: [num_splits, num_tokens, num_heads, head_dim] float32 (normalised per split)
    part_lse: [num_splits, num_tokens, num_heads] float32, log2-sum-exp (-inf when empty)
    out: [num_tokens, num_heads, head_dim]; query_start_loc: [num_reqs + 1] int32.
    Internal to paged_attention, which has checked the arguments.
    """
    num_splits, num_tokens, num_heads, _ = part_out.shape
    assert part_lse.shape == (num_splits, num_tokens, num_heads), \
        f"partials disagree: {tuple(part_out.shape)} vs {tuple(part_lse.shape)}"
    assert part_out.stride(-1) == 1 and part_lse.stride(-1) == 1 and out.stride(-1) == 1, \
        "reduce_splits needs unit inner strides"
    grid, args = reduce_split_args(part_out, part_lse, out, query_start_loc)
    compiled = _reduce_splits_kernel[grid](*args, num_warps=4)
    return compiled, grid, args
