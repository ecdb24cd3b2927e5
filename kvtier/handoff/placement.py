"""Where a decode instance puts the blocks a handoff brought: its GPU block pool.

Blocks go into the GPU pool as cached blocks, not into the host tier, because that is where
the request's prefix lookup looks first and where decoding reads them: a host-tier block
would need a restore (a slot, a copy, a wait) before the request's first step, and the host
tier may be off (a decode instance without one is common). A placed block is cached in the
pool exactly as one the engine computed (`TierManager.cache_full_blocks`, so it is also
written through to the host tier and spills like any other) and is held (one reference
taken for the handoff) so that no eviction reuses it before the request arrives; the
receiver gives that reference back once the request has taken its own, or after a timeout.
A released block stays cached and is evicted like any other.

Everything here runs on the thread that drives the manager (the engine thread).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.manager import TierManager
from kvtier.tiers.record import BlockMeta


class PoolPlacement:
    """Places handed-over blocks in `manager`'s GPU pool and holds them (engine thread)."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager

    def held(self, block_hashes: Sequence[BlockHash]
             ) -> tuple[list[bool], list[KVCacheBlock | None]]:
        """Per hash, whether this instance holds the block now (cached in the GPU pool or the
        host tier: it is not sent again), and per hash its GPU block (None elsewhere), each
        given one reference so that it stays until `release`."""
        pool, host = self.manager.pool, self.manager.tiers.caching_host
        blocks = [pool.get_cached_block(block_hash) for block_hash in block_hashes]
        held = [block is not None or (host is not None and host.contains(block_hash))
                for block, block_hash in zip(blocks, block_hashes)]
        self.manager.touch([block for block in blocks if block is not None])
        return held, blocks

    def place(self, metas: Sequence[BlockMeta],
              payloads: torch.Tensor) -> list[KVCacheBlock | None]:
        """Cache the validated blocks `metas` (bytes: uint8 rows of `payloads`, on any
        device) in the GPU
        pool, each held once for the caller; a block already cached is held as it is. When
        the pool has too few free blocks, the last ones are left out (None: the request
        computes them). Returns per block its held GPU block or None."""
        pool = self.manager.pool
        placed = [pool.get_cached_block(meta.block_hash) for meta in metas]
        self.manager.touch([block for block in placed if block is not None])
        todo = [i for i, block in enumerate(placed) if block is None]
        fresh = None
        while todo:
            fresh = self.manager.allocate(len(todo))
            if fresh is not None:
                break
            todo = todo[:len(todo) // 2]  # the head of what is missing, if the tail won't fit
        if todo and fresh is not None:
            cache = self.manager.kv_cache
            rows = cache.view(-1).view(torch.uint8).view(cache.shape[0], -1)
            ids = torch.tensor([b.block_id for b in fresh], dtype=torch.int64)
            # [len(todo), bytes_per_block] into the blocks' contiguous spans
            picked = payloads[torch.tensor(todo, dtype=torch.int64, device=payloads.device)]
            rows[ids.to(cache.device)] = picked.to(cache.device)
            self.manager.cache_full_blocks(fresh, [metas[i] for i in todo])
            for i, block in zip(todo, fresh):
                placed[i] = block
        return placed

    def claimed(self, blocks: Sequence[KVCacheBlock]) -> bool:
        """Whether the request arrived: someone besides the handoff holds the last of
        `blocks` (the held blocks the request can take, in prompt order; a request takes
        its whole prefix at once, and only one with this whole prefix shares its last
        block). With no such block there is nothing to wait for: True."""
        return not blocks or blocks[-1].ref_cnt > 1

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Give back the handoff's reference on each block (they stay cached)."""
        self.manager.free(blocks)
