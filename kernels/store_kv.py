"""store_kv (reshape-and-cache): write the K/V of new tokens into the paged cache.

One program per (token, group of kv heads): it reads the token's slot, skips it when the
slot is -1, and copies `[heads, head_dim]` of K and of V into
`cache[slot // block_size, slot % block_size]`. The caches are per-layer strided views of
the cross-layer cache, so every address goes through strides; only `head_dim` must be
contiguous (the rows are then loaded and stored as wide vectors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Elements of one program's K (and of its V) tile; beyond this the heads are split over
#: more programs so each stays a few KiB.
_MAX_TILE = 2048


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_t, stride_kc_h,
    stride_vc_b, stride_vc_t, stride_vc_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_TILE: tl.constexpr,
    DIM_TILE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot >= 0:
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.program_id(1) * HEAD_TILE + tl.arange(0, HEAD_TILE)[:, None]
        dims = tl.arange(0, DIM_TILE)[None, :]
        mask = (heads < num_kv_heads) & (dims < HEAD_DIM)  # [HEAD_TILE, DIM_TILE]
        token64 = token.to(tl.int64)
        k = tl.load(key_ptr + token64 * stride_key_t + heads * stride_key_h + dims, mask=mask)
        v = tl.load(value_ptr + token64 * stride_value_t + heads * stride_value_h + dims,
                    mask=mask)
        k_dst = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_t
        v_dst = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_t
        tl.store(k_dst + heads * stride_kc_h + dims, k, mask=mask)
        tl.store(v_dst + heads * stride_vc_h + dims, v, mask=mask)


def _looks_valid(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """One cheap pass over what `_check_args` verifies (this runs per layer per step)."""
    device, dtype = key.device, key.dtype
    return (key.dim() == 3 and value.shape == key.shape and k_cache.dim() == 4
            and v_cache.shape == k_cache.shape and k_cache.shape[2:] == key.shape[1:]
            and slot_mapping.shape == key.shape[:1] and dtype in _checks.FLOAT_DTYPES
            and value.dtype == dtype and k_cache.dtype == dtype and v_cache.dtype == dtype
            and slot_mapping.dtype == torch.int64 and device.type == "cuda"
            and value.device == device and k_cache.device == device
            and v_cache.device == device and slot_mapping.device == device
            and key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
            and v_cache.stride(3) == 1)


def _check_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    _checks.check_shape("key", key, (None, None, None), "[num_tokens, num_kv_heads, head_dim]")
    num_tokens, num_kv_heads, head_dim = key.shape
    meaning = f"[num_blocks, block_size, num_kv_heads={num_kv_heads}, head_dim={head_dim}]"
    _checks.check_shape("value", value, tuple(key.shape), f"like key {tuple(key.shape)}")
    _checks.check_shape("k_cache", k_cache, (None, None, num_kv_heads, head_dim), meaning)
    _checks.check_shape("v_cache", v_cache, tuple(k_cache.shape), meaning)
    _checks.check_shape("slot_mapping", slot_mapping, (num_tokens,), f"[num_tokens={num_tokens}]")
    _checks.check_dtype("k_cache", k_cache, _checks.FLOAT_DTYPES)
    _checks.check_same_dtype("k_cache", k_cache, key=key, value=value, v_cache=v_cache)
    _checks.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    _checks.check_kernel_device("key", key)
    _checks.check_same_device("key", key, value=value, k_cache=k_cache, v_cache=v_cache,
                              slot_mapping=slot_mapping)
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache),
                         ("v_cache", v_cache)):
        _checks.check_inner_contiguous(name, tensor)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V of `num_tokens` new tokens into the paged cache of one layer.

    key, value: [num_tokens, num_kv_heads, head_dim], the cache dtype
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (strided views of the
        cross-layer cache; `head_dim` must have stride 1)
    slot_mapping: [num_tokens] int64 on the same device, `block_id * block_size + offset`;
        -1 skips the token. Slots are not range-checked (that would need a device sync).

    Runs asynchronously on the current stream. Raises ValueError on a wrong device, dtype,
    shape or stride.
    """
    if not _looks_valid(key, value, k_cache, v_cache, slot_mapping):
        _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    dim_tile = triton.next_power_of_2(head_dim)
    head_tile = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // dim_tile))
    grid = (num_tokens, triton.cdiv(num_kv_heads, head_tile))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_TILE=head_tile, DIM_TILE=dim_tile,
        num_warps=4,
    )
