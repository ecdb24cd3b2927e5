"""kvtier: KV-cache offload and tiered storage for LLM inference.

A block's bytes live on the GPU (`BlockPool`), in a pinned host slab and in an LMDB disk
tier; block hashes chain their parents so equal hashes mean equal prefixes.
"""

from kvtier.block_pool import BlockPool, EvictionEvent, PoolStats
from kvtier.free_queue import BlockId, KVCacheBlock
from kvtier.hashing import (
    DEFAULT_HASH_ALGORITHM,
    HASH_ALGORITHMS,
    BlockHash,
    BlockHasher,
    hash_block,
    hash_blocks,
    namespace_hash,
)
from kvtier.layout import KVLayout

__version__ = "0.1.0"

__all__ = [
    "BlockHash", "BlockHasher", "BlockId", "BlockPool", "DEFAULT_HASH_ALGORITHM",
    "EvictionEvent", "HASH_ALGORITHMS", "KVCacheBlock", "KVLayout", "PoolStats",
    "hash_block", "hash_blocks", "namespace_hash", "__version__",
]

# The tiers and the tier manager (GPU pool -> pinned host slab -> LMDB disk).
from kvtier.config import TierConfig
from kvtier.manager import LoadId, PrefixHit, TierManager
from kvtier.stats import Direction, ManagerStats, Tier, TierStats, TransferStats
from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy
from kvtier.tiers.host import HostTier, SlotId
from kvtier.transfer import IOJob, JobId, SwapJob, TransferEngine

__all__ += [
    "Direction", "EvictionPolicy", "HostTier", "IOJob", "JobId", "LRUPolicy", "LoadId",
    "ManagerStats", "PrefixHit", "SlotId", "SwapJob", "Tier", "TierConfig", "TierManager",
    "TierStats", "TransferEngine", "TransferStats",
]
