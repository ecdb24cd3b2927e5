"""The paged KV cache tensor that kvtier owns, and the per-layer K / V views of it.

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block `i` is the contiguous span `kv_cache[i]`, all layers, K and V: every hop between tiers
moves one span per block (one copy, one record), not a piece per layer. Attention and store
kernels see one layer through strided views `[num_blocks, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

from kvtier.layout import KVLayout
from kvtier.tiers.host import available_memory_bytes


def allocate_kv_cache(layout: KVLayout, num_blocks: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache of `num_blocks` blocks on `device`.

    Raises ValueError for a non-positive `num_blocks` or, on the CPU, a cache larger than
    the memory the kernel reports as available; OSError when the device cannot allocate it.
    Both name the size, so the caller can lower the block count at start-up.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
    device = torch.device(device)
    num_bytes = num_blocks * layout.bytes_per_block
    available = available_memory_bytes() if device.type == "cpu" else None
    if available is not None and num_bytes > available:
        raise ValueError(f"a KV cache of {num_blocks} blocks needs {num_bytes / 2**30:.2f} GiB "
                         f"but only {available / 2**30:.2f} GiB of memory are available; "
                         "lower the number of GPU blocks")
    try:
        return torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype,
                           device=device)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        raise OSError(f"could not allocate a KV cache of {num_blocks} blocks "
                      f"({num_bytes / 2**30:.2f} GiB) on {device}: {exc}; lower the number "
                      "of GPU blocks or the memory fraction") from exc


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer: two views `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    assert kv_cache.dim() == 6 and kv_cache.shape[2] == 2, \
        f"expected [num_blocks, num_layers, 2, block_size, heads, dim], got {tuple(kv_cache.shape)}"
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def num_blocks_for_memory(layout: KVLayout, num_bytes: int) -> int:
    """How many whole blocks fit in `num_bytes`."""
    return num_bytes // layout.bytes_per_block
