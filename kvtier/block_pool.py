"""The GPU block pool: reference-counted blocks, a hash -> block map of cached full blocks,
and an LRU queue of free blocks that may still hold a cached hash.

Invariants (checked by `check_invariants`, and by the tests after every operation):
  * `ref_cnt >= 0` for every block;
  * a block is in the free queue iff its `ref_cnt` is 0;
  * `cached[h]` is a block whose `block_hash` is `h`, and a block with a hash is in `cached`;
  * used + free = total.

Eviction is lazy: a freed block keeps its hash and can be hit again until `allocate` reuses
it. At that moment its hash leaves the map and an `EvictionEvent` is recorded; the tier
manager takes the events with `take_events()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.free_queue import BlockId, FreeBlockQueue, KVCacheBlock
from kvtier.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class EvictionEvent:
    """A cached block's hash left the GPU pool because its block was reused."""

    block_hash: BlockHash
    block_id: BlockId


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool: sizes in blocks, and hit counters in blocks since creation."""

    num_blocks: int
    num_free: int
    num_cached: int
    hits: int
    queries: int
    evictions: int


class BlockPool:
    """A fixed set of `num_blocks` GPU blocks.

    Raises ValueError for a non-positive `num_blocks`, and for misuse at the API boundary
    (freeing a block that is not held, caching a block under a second hash).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[EvictionEvent] = []
        self._hits = 0
        self._queries = 0
        self._evictions = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now (free, cached or not)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block caching `block_hash`, or None. Takes no reference."""
        return self.cached.get(block_hash)

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The longest run of cached blocks matching `block_hashes` from the start.

        Does not take references: call `touch` on the blocks that will be used.
        """
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self._queries += len(block_hashes)
        self._hits += len(hits)
        return hits

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free_blocks, len(self.cached),
                         self._hits, self._queries, self._evictions)

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Take `num_blocks` free blocks (least recently freed first), each with ref_cnt 1.

        Returns None, changing nothing, when fewer are free. A reused block that still holds
        a cached hash is evicted from the map and an EvictionEvent is recorded.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"allocate needs a non-negative integer count, got {num_blocks!r}")
        if num_blocks > len(self.free_queue):
            return None
        blocks = self.free_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit, or a transfer holding it)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block, given in sequence order.

        Blocks reaching ref_cnt 0 enter the free queue tail-first, so a chain's tail is
        evicted before its prefix; blocks without a hash go to the front (reused first, since
        nobody can hit them). Raises ValueError, changing nothing, if a block is not held
        (e.g. freed twice).
        """
        # One pass drops the references, tail first; a block that is not held undoes the
        # pass so far. The queue is only touched after the whole batch is known to be valid.
        released: list[KVCacheBlock] = []  # blocks reaching ref_cnt 0, tail first
        for num_done, block in enumerate(reversed(blocks)):
            if block.ref_cnt <= 0:
                for done in blocks[len(blocks) - num_done:]:
                    done.ref_cnt += 1
                raise ValueError(f"block {block.block_id} is freed more times than it is held; "
                                 "was it freed twice?")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        tail_first: list[KVCacheBlock] = []
        for block in released:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                tail_first.append(block)
        self.free_queue.append_n(tail_first)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """Record that `blocks[i]` holds the full block `block_hashes[i]`.

        Returns the blocks that became cached now (the caller writes those through to the
        host tier). A hash already cached in another block is left there and this block stays
        uncached (two requests computed the same block). Raises ValueError, changing nothing,
        on a length mismatch, a block that is not held, or a block that already carries (or
        is given in this call) a different hash.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        claimed: dict[int, BlockHash] = {}  # block id -> the one hash it may carry
        for block, block_hash in zip(blocks, block_hashes):
            if block.ref_cnt == 0:
                raise ValueError(f"block {block.block_id} is free; only held blocks are cached")
            previous = claimed.setdefault(block.block_id, block.block_hash or block_hash)
            if previous != block_hash:
                raise ValueError(f"block {block.block_id} already holds another hash")
        newly: list[KVCacheBlock] = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            newly.append(block)
        return newly

    def uncache(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Forget the hashes of `blocks` (their bytes are not to be trusted any more).

        A free block that loses its hash moves to the front of the free queue: nobody can hit
        it any more, so it is reused first. Records no EvictionEvent (the caller knows).
        """
        for block in blocks:
            if block.block_hash is None:
                continue
            assert self.cached.get(block.block_hash) is block, f"{block} not in the hash map"
            del self.cached[block.block_hash]
            block.block_hash = None
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)

    def take_events(self) -> list[EvictionEvent]:
        """Eviction events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- internals -----------------------------------------------------------------------

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
        self._events.append(EvictionEvent(block_hash, block.block_id))
        self._evictions += 1
        block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the pool's invariants (O(num_blocks); for tests and debugging)."""
        queued = {b.block_id for b in self.free_queue.blocks()}
        assert len(queued) == len(self.free_queue), "free queue length out of sync"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref_cnt"
            assert (block.ref_cnt == 0) == (block.block_id in queued), \
                f"{block}: in free queue={block.block_id in queued}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} not in hash map"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map points at {block} wrongly"
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert used + len(self.free_queue) == self.num_blocks, "used + free != total"
