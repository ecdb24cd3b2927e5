"""Finding a request's cached prefix across the tiers (`TierManager.lookup`).

Each block is looked for in the fastest tier first: the GPU pool, the host tier, then each
tier below the host in turn, each asked once per lookup, in one batched call, for the blocks
from the first one no faster tier holds onwards (one read transaction on disk, one pipelined
round trip to a remote store). The prefix ends at the first block that no tier holds, or,
when the caller decides that reading it is not worth it, at the first block that neither
the GPU nor the host tier holds. Asked to (`gaps`), the lookup goes on past blocks no tier
holds, up to the last one some tier holds: their location is None, and the caller computes
them (a block's hash chains its whole prefix, so a hit behind a gap is still the block that
prefix would compute).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.loads import PrefixHit
from kvtier.stats import Tier, count_lookup
from kvtier.tier_stack import TierStack


def find_prefix(block_hashes: Sequence[BlockHash], tiers: TierStack,
                read_slow: Callable[[int], bool] | None = None,
                gaps: bool = False) -> PrefixHit:
    """The longest prefix of `block_hashes` held by some tier of `tiers`, each block from the
    fastest tier holding it; counts each looked-up block in `tiers.counters`. `read_slow(i)`,
    asked once at the first block `i` that neither the GPU nor the host holds, says whether
    to ask the tiers below the host at all. `gaps`: blocks no tier holds do not end the
    prefix (their location is None), only the last held block does."""
    pool, host, counters = tiers.pool, tiers.caching_host, tiers.counters
    gpu_run = pool.lookup_prefix(block_hashes)  # the common case; counts pool stats
    locations: list[Tier | None] = [Tier.GPU] * len(gpu_run)
    gpu_blocks: list[KVCacheBlock | None] = list(gpu_run)
    counters[Tier.GPU].hits += len(gpu_run)
    order = tiers.lookup_order()
    fast_order = order[:len(order) - len(tiers.lower)]
    # Per lower tier, once asked: per hash, whether it holds it (False where not asked).
    below: list[list[bool] | None] = [None] * len(tiers.lower)
    slow: bool | None = None  # whether the tiers below the host are asked
    for i in range(len(gpu_run), len(block_hashes)):
        block = pool.get_cached_block(block_hashes[i])
        tier = Tier.GPU if block is not None else None
        if tier is None and host is not None and host.contains(block_hashes[i]):
            tier = Tier.HOST
        if tier is None and slow is None:
            slow = read_slow is None or read_slow(i)
        if tier is None and not slow:
            count_lookup(counters, fast_order, None)
            if gaps:
                locations.append(None)
                gpu_blocks.append(None)
                continue
            break
        if tier is None:
            for k, lower in enumerate(tiers.lower):
                if below[k] is None:
                    below[k] = _ask(lower.contains, block_hashes, i, tiers, below[:k])
                if below[k][i]:
                    tier = lower.kind
                    break
        count_lookup(counters, order, tier)
        if tier is None and not gaps:
            break
        locations.append(tier)
        gpu_blocks.append(block)
    while locations and locations[-1] is None:  # a prefix ends at a held block
        locations.pop()
        gpu_blocks.pop()
    return PrefixHit(locations, gpu_blocks)


def _ask(contains: Callable[[list[BlockHash]], list[bool]], block_hashes: Sequence[BlockHash],
         start: int, tiers: TierStack, faster: list[list[bool] | None]) -> list[bool]:
    """Per hash, whether a lower tier holds it (its `contains`, one batched call), asked
    only for the hashes from `start` on that no faster tier holds (`faster`: the answers of
    the lower tiers above it)."""
    host = tiers.caching_host
    missing = [i for i in range(start, len(block_hashes))
               if tiers.pool.get_cached_block(block_hashes[i]) is None
               and not (host is not None and host.contains(block_hashes[i]))
               and not any(found is not None and found[i] for found in faster)]
    held = [False] * len(block_hashes)
    for i, hit in zip(missing, contains([block_hashes[i] for i in missing])):
        held[i] = hit
    return held
