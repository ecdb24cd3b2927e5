"""EngineConfig: the knobs of one engine instance (blocks, budgets, tiers, hashing).

Sizes are given the way people think about them (GiB for memory, tokens for budgets) and
checked once here, so the scheduler and the tier manager can trust them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvtier.engine import paths
from kvtier.engine.attention import ATTN_BACKENDS as _BACKENDS

from kvtier.hashing import HASH_ALGORITHMS
from kvtier.remote_config import RemoteConfig

ATTN_BACKENDS = ("auto", *_BACKENDS)

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine schedules and where it keeps KV blocks.

    block_size: tokens per KV block.
    gpu_blocks: exact number of GPU (device) blocks; None sizes the pool from
        `gpu_memory_fraction` of the device memory that is free after loading the model.
    max_num_seqs: cap on requests running in one step.
    max_num_batched_tokens: token budget of one step (prefill chunks plus decodes).
    host_cache / host_cache_gb: the pinned host tier and its size in GiB.
    disk_cache / disk_cache_dir / disk_cache_gb: the LMDB tier, its directory (None: the
        user cache directory) and its budget in GiB.
    hash_algorithm: "xxh3_128" or "sha256" (block hashes; part of every cache key).
    attn_backend: "auto", "torch", "triton" or "flash".
    seed: default seed for sampling (per-request seeds override it); None: nondeterministic.
    cuda_graphs: replay recorded CUDA graphs for pure-decode steps (used only on CUDA with
        the triton attention backend; ignored elsewhere).
    remote_cache: the shared remote tier below the disk: a Redis / Redis Cluster URL
        (`redis://`, `rediss://`, `redis+cluster://`) or a `RemoteConfig`; None: off.

    Raises ValueError naming the field and the accepted range when a value is out of range.
    """

    block_size: int = 16
    gpu_blocks: int | None = None
    gpu_memory_fraction: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    host_cache: bool = True
    host_cache_gb: float = 1.0
    disk_cache: bool = True
    disk_cache_dir: str | Path | None = None
    disk_cache_gb: float = 10.0
    hash_algorithm: str = "xxh3_128"
    attn_backend: str = "auto"
    seed: int | None = 0
    cuda_graphs: bool = True
    remote_cache: str | RemoteConfig | None = None

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        if self.gpu_blocks is not None:
            _check_positive_int("gpu_blocks", self.gpu_blocks)
        _check_fraction("gpu_memory_fraction", self.gpu_memory_fraction)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.host_cache:
            _check_positive_size("host_cache_gb", self.host_cache_gb)
        if self.disk_cache:
            _check_positive_size("disk_cache_gb", self.disk_cache_gb)
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS}, "
                             f"got {self.hash_algorithm!r}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, "
                             f"got {self.attn_backend!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.remote_cache is not None and not isinstance(self.remote_cache, RemoteConfig):
            RemoteConfig(self.remote_cache)  # type: ignore[arg-type]  # checks the URL
        if self.cuda_graphs is not True and self.cuda_graphs is not False:
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")

    @property
    def host_cache_bytes(self) -> int:
        """Size of the host tier in bytes (0 when it is off)."""
        return int(self.host_cache_gb * GIB) if self.host_cache else 0

    @property
    def remote_config(self) -> RemoteConfig | None:
        """The remote tier's config (defaults around a bare URL), None when it is off."""
        if self.remote_cache is None or isinstance(self.remote_cache, RemoteConfig):
            return self.remote_cache
        return RemoteConfig(self.remote_cache)

    @property
    def disk_cache_bytes(self) -> int:
        """Budget of the disk tier in bytes (0 when it is off)."""
        return int(self.disk_cache_gb * GIB) if self.disk_cache else 0


def default_disk_cache_dir() -> Path:
    """`<user cache dir>/kv`: the disk tier's directory when none is given (not created)."""
    return paths.cache_dir(create=False) / "kv"


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def _check_positive_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(float(value)) or float(value) <= 0.0:
        raise ValueError(f"{name} must be a positive number of GiB, got {value!r} "
                         "(turn the tier off instead of giving it no room)")
