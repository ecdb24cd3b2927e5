"""Fused elementwise pieces of a decoder layer: RMSNorm (+ residual add), SiLU-and-mul, rope.

Each replaces a handful of small torch kernels per layer with one launch and rounds exactly
where the torch code in `engine/models/llama.py` (and transformers) rounds:

- `rms_norm`: `h = x + residual` rounded to the dtype (written back into `residual`), then
  `h * rsqrt(mean(h^2) + eps)` in float32 rounded to the dtype, then `weight * that` rounded.
- `silu_and_mul`: `silu(gate)` in float32 rounded to the dtype, then `* up` rounded.
- `rotary_embedding_`: rotate halves in float32, rounded once (torch rounds after every op,
  so 16-bit results may differ from `apply_rope` by an ulp).

All three are capture-safe: no host syncs, and the only allocations are the outputs made by
the launchers. Rows are addressed through their strides, so views cut from a packed
projection output work as they are; only the last dimension must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvtier.kernels import _checks

#: Largest hidden size one rms_norm program holds in registers (a whole row per program).
_MAX_HIDDEN = 32768
#: Elements of `d` one silu_and_mul program handles.
_MAX_SILU_TILE = 1024
#: Elements of one rope tile (heads x half head_dim); more heads loop inside the program.
_MAX_ROPE_TILE = 2048


@triton.jit
def _round(x, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 `x` rounded to nearest-even in `dtype`.

    Triton's interpreter truncates float32 -> bfloat16 casts, so under it (SOFT_BF16) the
    rounding is done on the bits; compiled code keeps the native conversion (also
    round-to-nearest-even). NaN payloads are not preserved on the soft path.
    """
    if SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_residual, stride_out, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + cols
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        # torch adds 16-bit tensors in float32 and rounds the sum: same bits here.
        x = _round(x.to(tl.float32) + residual.to(tl.float32), dtype, SOFT_BF16)
        tl.store(residual_ptrs, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / hidden
    normed = _round(h * tl.math.rsqrt(mean_square + eps), dtype, SOFT_BF16)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = _round(weight.to(tl.float32) * normed.to(tl.float32), dtype, SOFT_BF16)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr,
                         SOFT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate_ptrs = x_ptr + row * stride_x + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask, other=0.0).to(tl.float32)
    # torch's silu formula, so float32 results differ only by the rounding of exp.
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype, SOFT_BF16)
    out = _round(silu.to(tl.float32) * up, dtype, SOFT_BF16)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def _rotate_heads(base_ptr, stride_head, num_heads, cos, sin, dims, dim_mask,
                  HALF: tl.constexpr, HEAD_TILE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Rotate halves of `num_heads` rows of one token in place, HEAD_TILE heads at a time."""
    for first in range(0, num_heads, HEAD_TILE):
        heads = first + tl.arange(0, HEAD_TILE)
        mask = (heads < num_heads)[:, None] & dim_mask[None, :]  # [HEAD_TILE, HALF_PAD]
        ptrs = base_ptr + heads[:, None] * stride_head + dims[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        tl.store(ptrs, _round(x1f * cos - x2f * sin, x1.dtype, SOFT_BF16), mask=mask)
        tl.store(ptrs + HALF, _round(x2f * cos + x1f * sin, x1.dtype, SOFT_BF16), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    query_ptr, key_ptr, positions_ptr, cos_sin_ptr,
    stride_query_t, stride_query_h, stride_key_t, stride_key_h, stride_cache,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, QUERY_TILE: tl.constexpr,
    KEY_TILE: tl.constexpr, SOFT_BF16: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)  # int64
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    table_row = cos_sin_ptr + position * stride_cache
    cos = tl.load(table_row + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table_row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(query_ptr + token * stride_query_t, stride_query_h, num_heads, cos, sin,
                  dims, dim_mask, HALF, QUERY_TILE, SOFT_BF16)
    _rotate_heads(key_ptr + token * stride_key_t, stride_key_h, num_kv_heads, cos, sin,
                  dims, dim_mask, HALF, KEY_TILE, SOFT_BF16)


def _on_kernel_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" or (tensor.device.type == "cpu"
                                            and _checks.interpreting())


def _check_rms_norm(x, weight, residual) -> None:
    _checks.check_shape("x", x, (None, None), "[num_tokens, hidden]")
    hidden = x.shape[1]
    _checks.check_shape("weight", weight, (hidden,), f"[hidden={hidden}]")
    _checks.check_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.check_same_dtype("x", x, weight=weight)
    _checks.check_kernel_device("x", x)
    _checks.check_same_device("x", x, weight=weight)
    _checks.check_inner_contiguous("x", x)
    _checks.check_inner_contiguous("weight", weight)
    if residual is not None:
        _checks.check_shape("residual", residual, tuple(x.shape), f"like x {tuple(x.shape)}")
        _checks.check_same_dtype("x", x, residual=residual)
        _checks.check_same_device("x", x, residual=residual)
        _checks.check_inner_contiguous("residual", residual)
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden={hidden} exceeds the {_MAX_HIDDEN} elements one rms_norm "
                         "program holds; use kernels.reference.rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row, optionally after adding a residual stream in place.

    x: [num_tokens, hidden] (rows may be strided, `hidden` contiguous); weight: [hidden];
    both one float dtype (float32, float16 or bfloat16). eps: added to the mean square.
    Without `residual`: returns out [num_tokens, hidden] = `weight * normed`, where
    `normed = (h * rsqrt(mean(h^2) + eps))` in float32 rounded to the dtype, h = x.
    With `residual` [num_tokens, hidden] (same dtype): h = x + residual rounded to the dtype
    is written into `residual`, and (out, residual) is returned.
    hidden may be at most 32768. Runs asynchronously on the current stream. Raises
    ValueError on a wrong device, dtype, shape or stride.
    """
    if not (x.dim() == 2 and weight.shape == x.shape[1:] and x.dtype in _checks.FLOAT_DTYPES
            and weight.dtype == x.dtype and _on_kernel_device(x) and weight.device == x.device
            and x.stride(1) == 1 and weight.stride(0) == 1 and x.shape[1] <= _MAX_HIDDEN
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device
                                      and residual.stride(1) == 1))):
        _check_rms_norm(x, weight, residual)
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens > 0 and hidden > 0:
        block = triton.next_power_of_2(hidden)
        # The residual pointer is unused (a dead constexpr branch) without a residual.
        _rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, out,
            x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, SOFT_BF16=_checks.interpreting(),
            num_warps=min(max(block // 512, 1), 16),
        )
    return out if residual is None else (out, residual)


def _check_silu_and_mul(x) -> None:
    _checks.check_shape("x", x, (None, None), "[num_tokens, 2 * d] (gate | up)")
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [num_tokens, 2 * d] (gate | up), got an odd last "
                         f"dimension {x.shape[1]}")
    _checks.check_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.check_kernel_device("x", x)
    _checks.check_inner_contiguous("x", x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation on the packed gate|up projection output.

    x: [num_tokens, 2 * d] float32, float16 or bfloat16 (rows may be strided, the last dim
    contiguous); gate = x[:, :d], up = x[:, d:]. Returns out [num_tokens, d] =
    silu(gate) * up, with silu computed in float32 and rounded to the dtype before the
    product (as torch's `F.silu(gate) * up`). Runs asynchronously on the current stream.
    Raises ValueError on a wrong device, dtype, shape or stride.
    """
    if not (x.dim() == 2 and x.shape[1] % 2 == 0 and x.dtype in _checks.FLOAT_DTYPES
            and _on_kernel_device(x) and x.stride(1) == 1):
        _check_silu_and_mul(x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens > 0 and d > 0:
        block = min(triton.next_power_of_2(d), _MAX_SILU_TILE)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=block, SOFT_BF16=_checks.interpreting(),
            num_warps=4)
    return out


def _check_rotary(query, key, positions, cos_sin_cache) -> None:
    _checks.check_shape("query", query, (None, None, None), "[num_tokens, num_heads, head_dim]")
    num_tokens, _, head_dim = query.shape
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim={head_dim} is odd; rotating halves needs an even head_dim")
    _checks.check_shape("key", key, (num_tokens, None, head_dim),
                        f"[num_tokens={num_tokens}, num_kv_heads, head_dim={head_dim}]")
    _checks.check_shape("positions", positions, (num_tokens,), f"[num_tokens={num_tokens}]")
    _checks.check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim),
                        f"[max_position, head_dim={head_dim}] (cos | sin)")
    _checks.check_dtype("query", query, _checks.FLOAT_DTYPES)
    _checks.check_same_dtype("query", query, key=key, cos_sin_cache=cos_sin_cache)
    _checks.check_dtype("positions", positions, (torch.int64,))
    _checks.check_kernel_device("query", query)
    _checks.check_same_device("query", query, key=key, positions=positions,
                              cos_sin_cache=cos_sin_cache)
    for name, tensor in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        _checks.check_inner_contiguous(name, tensor)


def rotary_embedding_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    """Rotary position embedding ("rotate halves", Llama style) applied in place to q and k.

    query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim];
    both may be strided views (e.g. slices of one packed qkv output); `head_dim` must be
    even and contiguous. positions: [num_tokens] int64, not range-checked (that would need
    a device sync). cos_sin_cache: [max_position, head_dim], cos in the first half of the
    last dim and sin in the second, in the dtype of query and key.
    With (x1, x2) the halves of a head: (x1 cos - x2 sin, x2 cos + x1 sin), computed in
    float32 and rounded once. Runs asynchronously on the current stream. Raises ValueError
    on a wrong device, dtype, shape or stride, or an odd head_dim.
    """
    if not (query.dim() == 3 and key.dim() == 3 and query.shape[2] % 2 == 0
            and key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2]
            and positions.shape == query.shape[:1] and cos_sin_cache.dim() == 2
            and cos_sin_cache.shape[1] == query.shape[2] and query.dtype in _checks.FLOAT_DTYPES
            and key.dtype == query.dtype and cos_sin_cache.dtype == query.dtype
            and positions.dtype == torch.int64 and _on_kernel_device(query)
            and key.device == query.device and positions.device == query.device
            and cos_sin_cache.device == query.device and query.stride(2) == 1
            and key.stride(2) == 1 and cos_sin_cache.stride(1) == 1):
        _check_rotary(query, key, positions, cos_sin_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0 or head_dim == 0:
        return
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    max_heads = max(1, _MAX_ROPE_TILE // half_pad)
    _rotary_embedding_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads,
        HALF=half, HALF_PAD=half_pad,
        QUERY_TILE=min(triton.next_power_of_2(max(num_heads, 1)), max_heads),
        KEY_TILE=min(triton.next_power_of_2(max(num_kv_heads, 1)), max_heads),
        SOFT_BF16=_checks.interpreting(),
        num_warps=4,
    )
