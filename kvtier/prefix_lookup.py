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

from collections import Counter
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
    prefix (their location is None), only the last held block does.

    Each step runs over the whole prefix at once (a lookup of a long prompt's hundreds of
    blocks runs on the engine thread, and a waiting request is looked up at every step)."""
    pool, host, counters = tiers.pool, tiers.caching_host, tiers.counters
    gpu_run = pool.lookup_prefix(block_hashes)  # the common case; counts pool stats
    counters[Tier.GPU].hits += len(gpu_run)
    rest = block_hashes[len(gpu_run):]
    gpu_blocks: list[KVCacheBlock | None] = [pool.get_cached_block(h) for h in rest]
    on_host = host.contains if host is not None else (lambda _: False)
    locations: list[Tier | None] = [
        Tier.GPU if block is not None else Tier.HOST if on_host(block_hash) else None
        for block, block_hash in zip(gpu_blocks, rest)]
    first_slow = next((i for i, tier in enumerate(locations) if tier is None), len(rest))
    slow = first_slow < len(rest) and (read_slow is None
                                       or read_slow(len(gpu_run) + first_slow))
    if slow:  # each lower tier asked once, for the blocks no faster tier holds
        missing = [i for i in range(first_slow, len(rest)) if locations[i] is None]
        for lower in tiers.lower:
            if not missing:
                break
            held = lower.contains([rest[i] for i in missing])
            for i, hit in zip(missing, held):
                if hit:
                    locations[i] = lower.kind
            missing = [i for i in missing if locations[i] is None]
    # Counted up to the end of the prefix: the first block no tier holds, without gaps.
    end = len(rest) if gaps else next(
        (i + 1 for i in range(first_slow, len(rest)) if locations[i] is None), len(rest))
    order = tiers.lookup_order()
    miss_order = order if slow else order[:len(order) - len(tiers.lower)]
    for tier, num in Counter(locations[:end]).items():
        count_lookup(counters, miss_order if tier is None else order, tier, num)
    locations, gpu_blocks = locations[:end], gpu_blocks[:end]
    while locations and locations[-1] is None:  # a prefix ends at a held block
        locations.pop()
        gpu_blocks.pop()
    return PrefixHit([Tier.GPU] * len(gpu_run) + locations, [*gpu_run, *gpu_blocks])
