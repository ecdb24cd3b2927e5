"""Write-throughs waiting for a host slot, in the order they get one.

A block comes with a load rank: None when a later restore is expected to compute it (the
head of a prefix), else how dear it is to compute, higher first. The engine ranks a block by
its index in its prompt: a restore's load front reads from the prompt's end backward, so a
stored tail serves from the end, and the tokens there attend to the longest context. When
blocks come faster than the disk takes them, the disk then holds the deepest part of each
long prefix, the part a restore loads, instead of the part just past the expected meeting
point, which comes first (docs/ARCHITECTURE.md, "Placement").

Ranked blocks come first, the higher rank first, then the unranked ones, the oldest first;
ties go to the oldest. Pop and push cost O(log n); an entry removed from the middle (the GPU
reused its block) leaves its place in the heap behind, dropped when popped or when such
leftovers outnumber the entries.
"""

from __future__ import annotations

import heapq
import itertools

from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.tiers.record import BlockMeta

#: One write-through: the GPU block, its meta, and its load rank (None: a restore is expected
#: to compute the block).
Store = tuple[KVCacheBlock, BlockMeta, int | None]


def order_key(load_rank: int | None) -> int:
    """Sort key of a load rank: ranked blocks before unranked ones, the higher rank first."""
    return 1 if load_rank is None else -load_rank


class DeferredStores:
    """Write-throughs that found no host slot, by block hash, popped in placement order (see
    the module docstring). A hash is held once."""

    def __init__(self) -> None:
        # block hash -> (the store, the order it was first deferred in)
        self._stores: dict[BlockHash, tuple[Store, int]] = {}
        self._heap: list[tuple[int, int, BlockHash]] = []  # (order key, order, hash)
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._stores)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._stores

    def push(self, store: Store, order: int | None = None) -> None:
        """Defer `store`; `order` puts back one `pop` returned in the place it had."""
        block_hash = store[1].block_hash
        assert block_hash not in self._stores, "a block is deferred once"
        order = next(self._order) if order is None else order
        self._stores[block_hash] = (store, order)
        heapq.heappush(self._heap, (order_key(store[2]), order, block_hash))

    def pop(self) -> tuple[Store, int] | None:
        """The first store in placement order and its place (for `push`), or None when none
        is deferred."""
        while self._heap:
            _, order, block_hash = heapq.heappop(self._heap)
            entry = self._stores.get(block_hash)
            if entry is not None and entry[1] == order:
                del self._stores[block_hash]
                return entry
        return None

    def get(self, block_hash: BlockHash) -> Store | None:
        """The store deferred for `block_hash`, or None."""
        entry = self._stores.get(block_hash)
        return None if entry is None else entry[0]

    def remove(self, block_hash: BlockHash) -> None:
        """Forget the store of `block_hash` (KeyError when none is deferred)."""
        del self._stores[block_hash]
        if len(self._heap) > 2 * len(self._stores) + 64:  # mostly leftovers: rebuild
            self._heap = [(order_key(store[2]), order, block_hash)
                          for block_hash, (store, order) in self._stores.items()]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        self._stores.clear()
        self._heap.clear()
