"""invariant_attention: paged causal attention whose every query row is the same bits
whatever the batch, the chunking of its prompt, and which of its keys were cached.

`paged_attention` picks its tiling from the step's shape and, for short batches, cuts each
request's keys into `num_splits` ranges whose length follows its seq_len: a token's output
then depends on its neighbours. Here the keys of every row are cut at fixed absolute
positions into splits of SPLIT_LEN keys, each split is reduced in key tiles of one width per
model with the online softmax (`_attend_tile`), and the splits' normalised outputs and
log2-sum-exps are merged one after the other in split order (`_merge_split`).

A row's operations do not depend on the query tile it sits in, so the tile's height follows
the step (16 score rows for decodes, 128 for prefill chunks): the scores' scale and max are
folded into explicit FMAs, which the compiler cannot contract one way in masked tiles and
another in unmasked ones, and each row's probabilities are summed through the tensor cores
(a product with ones) rather than by `tl.sum`, whose order follows the tile's register
layout (16- and 128-row tiles disagreed on Hopper GPUs with `tl.sum`; with the product,
tiles of 16 to 256 rows on 4 or 8 warps gave the same bits on an H200, which the GPU tests
check). The key tile's width would change a row's bits, so it is one per model.

Two launch shapes give the same bits: a program that walks all the keys of its rows in one
pass, folding each split into the merged state where the split ends (prefill: enough
programs already, and one long loop keeps the loads pipelined), or `num_split_programs`
programs per query tile taking every so many splits, each split's partial left in float32
scratch for `_merge_splits_kernel` (decodes and short chunks, which otherwise give the GPU
too few programs; the merge reads only the splits of the row's own keys). Both run the same
split result and merge steps in the same order. A split no key of which a row sees, and a
key tile past a row's position, leave its running state exactly as it was, so rows read
through whatever pages the block table names, cached or just stored, in one kernel for
prefill and decode rows alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks
from kvtier.kernels._attention_checks import check_args, looks_valid
from kvtier.kernels.paged_attention import _find_request, _key_tile, _value_tile

_LOG2E = 1.4426950408889634
#: Keys per split: a fixed length, so split boundaries sit at the same absolute positions for
#: every row of every batch. 1024 gives a batch-1 decode of a 6K context 6 splits per kv head;
#: 512 decoded batches of 1 faster and everything else slower (docs/DETERMINISM.md).
SPLIT_LEN = 1024


@dataclass(frozen=True, slots=True)
class InvariantAttentionConfig:
    """Tiling of invariant_attention (fixed per model: head counts, head dim, dtype)."""

    block_q: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.tile_n < 16 or self.tile_n & (self.tile_n - 1):
            raise ValueError(f"tile_n must be a power of two >= 16, got {self.tile_n}")
        if self.block_q < 1 or self.block_q & (self.block_q - 1):
            raise ValueError(f"block_q must be a power of two, got {self.block_q}")


_DECODE_ROWS = 16
_MIXED_ROWS = 64
_PREFILL_ROWS = 128


@functools.lru_cache(maxsize=256)
def pick_invariant_config(group: int, head_dim: int, dtype: torch.dtype,
                          max_query_len: int = 1,
                          mean_query_len: int | None = None) -> InvariantAttentionConfig:
    """The tiling for a step whose requests have at most `max_query_len` queries and
    `mean_query_len` on average (None: the maximum). Score rows (query tokens x the GQA
    group) per tile: 16 for decodes, 128 on 8 warps for prefill chunks, 64 for steps that
    mix them (a decode's tile computes all its rows). The tile's height never changes a
    row's bits (see the module docstring); the key tile's width would, so it is one per
    model: 128 keys, 64 for float32 and wide heads (CUDA-core dots, whose order may follow
    the layout, keep 16 rows for every step) and under Triton's interpreter (numpy dots
    round by the tile's shape: 64 rows for every step)."""
    group_pad = triton.next_power_of_2(group)
    if dtype == torch.float32 or head_dim > 128:
        return InvariantAttentionConfig(block_q=max(1, _DECODE_ROWS // group_pad), tile_n=64)
    if _checks.interpreting():
        return InvariantAttentionConfig(block_q=max(1, 64 // group_pad), tile_n=64)
    mean = max_query_len if mean_query_len is None else mean_query_len
    if max_query_len * group_pad <= _DECODE_ROWS:
        rows, warps = _DECODE_ROWS, 4
    elif mean * group_pad >= _PREFILL_ROWS:
        rows, warps = _PREFILL_ROWS, 8
    else:
        rows, warps = _MIXED_ROWS, 4
    return InvariantAttentionConfig(block_q=max(1, rows // group_pad), tile_n=128,
                                    num_warps=warps)


@triton.jit
def _merge_split(acc, total, m, part, lse):
    """Fold one split's normalised output `part` [.., HEAD_DIM_PAD] and log2-sum-exp `lse`
    into the running (weighted sum, weight sum, max lse). An empty split (lse -inf) leaves
    the state as it was. Its multiply-adds are explicit FMAs, so both kernels that merge
    round alike whatever the compiler would contract."""
    part = tl.where((lse == float("-inf"))[:, None], 0.0, part)  # unwritten scratch
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    weight = tl.exp2(lse - m_safe)
    acc = tl.fma(acc, alpha[:, None], part * weight[:, None])
    total = tl.fma(total, alpha, weight)
    return acc, total, m_new


@triton.jit
def _split_result(acc, m_i, l_i):
    """One split's normalised output [BLOCK_M, HEAD_DIM_PAD] and log2-sum-exp [BLOCK_M]
    (-inf where the split had no key of the row)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    return acc * (1.0 / l_safe)[:, None], lse


@triton.jit
def _fold_where_split_ends(end_n, acc, m_i, l_i, merged, total, m_run,
                           SPLIT_LEN: tl.constexpr):
    """Where keys up to `end_n` close a split: its result merged into (merged, total,
    m_run) and the split's running (acc, m_i, l_i) started again; else all as they were."""
    if end_n % SPLIT_LEN == 0:
        part, lse = _split_result(acc, m_i, l_i)
        merged, total, m_run = _merge_split(merged, total, m_run, part, lse)
        m_i = tl.full(m_i.shape, float("-inf"), dtype=tl.float32)
        l_i = tl.zeros(l_i.shape, dtype=tl.float32)
        acc = tl.zeros(acc.shape, dtype=tl.float32)
    return acc, m_i, l_i, merged, total, m_run


@triton.jit
def _normalised(merged, total):
    """The merged weighted sum over its weight (rows without keys stay 0)."""
    return merged * (1.0 / tl.where(total == 0.0, 1.0, total))[:, None]


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                 stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold keys [start_n, start_n + TILE_N) into the running (acc, m_i, l_i) with the same
    operations for a row whatever the tile's height and warps, and whether the tile is
    masked (which follows where the query tile starts):

    - the scores are scaled inside one explicit FMA with the max subtracted, the max taken
      before scaling (rounding is monotone, so it is the max of the scaled scores);
    - a row's probabilities are summed through the tensor cores, a product with ones over
      the 16-bit probabilities the values are weighted by: the MMA chain adds a row in one
      order for any tile, where `tl.sum` follows the tile's register layout (float32 keeps
      `tl.sum` and one tiling);
    - the running sum is rescaled with an FMA, and the values' product accumulates onto the
      rescaled output inside the MMA.
    """
    offs_n, n_ok, k, v_rows = _key_tile(
        start_n, hi, k_base, block_table_ptr, stride_k_b, stride_k_t, stride_v_b, stride_v_t,
        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, MASKED, DOT_FP32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] float32, unscaled
    if MASKED:
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # A row may see no key of this tile yet (split ranges); keep its exponents finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(s, qk_scale, -m_safe[:, None]))
    v = _value_tile(v_base, v_rows, n_ok, HEAD_DIM, HEAD_DIM_PAD, DOT_FP32)
    if DOT_FP32:
        row_sum = tl.sum(p, 1)
    else:
        p = p.to(v.dtype)
        ones = tl.full([TILE_N, 16], 1.0, dtype=v.dtype)
        # [BLOCK_M, 16], every column the row's sum; max picks one of them exactly.
        row_sum = tl.max(tl.dot(p, ones, input_precision=DOT_PRECISION), 1)
    l_i = tl.fma(l_i, alpha, row_sum)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "num_split_programs",
                               "stride_bt_r", "stride_po_s", "stride_pl_s"])
def _invariant_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_reqs, num_splits, num_split_programs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_b, stride_k_t, stride_k_h, stride_v_b, stride_v_t, stride_v_h,
    stride_bt_r, stride_po_s, stride_po_t, stride_po_h, stride_pl_s, stride_pl_t,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, WRITE_PARTS: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split_program = tl.program_id(2)
    r = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    q_tile_start = (tile - (q_start // BLOCK_Q + r)) * BLOCK_Q
    if q_tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile_start + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        io_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                    + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = context_len + q_idx
        # Keys the tile's last query sees; splits past them are empty for every row.
        tile_hi = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
        first_pos = context_len + q_tile_start
        block_table_ptr = block_tables_ptr + r.to(tl.int64) * stride_bt_r
        k_base = k_cache_ptr + kv_head * stride_k_h
        v_base = v_cache_ptr + kv_head * stride_v_h
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        merged = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        if WRITE_PARTS:
            for split in range(split_program, tl.cdiv(tile_hi, SPLIT_LEN), num_split_programs):
                lo = split * SPLIT_LEN
                hi = tl.minimum(tile_hi, lo + SPLIT_LEN)
                unmasked_end = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) \
                    // TILE_N * TILE_N
                m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
                for start_n in range(lo, unmasked_end, TILE_N):
                    acc, m_i, l_i = _attend_tile(
                        acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                        stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, False, DOT_PRECISION,
                        DOT_FP32)
                for start_n in range(unmasked_end, hi, TILE_N):
                    acc, m_i, l_i = _attend_tile(
                        acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                        stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, DOT_PRECISION,
                        DOT_FP32)
                part, lse = _split_result(acc, m_i, l_i)
                po = split * stride_po_s + token * stride_po_t + head * stride_po_h
                tl.store(part_out_ptr + po[:, None] + dims[None, :], part, mask=io_mask)
                tl.store(part_lse_ptr + split * stride_pl_s + token * stride_pl_t + head, lse,
                         mask=row_ok)
        else:
            # One pass over the keys, each split folded in where it ends: the same
            # operations as above, in loops long enough for the loads to pipeline.
            unmasked_end = (first_pos + 1) // TILE_N * TILE_N
            for start_n in range(0, unmasked_end, TILE_N):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, q_pos, start_n, tile_hi, k_base, v_base,
                    block_table_ptr, stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                    BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, False, DOT_PRECISION,
                    DOT_FP32)
                acc, m_i, l_i, merged, total, m_run = _fold_where_split_ends(
                    start_n + TILE_N, acc, m_i, l_i, merged, total, m_run, SPLIT_LEN)
            for start_n in range(unmasked_end, tile_hi, TILE_N):
                acc, m_i, l_i = _attend_tile(
                    acc, m_i, l_i, q, q_pos, start_n, tile_hi, k_base, v_base,
                    block_table_ptr, stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                    BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, DOT_PRECISION,
                    DOT_FP32)
                acc, m_i, l_i, merged, total, m_run = _fold_where_split_ends(
                    start_n + TILE_N, acc, m_i, l_i, merged, total, m_run, SPLIT_LEN)
            if tile_hi % SPLIT_LEN != 0:  # the last split ends inside the keys
                part, lse = _split_result(acc, m_i, l_i)
                merged, total, m_run = _merge_split(merged, total, m_run, part, lse)
            tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                     + dims[None, :], _normalised(merged, total).to(out_ptr.dtype.element_ty),
                     mask=io_mask)


@triton.jit(do_not_specialize=["num_reqs", "stride_po_s", "stride_pl_s"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, num_reqs,
    stride_po_s, stride_po_t, stride_po_h, stride_pl_s, stride_pl_t, stride_o_t, stride_o_h,
    num_heads, SPLIT_LEN: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    if token < tl.load(query_start_loc_ptr + num_reqs):
        # The token's request: the last r whose queries start at or before it.
        lo = token * 0
        hi = token * 0 + num_reqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            starts_before = tl.load(query_start_loc_ptr + mid) <= token
            lo = tl.where(starts_before, mid, lo)
            hi = tl.where(starts_before, hi, mid)
        q_start = tl.load(query_start_loc_ptr + lo)
        q_end = tl.load(query_start_loc_ptr + lo + 1)
        position = tl.load(seq_lens_ptr + lo) - (q_end - q_start) + (token - q_start)
        token64 = token.to(tl.int64)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        head_ok = heads < num_heads
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
        m_run = tl.full([HEADS], float("-inf"), dtype=tl.float32)
        total = tl.zeros([HEADS], dtype=tl.float32)
        merged = tl.zeros([HEADS, HEAD_DIM_PAD], dtype=tl.float32)
        # The splits of the row's own keys, all written; later ones would weigh nothing.
        for split in range(0, tl.cdiv(position + 1, SPLIT_LEN)):
            lse = tl.load(part_lse_ptr + split * stride_pl_s + token64 * stride_pl_t + heads,
                          mask=head_ok, other=float("-inf"))
            part = tl.load(part_out_ptr + split * stride_po_s + token64 * stride_po_t
                           + heads[:, None] * stride_po_h + dims[None, :], mask=mask,
                           other=0.0)
            merged, total, m_run = _merge_split(merged, total, m_run, part, lse)
        tl.store(out_ptr + token64 * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
                 _normalised(merged, total).to(out_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def invariant_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                        softmax_scale: float, out: torch.Tensor | None = None,
                        split_programs: bool | None = None,
                        split_len: int = SPLIT_LEN,
                        config: InvariantAttentionConfig | None = None) -> torch.Tensor:
    """Causal paged attention for prefill chunks and decodes, each row batch-invariant.

    Arguments as `kernels.paged_attention` (same shapes, dtypes and meaning).
    `max_seq_len` must be at least every seq_len (it sizes the split scratch; a bigger
    value only costs empty programs). split_programs: force (True) or forbid (False) one
    program per split; None decides from the launch's size. Either way a row's output is
    the same bits. split_len: keys per split (tests use short ones; rows are comparable
    only under one split_len). config: tiling override (tests, benchmarks; rows are
    comparable only under one `tile_n`); None: `pick_invariant_config` for the step.
    Accumulates in float32. Runs on the current stream. Raises ValueError on a wrong device,
    dtype, shape or stride, or heads that do not divide.
    """
    if not looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
        check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if config is None:
        config = pick_invariant_config(group, head_dim, query.dtype, max_query_len,
                                       num_tokens // num_reqs)
    if split_len % config.tile_n:
        raise ValueError(f"split_len={split_len} must be a multiple of the {config.tile_n}-key "
                         "tile")
    num_splits = max(1, triton.cdiv(max_seq_len, split_len))
    num_tiles = num_tokens // config.block_q + num_reqs
    programs = num_tiles * num_kv_heads
    if split_programs is None:
        split_programs = num_splits > 1 and programs < 2 * _num_sms(query.device)
    write_parts = split_programs and num_splits > 1
    num_split_programs = 1
    if write_parts:
        # Enough programs for about four per SM; each takes every num_split_programs-th
        # split, so a long max_seq_len (a CUDA graph's) costs scratch, not idle programs.
        num_split_programs = min(num_splits, triton.cdiv(4 * _num_sms(query.device), programs))
    if write_parts:
        scratch = torch.empty(num_splits * num_tokens * num_heads * (head_dim + 1),
                              dtype=torch.float32, device=query.device)
        part_out = scratch[:num_splits * num_tokens * num_heads * head_dim].view(
            num_splits, num_tokens, num_heads, head_dim)
        part_lse = scratch[num_splits * num_tokens * num_heads * head_dim:].view(
            num_splits, num_tokens, num_heads)
    else:
        part_out = part_lse = out  # never read or written
    dot_fp32 = query.dtype == torch.float32 or (
        query.dtype == torch.bfloat16 and _checks.interpreting())
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    _invariant_attention_kernel[(num_tiles, num_kv_heads, num_split_programs)](
        query, k_cache, v_cache, out, part_out, part_lse, query_start_loc, seq_lens,
        block_tables, softmax_scale * _LOG2E, num_reqs, num_splits, num_split_programs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=config.block_q,
        BLOCK_M=config.block_q * group_pad, BLOCK_SIZE=k_cache.shape[1], TILE_N=config.tile_n,
        SPLIT_LEN=split_len, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32", DOT_FP32=dot_fp32, WRITE_PARTS=write_parts,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False)
    if write_parts:
        heads_per_program = min(triton.next_power_of_2(num_heads), 8)
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, heads_per_program))](
            part_out, part_lse, out, query_start_loc, seq_lens, num_reqs,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            num_heads, SPLIT_LEN=split_len, HEADS=heads_per_program, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4, enable_fp_fusion=False)
    return out
