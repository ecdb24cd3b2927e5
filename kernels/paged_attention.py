"""paged_attention: causal attention of a batch mixing prefill chunks and decodes.

One kernel serves both. The queries of all requests are cut into tiles of `block_q` query
tokens; a program owns one tile and one kv head, and its rows are the tile's queries times
the query heads that share the kv head (GQA / MQA), so every K/V tile it loads is used by the
whole head group. Request r's tiles are numbered from `query_start_loc[r] // block_q + r`,
which bounds the grid by `num_tokens // block_q + num_reqs` and lets a program find its
request with a binary search (no host round trip).

A program walks the request's keys in tiles of `tile_n` tokens. A key tile may span several
pages (16-token blocks, 64-token tiles): each key's physical block comes from the block table
and its address from the cache strides, so the per-layer strided views of the cross-layer
cache work as they are. Tiles entirely below the causal diagonal skip the masking work.
Softmax is online (running max and sum in float32, exp2 with the scale folded in).

Split-KV (flash-decoding): when a batch of short query tiles would give too few programs to
fill the GPU, each (tile, kv head) also splits its keys into `num_splits` ranges; partial
outputs and log-sum-exps go to float32 scratch and `kernels.paged_decode` merges them.

The launcher's host work is done once per call geometry: a repeated geometry (the next
layer, the next step) launches the compiled kernels through their handles with kept scratch
(`kernels._attention_launch`); anything new takes the full path and is prepared after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks
from kvtier.kernels._attention_checks import check_args, looks_valid
from kvtier.kernels._attention_launch import PreparedLaunches, call_key
from kvtier.kernels.paged_decode import AttentionConfig, pick_config, reduce_splits, split_scratch

_LOG2E = 1.4426950408889634

#: Launches prepared per call geometry (a bounded memo, see kernels._attention_launch).
_PREPARED = PreparedLaunches()


def prepared_launches() -> PreparedLaunches:
    """The memo of prepared launches (its hits / misses counters; `clear()` to drop it)."""
    return _PREPARED


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The last request r whose first tile `query_start_loc[r] // BLOCK_Q + r` is <= tile."""
    lo = tile * 0  # int32 tensors even when num_reqs is specialised to a constant
    hi = tile * 0 + num_reqs  # the answer lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    return lo


@triton.jit
def _key_tile(start_n, hi, k_base, block_table_ptr, stride_k_b, stride_k_t, stride_v_b,
              stride_v_t, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
              DOT_FP32: tl.constexpr):
    """Keys [start_n, start_n + TILE_N) through the block table: their positions and
    in-range mask [TILE_N], the K tile [HEAD_DIM_PAD, TILE_N], and the offsets of their V
    rows [TILE_N] (loaded later by `_value_tile`, where the caller needs them)."""
    offs_n = start_n + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        n_ok = offs_n < hi
    else:
        n_ok = offs_n >= 0  # every key of an unmasked tile is in range
    phys = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_rows = phys * stride_k_b + in_block * stride_k_t
    k = tl.load(k_base + k_rows[None, :] + dims[:, None],
                mask=n_ok[None, :] & (dims < HEAD_DIM)[:, None], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    return offs_n, n_ok, k, phys * stride_v_b + in_block * stride_v_t


@triton.jit
def _value_tile(v_base, v_rows, n_ok, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """The V tile [TILE_N, HEAD_DIM_PAD] of the rows `_key_tile` found."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    v = tl.load(v_base + v_rows[:, None] + dims[None, :],
                mask=n_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    if DOT_FP32:
        v = v.to(tl.float32)
    return v


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                 stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold keys [start_n, start_n + TILE_N) into the running (acc, m_i, l_i)."""
    offs_n, n_ok, k, v_rows = _key_tile(
        start_n, hi, k_base, block_table_ptr, stride_k_b, stride_k_t, stride_v_b, stride_v_t,
        BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, MASKED, DOT_FP32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] float32
    if MASKED:
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may see no key of this tile yet (split-KV ranges); keep its exponents finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _value_tile(v_base, v_rows, n_ok, HEAD_DIM, HEAD_DIM_PAD, DOT_FP32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Integers that change from step to step are not specialised on (Triton would compile a
# variant for 1 and for multiples of 16): every step shape then reuses the kernels compiled
# at warm-up (engine.warmup).
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt_r", "stride_po_s",
                               "stride_pl_s"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_reqs, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_b, stride_k_t, stride_k_h, stride_v_b, stride_v_t, stride_v_h,
    stride_bt_r, stride_po_s, stride_po_t, stride_po_h, stride_pl_s, stride_pl_t,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLIT_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # Last tiles first: under the causal mask they carry the most keys, and starting them
    # early keeps the GPU from idling on a tail of heavy programs.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    q_tile_start = (tile - (q_start // BLOCK_Q + r)) * BLOCK_Q
    if q_tile_start < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile_start + rows // GROUP_PAD  # [BLOCK_M] query index inside the request
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        io_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        token = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                    + dims[None, :], mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = context_len + q_idx  # absolute position of each row's query

        # Keys this program reads: causal limit of its last query, cut to its split.
        hi = context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
        lo = 0
        if SPLIT_KV:
            split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
            lo = split * split_len
            hi = tl.minimum(hi, lo + split_len)
        # Whole tiles below the first row's diagonal need no mask.
        first_pos = context_len + q_tile_start
        unmasked_end = lo + tl.maximum(tl.minimum(hi, first_pos + 1) - lo, 0) // TILE_N * TILE_N

        block_table_ptr = block_tables_ptr + r.to(tl.int64) * stride_bt_r
        k_base = k_cache_ptr + kv_head * stride_k_h
        v_base = v_cache_ptr + kv_head * stride_v_h
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        for start_n in range(lo, unmasked_end, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, False, DOT_PRECISION, DOT_FP32)
        for start_n in range(unmasked_end, hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, True, DOT_PRECISION, DOT_FP32)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        result = acc / l_safe[:, None]
        if not SPLIT_KV:
            tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                     + dims[None, :], result.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
            part = split * stride_po_s + token * stride_po_t + head * stride_po_h  # [BLOCK_M]
            tl.store(part_out_ptr + part[:, None] + dims[None, :], result, mask=io_mask)
            tl.store(part_lse_ptr + split * stride_pl_s + token * stride_pl_t + head, lse,
                     mask=row_ok)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                    softmax_scale: float, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None) -> torch.Tensor:
    """Causal paged attention for a batch of prefill chunks and decodes; returns `out`.

    query, out: [num_tokens, num_heads, head_dim], float16 / bfloat16 / float32
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] of query's dtype
        (strided layer views are fine; head_dim must have stride 1)
    query_start_loc: [num_reqs + 1] int32 (padded with its last value)
    seq_lens: [num_reqs] int32; block_tables: [num_reqs, max_blocks_per_req] int32
    max_query_len, max_seq_len: host-side maxima (they pick the tiling, not correctness)
    softmax_scale: multiplies q.k (usually head_dim ** -0.5)
    config: tiling override (tests, benchmarks); None picks one from the shapes.

    Request r's queries are the last q_len tokens of its seq_lens[r]; padding requests
    (q_len 0) are skipped and rows of `out` past `query_start_loc[-1]` are not written.
    Accumulates in float32. Runs on the current stream. Raises ValueError on a wrong
    device, dtype, shape or stride, or num_heads not a multiple of num_kv_heads.
    """
    key = call_key(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if key is not None:
        prepared = _PREPARED.lookup(key, config, max_query_len, max_seq_len)
        if prepared is not None:
            done = prepared.launch(query, k_cache, v_cache, query_start_loc, seq_lens,
                                   block_tables, softmax_scale * _LOG2E, out)
            if done is not None:
                return done
    if not looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
        check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    if config is None:
        config = pick_config(query.device, query.dtype, num_tokens, num_reqs, num_kv_heads,
                             num_heads // num_kv_heads, head_dim, max_query_len, max_seq_len)
    if config.num_splits > 1:
        part_out, part_lse = split_scratch(config.num_splits, num_tokens, num_heads, head_dim,
                                           query.device)
    else:
        part_out = part_lse = out  # never read or written when num_splits == 1
    grid = (num_tokens // config.block_q + num_reqs, num_kv_heads, config.num_splits)
    args = _attention_args(query, k_cache, v_cache, out, part_out, part_lse, query_start_loc,
                           seq_lens, block_tables, softmax_scale * _LOG2E, config)
    compiled = _paged_attention_kernel[grid](*args, num_warps=config.num_warps,
                                             num_stages=config.num_stages)
    reduce = None
    if config.num_splits > 1:
        reduce = reduce_splits(part_out, part_lse, out, query_start_loc)
    if key is not None and query.device.type == "cuda":
        _PREPARED.record(key, query, num_reqs, num_kv_heads, config, (compiled, grid, args),
                         reduce)
    return out


def _attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, qk_scale: float,
                    config: AttentionConfig) -> tuple:
    """`_paged_attention_kernel`'s arguments in parameter order, constexprs included (the
    order `kernels._attention_launch` slices: 9 tensors, qk_scale, 12 integers fixed by the
    geometry, the block table's row stride, then the scratch strides and constexprs)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Triton's interpreter computes bfloat16 dots wrongly; it gets float32 operands instead.
    dot_fp32 = query.dtype == torch.float32 or (
        query.dtype == torch.bfloat16 and _checks.interpreting())
    return (
        query, k_cache, v_cache, out, part_out, part_lse, query_start_loc, seq_lens,
        block_tables, qk_scale, seq_lens.shape[0], config.num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        # GROUP, GROUP_PAD, BLOCK_Q, BLOCK_M, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD,
        # SPLIT_KV, DOT_PRECISION, DOT_FP32
        group, group_pad, config.block_q, config.block_q * group_pad, k_cache.shape[1],
        config.tile_n, head_dim, max(16, triton.next_power_of_2(head_dim)),
        config.num_splits > 1, "ieee" if dot_fp32 else "tf32", dot_fp32,
    )
