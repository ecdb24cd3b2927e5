"""The byte layout of one KV block, shared by every tier.

A block covers all layers, K and V, of `block_size` consecutive tokens, stored as one
contiguous span shaped `[num_layers, 2, block_size, num_kv_heads, head_dim]`. The GPU cache
is `[num_blocks, *block_shape]`, so block `i` is the span `cache[i]` and every hop between
tiers moves whole spans.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

#: Bump when the meaning of the block bytes changes; it is part of every fingerprint, so old
#: cached blocks become misses instead of being served with a new interpretation.
LAYOUT_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`; raises ValueError for dtypes kvtier does not store."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported for the KV cache; use one of {list(_DTYPES)}")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` / `"bf16"` / `torch.bfloat16` -> `torch.bfloat16`; ValueError otherwise."""
    if isinstance(name, torch.dtype):
        dtype_name(name)
        return name
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
               "float": "float32"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {list(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and dtype of one model's KV blocks.

    Raises ValueError naming the field when a size is not a positive integer or the dtype is
    not float32 / float16 / bfloat16.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{field} must be a positive integer, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """`(num_layers, 2, block_size, num_kv_heads, head_dim)`: one block, K at 0, V at 1."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def elements_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.elements_per_block * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def describe(self) -> str:
        """A canonical, human-readable string; the fingerprint is its digest."""
        return (f"kvtier-layout-v{LAYOUT_VERSION}:layers={self.num_layers}:"
                f"kv_heads={self.num_kv_heads}:head_dim={self.head_dim}:"
                f"block_size={self.block_size}:dtype={dtype_name(self.dtype)}")

    def fingerprint(self) -> bytes:
        """16 bytes that are equal exactly when two layouts store blocks the same way.

        Stable across processes and machines (a digest of `describe()`, not Python's hash).
        Computed once per layout: every record written carries it.
        """
        return _fingerprint(self)


@functools.lru_cache(maxsize=64)
def _fingerprint(layout: KVLayout) -> bytes:
    return hashlib.sha256(layout.describe().encode()).digest()[:16]
