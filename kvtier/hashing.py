"""Chained block hashes: equal hashes mean equal prefixes.

    h_{-1} = namespace_hash(model_id, layout, algorithm, cache_salt)
    h_i    = H(h_{i-1} || token ids of block i || extra keys)

Only full blocks are hashed. Keys persist on disk and are shared between processes, so they
never depend on Python's `hash()` or PYTHONHASHSEED: token ids are encoded as little-endian
uint32 and hashed with xxh3_128 (default, 16 bytes) or sha256 (32 bytes). xxh3 collisions can
be crafted by someone who controls prompts; where tenants do not trust each other use sha256
and a per-tenant `cache_salt`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

from kvtier.layout import KVLayout

BlockHash = NewType("BlockHash", bytes)

HASH_ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT_HASH_ALGORITHM = "xxh3_128"

_MAX_TOKEN_ID = 2**32 - 1


def _digest_fn(algorithm: str):
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {HASH_ALGORITHMS}")


def hash_size(algorithm: str) -> int:
    """Bytes in one BlockHash for `algorithm` (16 for xxh3_128, 32 for sha256)."""
    _digest_fn(algorithm)
    return 16 if algorithm == "xxh3_128" else 32


def encode_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids -> little-endian uint32 bytes. Raises ValueError for ids outside [0, 2**32)."""
    array = np.asarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must lie in [0, 2**32); got "
                         f"min={int(array.min())} max={int(array.max())}")
    return array.astype("<u4").tobytes()


def namespace_hash(model_id: str, layout: KVLayout, algorithm: str = DEFAULT_HASH_ALGORITHM,
                   cache_salt: str | None = None) -> BlockHash:
    """The parent of block 0: a digest of the model identity, layout, algorithm and salt.

    Different models, layouts, algorithms or salts give different namespaces, hence disjoint
    block hashes. Raises ValueError for an empty model id or an unknown algorithm.
    """
    if not model_id:
        raise ValueError("model_id must be a non-empty string naming the model")
    digest = _digest_fn(algorithm)
    salt = "" if cache_salt is None else cache_salt
    text = f"kvtier-namespace\x00{model_id}\x00{layout.describe()}\x00{algorithm}\x00{salt}"
    return BlockHash(digest(text.encode()))


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"",
               algorithm: str = DEFAULT_HASH_ALGORITHM) -> BlockHash:
    """Hash of one full block given its parent's hash (or the namespace hash for block 0)."""
    return BlockHash(_digest_fn(algorithm)(parent + encode_token_ids(token_ids) + extra_keys))


def hash_blocks(parent: BlockHash, token_ids: Sequence[int] | np.ndarray, block_size: int,
                algorithm: str = DEFAULT_HASH_ALGORITHM,
                extra_keys: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `parent`.

    A trailing partial block is not hashed. `extra_keys` (e.g. a LoRA or multimodal id) go
    into every block's hash.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    digest = _digest_fn(algorithm)
    data = encode_token_ids(token_ids)
    step = block_size * 4
    num_full = len(data) // step
    hashes: list[BlockHash] = []
    view = memoryview(data)
    for i in range(num_full):
        parent = digest(b"".join((parent, view[i * step:(i + 1) * step], extra_keys)))
        hashes.append(parent)
    return hashes


class BlockHasher:
    """Incremental hashing of one growing sequence.

    `extend(new_token_ids)` returns only the hashes of the blocks that just became full;
    `block_hashes` holds them all. Keeps the tokens of the partial tail block only.
    """

    __slots__ = ("namespace", "block_size", "algorithm", "extra_keys", "block_hashes", "_tail")

    def __init__(self, namespace: BlockHash, block_size: int,
                 algorithm: str = DEFAULT_HASH_ALGORITHM, extra_keys: bytes = b"") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        _digest_fn(algorithm)
        self.namespace = namespace
        self.block_size = block_size
        self.algorithm = algorithm
        self.extra_keys = extra_keys
        self.block_hashes: list[BlockHash] = []
        self._tail: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size + len(self._tail)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens; return the hashes of blocks completed by them (maybe none)."""
        self._tail.extend(int(t) for t in token_ids)
        num_full = len(self._tail) // self.block_size
        if num_full == 0:
            return []
        full = self._tail[: num_full * self.block_size]
        self._tail = self._tail[num_full * self.block_size:]
        parent = self.block_hashes[-1] if self.block_hashes else self.namespace
        new = hash_blocks(parent, full, self.block_size, self.algorithm, self.extra_keys)
        self.block_hashes.extend(new)
        return new
