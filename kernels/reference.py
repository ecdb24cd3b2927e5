"""Pure-torch versions of every kernel: the engine's CPU path and the reference in tests.

Shapes and meanings follow docs/ARCHITECTURE.md. The caches are per-layer views
`[num_blocks, block_size, num_kv_heads, head_dim]` of the cross-layer cache, so they are
strided; everything here writes through indexing on those views, never through a copy.

Numerics: attention runs in float32 (inputs of other dtypes are upcast, the result is cast
back) through torch's scaled_dot_product_attention per request, without ever repeating K/V
per query head or looping per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SWAP_METHODS = ("auto", "dma", "staged", "triton")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the K/V of new tokens into the paged cache.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (strided views are fine)
    slot_mapping: [num_tokens] int64, `block_id * block_size + offset`; -1 = skip the token.

    Values are cast to the cache dtype. Raises ValueError when shapes disagree.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key/value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=key.device, dtype=torch.int64)
    valid = slots >= 0  # [num_tokens]
    slots = slots[valid]
    block_ids = slots // block_size
    offsets = slots % block_size
    # index_put_ on the strided views writes straight into the shared cross-layer storage.
    k_cache[block_ids, offsets] = key[valid].to(k_cache.dtype)
    v_cache[block_ids, offsets] = value[valid].to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one request: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].to(torch.int64)]  # [nb, block_size, kvh, d]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
            ) -> torch.Tensor:
    """Causal attention of the last q_len of seq_len tokens (bottom-right aligned).

    q: [1, num_heads, q_len, head_dim]; k, v: [1, num_kv_heads, seq_len, head_dim];
    all float32. Returns [1, num_heads, q_len, head_dim] float32.
    """
    q_len, seq_len = q.shape[2], k.shape[2]
    # The same call Hugging Face's default "sdpa" attention makes in these two cases, so
    # float32 outputs match it as closely as possible; torch's is_causal is top-left
    # aligned, so a chunk after a cached context needs an explicit mask.
    if q_len == seq_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale,
                                              enable_gqa=True)
    if q_len == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, enable_gqa=True)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=softmax_scale,
                                          enable_gqa=True)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                    softmax_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a batch mixing prefill chunks and decodes over a paged cache.

    query: [num_tokens, num_heads, head_dim]; out (written and returned): the same shape.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32;
    block_tables: [num_reqs, max_blocks_per_req] int32.
    Request r's queries are the last q_len tokens of its seq_lens[r] tokens; requests with
    q_len 0 are padding and skipped (their rows of `out`, if any, are left untouched).
    `max_query_len` / `max_seq_len` are accepted for signature parity with the kernels.
    GQA: query head h reads kv head h // (num_heads // num_kv_heads).

    Raises ValueError when num_heads is not a multiple of num_kv_heads or a request's
    q_len exceeds its seq_len.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"request {r}: q_len={q_len} exceeds seq_len={seq_len}")
        # Gather the request's K/V once through its block table.
        k = _gather_kv(k_cache, block_tables[r], seq_len)  # [seq_len, kvh, d]
        v = _gather_kv(v_cache, block_tables[r], seq_len)
        k = k.to(torch.float32).permute(1, 0, 2).unsqueeze(0)  # [1, kvh, seq_len, d]
        v = v.to(torch.float32).permute(1, 0, 2).unsqueeze(0)
        q = query[q_start:q_end].to(torch.float32).permute(1, 0, 2).unsqueeze(0)
        o = _attend(q, k, v, softmax_scale)  # [1, num_heads, q_len, d]
        out[q_start:q_end] = o[0].permute(1, 0, 2).to(out.dtype)
    return out


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks inside one cache: `kv_cache[dst] = kv_cache[src]` per mapping row.

    kv_cache: [num_blocks, *block_shape]; block_mapping: [n, 2] int64 rows (src, dst).
    All sources are read before any destination is written.
    """
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64)
    kv_cache.index_copy_(0, mapping[:, 1], kv_cache.index_select(0, mapping[:, 0]))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                method: str = "auto", stream: torch.cuda.Stream | None = None) -> None:
    """Copy whole blocks between two tensors, possibly on different devices.

    src: [n_src, *block_shape]; dst: [n_dst, *block_shape]; block_mapping: [n, 2] int64
    rows (src_index, dst_index). `method` is accepted for signature parity with the kernel
    launcher and only validated; the copy runs on `stream` when one is given.
    Raises ValueError for an unknown method or mismatched block shapes.
    """
    if method not in _SWAP_METHODS:
        raise ValueError(f"method must be one of {_SWAP_METHODS}, got {method!r}")
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"src and dst blocks differ: {tuple(src.shape[1:])} {src.dtype} vs "
                         f"{tuple(dst.shape[1:])} {dst.dtype}")
    mapping = block_mapping.to(torch.int64)
    if stream is None:
        dst.index_copy_(0, mapping[:, 1].to(dst.device),
                        src.index_select(0, mapping[:, 0].to(src.device)).to(dst.device))
        return
    with torch.cuda.stream(stream):
        dst.index_copy_(0, mapping[:, 1].to(dst.device),
                        src.index_select(0, mapping[:, 0].to(src.device)).to(dst.device))


def store_to_host(src: torch.Tensor, host: torch.Tensor) -> None:
    """Write src [n] into host[:n] (a copy; the kernel stores with the SMs instead)."""
    host[:src.shape[0]].copy_(src)


def load_from_host(host: torch.Tensor, dst: torch.Tensor) -> None:
    """Write host [n] into dst[:n] (a copy; the kernel loads with the SMs instead)."""
    dst[:host.shape[0]].copy_(host)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row of x [num_tokens, hidden] with weight [hidden] (one dtype).

    The operations of the model's RMSNorm: h in float32, `h * rsqrt(mean(h^2) + eps)`
    rounded to the dtype, then multiplied by `weight` (rounded). With `residual`
    [num_tokens, hidden], h = x + residual (rounded to the dtype) is first written into
    `residual`, and (out, residual) is returned; otherwise out [num_tokens, hidden].
    """
    if residual is not None:
        residual.add_(x)  # [num_tokens, hidden]
        x = residual
    h = x.to(torch.float32)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)  # [num_tokens, hidden]
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * d] (gate | up) -> silu(gate) * up [num_tokens, d], in x's dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    """Rotate halves of query [num_tokens, num_heads, head_dim] and key [num_tokens,
    num_kv_heads, head_dim] in place (strided views are written through their strides).

    positions: [num_tokens] int64; cos_sin_cache: [max_position, head_dim], cos | sin.
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in float32, rounded once to the dtype.
    """
    half = query.shape[-1] // 2
    table = cos_sin_cache[positions].to(torch.float32)  # [num_tokens, head_dim]
    cos = table[:, None, :half]  # [num_tokens, 1, head_dim // 2]
    sin = table[:, None, half:]
    for x in (query, key):
        x32 = x.to(torch.float32)
        x1, x2 = x32[..., :half], x32[..., half:]
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


#: Rows per product of `invariant_linear`: every call multiplies blocks of exactly this many.
INVARIANT_ROWS = 16


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is the same bits whatever the rows.

    x: [num_tokens, in_features]; weight: [out_features, in_features]; bias or None.
    CPU matrix products change algorithm with the number of rows (float32 rows differ
    between 1 and 3 rows on x86), so the rows go through products of exactly
    INVARIANT_ROWS rows each, the last block padded with zeros. Returns
    [num_tokens, out_features] in x's dtype.
    """
    num_tokens, in_features = x.shape
    rows = INVARIANT_ROWS
    padded = x.new_zeros((-(-num_tokens // rows) * rows, in_features))
    padded[:num_tokens] = x
    out = [F.linear(padded[i:i + rows], weight, bias) for i in range(0, num_tokens, rows)]
    if not out:
        return x.new_empty((0, weight.shape[0]))
    return torch.cat(out)[:num_tokens]


def invariant_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, max_query_len: int, max_seq_len: int,
                        softmax_scale: float, out: torch.Tensor | None = None,
                        split_len: int = 512) -> torch.Tensor:
    """Causal paged attention whose every query row is the same bits whatever its batch,
    its chunk, and which keys were cached (the CPU path of the deterministic mode).

    Arguments as `paged_attention`. Keys are cut at fixed absolute positions into splits of
    `split_len`; each split is one fixed-shape product per block of INVARIANT_ROWS query
    tokens (keys past a row's position masked, the split padded with zeros), a softmax over
    exactly `split_len` scores, and the splits are merged in order. float32 throughout,
    cast to out's dtype once.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    rows = INVARIANT_ROWS
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_start, q_len = starts[r], starts[r + 1] - starts[r]
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"request {r}: q_len={q_len} exceeds seq_len={seq_len}")
        num_chunks = -(-q_len // rows)
        q = query.new_zeros((num_chunks * rows, num_heads, head_dim), dtype=torch.float32)
        q[:q_len] = query[q_start:q_start + q_len].float()
        # [chunks * kv_heads, rows * group, head_dim]: a chunk's queries of one kv head.
        q = q.view(num_chunks, rows, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q = q.reshape(num_chunks * num_kv_heads, rows * group, head_dim) * softmax_scale
        positions = seq_len - q_len + torch.arange(num_chunks * rows, device=query.device)
        q_pos = positions.view(num_chunks, 1, rows, 1).expand(
            num_chunks, num_kv_heads, rows, group).reshape(num_chunks * num_kv_heads, -1, 1)
        num_splits = -(-seq_len // split_len)
        k_all = torch.zeros((num_splits * split_len, num_kv_heads, head_dim),
                            dtype=torch.float32, device=query.device)
        v_all = torch.zeros_like(k_all)
        k_all[:seq_len] = _gather_kv(k_cache, block_tables[r], seq_len).float()
        v_all[:seq_len] = _gather_kv(v_cache, block_tables[r], seq_len).float()
        batch = num_chunks * num_kv_heads
        m_run = torch.full((batch, rows * group, 1), float("-inf"), device=query.device)
        total = torch.zeros_like(m_run)
        merged = torch.zeros_like(q)
        for split in range(num_splits):
            keys = slice(split * split_len, (split + 1) * split_len)
            k = k_all[keys].permute(1, 2, 0)  # [kv_heads, head_dim, split_len]
            v = v_all[keys].permute(1, 0, 2)  # [kv_heads, split_len, head_dim]
            k = k.unsqueeze(0).expand(num_chunks, -1, -1, -1).reshape(batch, head_dim, -1)
            v = v.unsqueeze(0).expand(num_chunks, -1, -1, -1).reshape(batch, -1, head_dim)
            key_pos = torch.arange(keys.start, keys.stop, device=query.device)
            visible = key_pos.view(1, 1, -1) <= q_pos  # [batch, rows * group, split_len]
            scores = torch.bmm(q, k).masked_fill(~visible, float("-inf"))
            m = scores.amax(-1, keepdim=True)
            seen = m > float("-inf")
            m_safe = torch.where(seen, m, torch.zeros_like(m))
            p = torch.exp(scores - m_safe)
            l_split = p.sum(-1, keepdim=True)
            part = torch.bmm(p, v) / torch.where(seen, l_split, torch.ones_like(l_split))
            lse = torch.where(seen, m_safe + torch.log(l_split), m)
            m_new = torch.maximum(m_run, lse)
            m_new_safe = torch.where(m_new > float("-inf"), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(m_run - m_new_safe)
            weight = torch.exp(lse - m_new_safe)
            merged = merged * alpha + part * weight
            total = total * alpha + weight
            m_run = m_new
        result = merged / torch.where(total > 0, total, torch.ones_like(total))
        result = result.view(num_chunks, num_kv_heads, rows, group, head_dim).permute(
            0, 2, 1, 3, 4).reshape(num_chunks * rows, num_heads, head_dim)
        out[q_start:q_start + q_len] = result[:q_len].to(out.dtype)
    return out


def word_checksum(rows: torch.Tensor) -> torch.Tensor:
    """Reference for kernels.word_checksum: per row of uint8 `[n, nbytes]`, the sum of its
    32-bit words (sign-extended), word i weighted 2i+1, modulo 2**64, as int64 `[n]`."""
    words = rows.contiguous().view(torch.int32).to(torch.int64)  # [n, nbytes / 4]
    weights = torch.arange(1, 2 * words.shape[1], 2, dtype=torch.int64, device=rows.device)
    return (words * weights).sum(dim=1)  # wraps modulo 2**64
