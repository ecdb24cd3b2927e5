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

import array
import hashlib
import sys
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

from kvtier.layout import KVLayout

BlockHash = NewType("BlockHash", bytes)

HASH_ALGORITHMS = ("xxh3_128", "sha256")
DEFAULT_HASH_ALGORITHM = "xxh3_128"

_MAX_TOKEN_ID = 2**32 - 1
# The array typecode of a 4-byte unsigned int ("I" on every platform torch supports).
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"


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
    """Token ids -> little-endian uint32 bytes (4 bytes per token).

    Raises ValueError for ids outside [0, 2**32), non-integer ids, or a non-flat array.
    """
    if isinstance(token_ids, np.ndarray):
        return _encode_array(token_ids)
    try:
        # array('I') converts a list of Python ints in C, several times faster than numpy,
        # and rejects negative, too large and non-integer values itself.
        encoded = array.array(_UINT32_CODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if _BIG_ENDIAN:
        encoded.byteswap()
    return encoded.tobytes()


def _encode_array(token_ids: np.ndarray) -> bytes:
    if token_ids.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {token_ids.shape}")
    if token_ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() > _MAX_TOKEN_ID):
        raise ValueError("token ids must lie in [0, 2**32); got "
                         f"min={int(token_ids.min())} max={int(token_ids.max())}")
    return token_ids.astype("<u4", copy=False).tobytes()


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _chain(parent: BlockHash, data: bytes, block_size: int, digest, extra_keys: bytes,
           out: list[BlockHash]) -> BlockHash:
    """Hash every full block of encoded `data` into `out`; return the last hash (or parent).

    The hot loop of all hashing: one slice and one digest call per block. Slicing the bytes
    object (a 64-byte copy) is faster here than slicing a memoryview, whose concatenation
    goes through the slow buffer-protocol path.
    """
    step = block_size * 4
    end = len(data) - len(data) % step
    append = out.append
    if extra_keys:
        for start in range(0, end, step):
            parent = digest(b"".join((parent, data[start:start + step], extra_keys)))
            append(parent)
    else:
        for start in range(0, end, step):
            parent = digest(parent + data[start:start + step])
            append(parent)
    return parent


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
    """Hashes of every full block of `token_ids` (block_size tokens each), chained from `parent`.

    A trailing partial block is not hashed. `extra_keys` (e.g. a LoRA or multimodal id) go
    into every block's hash. Raises ValueError for a non-positive block size, an unknown
    algorithm or token ids outside [0, 2**32).
    """
    _check_block_size(block_size)
    digest = _digest_fn(algorithm)
    hashes: list[BlockHash] = []
    _chain(parent, encode_token_ids(token_ids), block_size, digest, extra_keys, hashes)
    return hashes


class BlockHasher:
    """Incremental hashing of one growing sequence.

    `extend(new_token_ids)` returns only the hashes of the blocks that just became full;
    `block_hashes` holds them all. Keeps the encoded tokens of the partial tail block only,
    so each token is converted and validated once, when it arrives.
    """

    __slots__ = ("namespace", "block_size", "algorithm", "extra_keys", "block_hashes",
                 "_digest", "_tail")

    def __init__(self, namespace: BlockHash, block_size: int,
                 algorithm: str = DEFAULT_HASH_ALGORITHM, extra_keys: bytes = b"") -> None:
        _check_block_size(block_size)
        self._digest = _digest_fn(algorithm)
        self.namespace = namespace
        self.block_size = block_size
        self.algorithm = algorithm
        self.extra_keys = extra_keys
        self.block_hashes: list[BlockHash] = []
        self._tail = b""  # encoded tokens of the partial block, < block_size * 4 bytes

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size + len(self._tail) // 4

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> list[BlockHash]:
        """Append tokens; return the hashes of blocks completed by them (maybe none).

        Raises ValueError, appending nothing, for token ids outside [0, 2**32).
        """
        data = self._tail + encode_token_ids(token_ids)
        step = self.block_size * 4
        if len(data) < step:
            self._tail = data
            return []
        parent = self.block_hashes[-1] if self.block_hashes else self.namespace
        new: list[BlockHash] = []
        _chain(parent, data, self.block_size, self._digest, self.extra_keys, new)
        self._tail = data[len(new) * step:]
        self.block_hashes.extend(new)
        return new
