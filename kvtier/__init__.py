"""kvtier: KV-cache offload and tiered storage for LLM inference.

A block's bytes live on the GPU (`BlockPool`), in a pinned host slab and in an LMDB disk
tier; block hashes chain their parents so equal hashes mean equal prefixes.

Everything a user imports lives under this one name: the tiering library here, the
embedded engine as `kvtier.engine`, the Triton kernels as `kvtier.kernels` and the command
as `kvtier.cli`. In the repository those three folders sit beside this one; an install
(editable or not, or `tools/bare_checkout.py` where pip cannot install) maps them into this
package, so every file has exactly one module name. The names below are imported on first
use, so `import kvtier` (and `kvtier --version`) does not import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # a bare checkout mapped by tools/bare_checkout.py
    __version__ = "0.0.0+source"

#: Public name -> module that defines it.
_EXPORTS = {
    "BlockPool": "kvtier.block_pool", "EvictionEvent": "kvtier.block_pool",
    "PoolStats": "kvtier.block_pool",
    "BlockId": "kvtier.free_queue", "KVCacheBlock": "kvtier.free_queue",
    "DEFAULT_HASH_ALGORITHM": "kvtier.hashing", "HASH_ALGORITHMS": "kvtier.hashing",
    "BlockHash": "kvtier.hashing", "BlockHasher": "kvtier.hashing",
    "hash_block": "kvtier.hashing", "hash_blocks": "kvtier.hashing",
    "namespace_hash": "kvtier.hashing",
    "KVLayout": "kvtier.layout",
    "TierConfig": "kvtier.config", "ConfigError": "kvtier.validation",
    "LoadId": "kvtier.manager", "PrefixHit": "kvtier.manager", "TierManager": "kvtier.manager",
    "Direction": "kvtier.stats", "ManagerStats": "kvtier.stats", "Tier": "kvtier.stats",
    "TierStats": "kvtier.stats", "TransferStats": "kvtier.stats",
    "EvictionPolicy": "kvtier.tiers.eviction", "LRUPolicy": "kvtier.tiers.eviction",
    "HostTier": "kvtier.tiers.host", "SlotId": "kvtier.tiers.host",
    "IOJob": "kvtier.transfer", "JobId": "kvtier.transfer", "SwapJob": "kvtier.transfer",
    "TransferEngine": "kvtier.transfer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
