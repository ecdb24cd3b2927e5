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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks
from kvtier.kernels.paged_decode import AttentionConfig, pick_config, reduce_splits

_LOG2E = 1.4426950408889634


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
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, hi, k_base, v_base, block_table_ptr,
                 stride_k_b, stride_k_t, stride_v_b, stride_v_t, qk_scale,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Fold keys [start_n, start_n + TILE_N) into the running (acc, m_i, l_i)."""
    offs_n = start_n + tl.arange(0, TILE_N)  # [TILE_N] key positions
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    if MASKED:
        n_ok = offs_n < hi
    else:
        n_ok = offs_n >= 0  # every key of an unmasked tile is in range
    phys = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_rows = phys * stride_k_b + in_block * stride_k_t  # [TILE_N]
    v_rows = phys * stride_v_b + in_block * stride_v_t
    k = tl.load(k_base + k_rows[None, :] + dims[:, None],
                mask=n_ok[None, :] & dim_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, TILE_N]
    if DOT_FP32:
        k = k.to(tl.float32)
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
    v = tl.load(v_base + v_rows[:, None] + dims[None, :],
                mask=n_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_PAD]
    if DOT_FP32:
        v = v.to(tl.float32)
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


def _looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
    """One cheap pass over the facts `_check_args` verifies, for the common valid call (this
    runs per layer per step; the detailed checks cost tens of microseconds)."""
    device, dtype = query.device, query.dtype
    return (query.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_cache.shape[3] == query.shape[2] and k_cache.shape[2] > 0
            and query.shape[1] % k_cache.shape[2] == 0
            and dtype in _checks.FLOAT_DTYPES and k_cache.dtype == dtype
            and v_cache.dtype == dtype and seq_lens.dim() == 1
            and query_start_loc.shape == (seq_lens.shape[0] + 1,)
            and block_tables.dim() == 2 and block_tables.shape[0] == seq_lens.shape[0]
            and query_start_loc.dtype == torch.int32 and seq_lens.dtype == torch.int32
            and block_tables.dtype == torch.int32 and device.type == "cuda"
            and k_cache.device == device and v_cache.device == device
            and query_start_loc.device == device and seq_lens.device == device
            and block_tables.device == device
            and query.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
            and query_start_loc.stride(0) == 1 and seq_lens.stride(0) == 1
            and block_tables.stride(1) == 1
            and (out is None or (out.shape == query.shape and out.dtype == dtype
                                 and out.device == device and out.stride(2) == 1)))


def _check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
    _checks.check_shape("query", query, (None, None, None), "[num_tokens, num_heads, head_dim]")
    _, num_heads, head_dim = query.shape
    _checks.check_shape("k_cache", k_cache, (None, None, None, head_dim),
                        f"[num_blocks, block_size, num_kv_heads, head_dim={head_dim}]")
    _checks.check_shape("v_cache", v_cache, tuple(k_cache.shape),
                        f"like k_cache {tuple(k_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    _checks.check_shape("seq_lens", seq_lens, (None,), "[num_reqs]")
    num_reqs = seq_lens.shape[0]
    _checks.check_shape("query_start_loc", query_start_loc, (num_reqs + 1,),
                        f"[num_reqs + 1 = {num_reqs + 1}]")
    _checks.check_shape("block_tables", block_tables, (num_reqs, None),
                        f"[num_reqs={num_reqs}, max_blocks_per_req]")
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                         ("block_tables", block_tables)):
        _checks.check_dtype(name, tensor, (torch.int32,))
        _checks.check_inner_contiguous(name, tensor)
    _checks.check_dtype("query", query, _checks.FLOAT_DTYPES)
    _checks.check_same_dtype("query", query, k_cache=k_cache, v_cache=v_cache)
    _checks.check_kernel_device("query", query)
    _checks.check_same_device("query", query, k_cache=k_cache, v_cache=v_cache,
                              query_start_loc=query_start_loc, seq_lens=seq_lens,
                              block_tables=block_tables)
    if out is not None:
        _checks.check_shape("out", out, tuple(query.shape), f"like query {tuple(query.shape)}")
        _checks.check_same_dtype("query", query, out=out)
        _checks.check_same_device("query", query, out=out)
    for name, tensor in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("out", out)):
        if tensor is not None:
            _checks.check_inner_contiguous(name, tensor)


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
    if not _looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
        _check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    if config is None:
        config = pick_config(query.device, query.dtype, num_tokens, num_reqs, num_kv_heads,
                             group, head_dim, max_query_len, max_seq_len)
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    num_splits = config.num_splits
    if num_splits > 1:
        # One allocation (this runs per layer per step): [num_splits, num_tokens, num_heads,
        # head_dim] float32 partial outputs, then their log2-sum-exp [num_splits, num_tokens,
        # num_heads].
        num_parts = num_splits * num_tokens * num_heads
        scratch = torch.empty(num_parts * (head_dim + 1), dtype=torch.float32,
                              device=query.device)
        part_out = scratch[:num_parts * head_dim].view(num_splits, num_tokens, num_heads,
                                                       head_dim)
        part_lse = scratch[num_parts * head_dim:].view(num_splits, num_tokens, num_heads)
    else:
        part_out = part_lse = out  # never read or written when num_splits == 1
    # Triton's interpreter computes bfloat16 dots wrongly; it gets float32 operands instead.
    dot_fp32 = query.dtype == torch.float32 or (
        query.dtype == torch.bfloat16 and _checks.interpreting())
    grid = (num_tokens // config.block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part_out, part_lse,
        query_start_loc, seq_lens, block_tables,
        softmax_scale * _LOG2E, num_reqs, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=config.block_q,
        BLOCK_M=config.block_q * group_pad, BLOCK_SIZE=block_size,
        TILE_N=config.tile_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        SPLIT_KV=num_splits > 1,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32", DOT_FP32=dot_fp32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        reduce_splits(part_out, part_lse, out, query_start_loc)
    return out
