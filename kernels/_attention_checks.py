"""Argument checks of the paged_attention launcher.

`looks_valid` is one cheap expression over the common valid call; `check_args` runs the
detailed checks (each raising ValueError with advice) when it fails.
"""

from __future__ import annotations

import torch
from kvtier.kernels import _checks


def looks_valid(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
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


def check_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
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
