"""Finding a request's cached prefix across the tiers (`TierManager.lookup`).

Each block is looked for in the fastest tier first: the GPU pool, the host tier, then the
disk tier (one read transaction for all the blocks still unknown) and the remote tier (one
pipelined round trip for the blocks no local tier holds). The prefix ends at the first
block that no tier holds, or, when the caller decides that reading it is not worth it, at
the first block that neither the GPU nor the host tier holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.block_pool import BlockPool
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.loads import PrefixHit
from kvtier.stats import Tier, TierCounters, count_lookup
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier

if TYPE_CHECKING:
    from kvtier.tiers.remote import RemoteTier


def find_prefix(block_hashes: Sequence[BlockHash], pool: BlockPool, host: HostTier | None,
                disk: DiskTier | None, remote: RemoteTier | None,
                counters: dict[Tier, TierCounters], search_order: list[Tier],
                read_slow: Callable[[int], bool] | None = None) -> PrefixHit:
    """The longest prefix of `block_hashes` held by some tier (`host` None: no host tier
    caches blocks), each block from the fastest tier holding it; counts each looked-up
    block in `counters`, along `search_order`. `read_slow(i)`, asked once at the first block
    `i` that neither the GPU nor the host holds, says whether to ask the disk and remote
    tiers at all."""
    gpu_run = pool.lookup_prefix(block_hashes)  # the common case; counts pool stats
    locations = [Tier.GPU] * len(gpu_run)
    gpu_blocks: list[KVCacheBlock | None] = list(gpu_run)
    counters[Tier.GPU].hits += len(gpu_run)
    fast_order = [t for t in search_order if t in (Tier.GPU, Tier.HOST)]
    on_disk: list[bool] = []
    on_remote: list[bool] | None = None
    slow: bool | None = None  # whether the disk and remote tiers are asked
    for i in range(len(gpu_run), len(block_hashes)):
        block = pool.get_cached_block(block_hashes[i])
        tier = Tier.GPU if block is not None else None
        if tier is None and host is not None and host.contains(block_hashes[i]):
            tier = Tier.HOST
        if tier is None and slow is None:
            slow = read_slow is None or read_slow(i)
        if tier is None and not slow:
            count_lookup(counters, fast_order, None)
            break
        if tier is None and disk is not None:
            if not on_disk:  # one read transaction for all the rest
                on_disk = [False] * i + disk.contains(list(block_hashes[i:]))
            tier = Tier.DISK if on_disk[i] else None
        if tier is None and remote is not None:
            if on_remote is None:
                on_remote = _remote_hits(block_hashes, i, pool, host, on_disk, remote)
            tier = Tier.REMOTE if on_remote[i] else None
        count_lookup(counters, search_order, tier)
        if tier is None:
            break
        locations.append(tier)
        gpu_blocks.append(block)
    return PrefixHit(locations, gpu_blocks)


def _remote_hits(block_hashes: Sequence[BlockHash], start: int, pool: BlockPool,
                 host: HostTier | None, on_disk: list[bool], remote: RemoteTier) -> list[bool]:
    """Per hash, whether the remote tier holds it, asked (one pipelined round trip) only for
    the hashes from `start` on that no local tier holds."""
    missing = [i for i in range(start, len(block_hashes))
               if pool.get_cached_block(block_hashes[i]) is None
               and not (host is not None and host.contains(block_hashes[i]))
               and not (on_disk and on_disk[i])]
    found = remote.contains([block_hashes[i] for i in missing])
    on_remote = [False] * len(block_hashes)
    for i, hit in zip(missing, found):
        on_remote[i] = hit
    return on_remote
