"""The paged KV cache tensor that kvtier owns, and the per-layer K / V views of it.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block `i` is the contiguous span `kv_cache[i]` (DESIGN decision 1). Attention and store
kernels see one layer through strided views `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout


def allocate_kv_cache(layout: KVLayout, num_blocks: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache of `num_blocks` blocks on `device`.

    Raises ValueError for a non-positive `num_blocks`; torch raises its own error if the
    device lacks the memory.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    return torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype,
                       device=torch.device(device))


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer: two views `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    assert kv_cache.dim() == 6 and kv_cache.shape[2] == 2, \
        f"expected [num_blocks, num_layers, 2, block_size, heads, dim], got {tuple(kv_cache.shape)}"
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def num_blocks_for_memory(layout: KVLayout, num_bytes: int) -> int:
    """How many whole blocks fit in `num_bytes`."""
    return num_bytes // layout.bytes_per_block
