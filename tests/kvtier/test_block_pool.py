"""BlockPool scenarios on a 4-block pool, one comment per step, invariants checked throughout."""

import pytest

from kvtier.block_pool import BlockPool, EvictionEvent
from kvtier.hashing import BlockHash


def h(name: str) -> BlockHash:
    """A readable 16-byte stand-in for a block hash."""
    return BlockHash(name.encode().ljust(16, b"."))


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_queue.blocks())


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable about the pool's state."""
    return (queue_ids(pool), [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks],
            {k: v.block_id for k, v in pool.cached.items()}, pool.num_free_blocks)


@pytest.fixture
def pool() -> BlockPool:
    pool = BlockPool(4)
    yield pool
    pool.check_invariants()


def test_allocate_cache_and_free_tail_first(pool):
    # A fresh pool hands out blocks in id order.
    assert queue_ids(pool) == [0, 1, 2, 3]
    # A request of 2 full blocks and a partial one takes blocks 0, 1, 2.
    blocks = pool.allocate(3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    pool.check_invariants()
    # Its two full blocks are cached; the partial third one stays uncached.
    newly = pool.cache_full_blocks(blocks[:2], [h("a0"), h("a1")])
    assert ids(newly) == [0, 1]
    assert pool.get_cached_block(h("a1")) is blocks[1]
    assert pool.stats().num_cached == 2
    pool.check_invariants()
    # The request finishes. Freed in sequence order, the blocks enter the queue tail-first
    # (chain tail 1 before its parent 0); the uncached block 2 goes to the front.
    pool.free(blocks)
    assert queue_ids(pool) == [2, 3, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
    # Freed blocks keep their hashes: the prefix can still be hit.
    assert pool.stats().num_cached == 2


def test_prefix_hit_via_lookup_and_touch(pool):
    # Request A computes and caches two blocks, then finishes.
    a = pool.allocate(2)
    pool.cache_full_blocks(a, [h("a0"), h("a1")])
    pool.free(a)
    assert queue_ids(pool) == [2, 3, 1, 0]
    # Request B shares A's first block only: lookup stops at the first miss.
    hits = pool.lookup_prefix([h("a0"), h("b1"), h("a1")])
    assert ids(hits) == [0]
    assert pool.stats().hits == 1 and pool.stats().queries == 3
    # Lookup takes no reference; touch does, and pulls the block out of the free queue.
    assert hits[0].ref_cnt == 0
    pool.touch(hits)
    assert hits[0].ref_cnt == 1
    assert queue_ids(pool) == [2, 3, 1]
    pool.check_invariants()
    # B allocates its second block: the never-used block 2 comes before the cached block 1.
    new = pool.allocate(1)
    assert ids(new) == [2]
    assert pool.take_events() == []
    # Request C hits the same prefix while B holds it: ref_cnt 2.
    pool.touch(pool.lookup_prefix([h("a0")]))
    assert pool.blocks[0].ref_cnt == 2
    # B finishes: block 0 is still held by C, so only block 2 (uncached) is queued, at the front.
    pool.free(hits + new)
    assert pool.blocks[0].ref_cnt == 1
    assert queue_ids(pool) == [2, 3, 1]
    # C finishes: block 0 is queued at the back, evicted last.
    pool.free([pool.blocks[0]])
    assert queue_ids(pool) == [2, 3, 1, 0]


def test_eviction_on_reuse_records_events(pool):
    # A caches a 3-block chain and finishes; block 3 was never used.
    a = pool.allocate(3)
    pool.cache_full_blocks(a, [h("a0"), h("a1"), h("a2")])
    pool.free(a)
    assert queue_ids(pool) == [3, 2, 1, 0]
    # Taking 2 blocks uses the clean block 3, then evicts the chain's tail (block 2).
    taken = pool.allocate(2)
    assert ids(taken) == [3, 2]
    assert pool.take_events() == [EvictionEvent(h("a2"), 2)]
    # The evicted hash is gone; its parents still hit.
    assert pool.get_cached_block(h("a2")) is None
    assert ids(pool.lookup_prefix([h("a0"), h("a1"), h("a2")])) == [0, 1]
    assert taken[1].block_hash is None
    # Events are handed out once.
    assert pool.take_events() == []
    # Taking the last two evicts tail before head, and the events keep that order.
    rest = pool.allocate(2)
    assert ids(rest) == [1, 0]
    assert pool.take_events() == [EvictionEvent(h("a1"), 1), EvictionEvent(h("a0"), 0)]
    assert pool.stats().evictions == 3
    assert pool.cached == {}


def test_allocate_returns_none_without_partial_allocation(pool):
    # One request holds a cached block and a plain one; two blocks are free, one cached.
    held = pool.allocate(2)
    pool.cache_full_blocks(held[:1], [h("x")])
    spare = pool.allocate(1)
    pool.cache_full_blocks(spare, [h("y")])
    pool.free(spare)
    before = snapshot(pool)
    # Asking for three blocks when two are free fails as a whole...
    assert pool.allocate(3) is None
    # ...and changes nothing: no block taken, no hash evicted, no event recorded.
    assert snapshot(pool) == before
    assert pool.take_events() == []
    # Asking for exactly what is free succeeds.
    assert len(pool.allocate(2)) == 2
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []


def test_uncached_blocks_are_reused_before_cached_ones(pool):
    # Two requests: A caches both of its blocks, B caches neither.
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.cache_full_blocks(a, [h("a0"), h("a1")])
    # A finishes first, then B; B's uncached blocks still go ahead of A's cached ones.
    pool.free(a)
    pool.free(b)
    assert queue_ids(pool) == [2, 3, 1, 0]
    # The next two allocations take B's blocks and evict nothing.
    assert ids(pool.allocate(2)) == [2, 3]
    assert pool.take_events() == []
    assert ids(pool.lookup_prefix([h("a0"), h("a1")])) == [0, 1]


def test_uncache_sends_a_free_block_to_the_front(pool):
    # A caches two blocks and finishes: queue is [2, 3, 1, 0].
    a = pool.allocate(2)
    pool.cache_full_blocks(a, [h("a0"), h("a1")])
    pool.free(a)
    # Block 0's bytes turn out to be bad: it loses its hash and is reused first.
    pool.uncache([pool.blocks[0]])
    assert pool.get_cached_block(h("a0")) is None
    assert queue_ids(pool) == [0, 2, 3, 1]
    # Uncaching a held block only drops the hash; it stays held.
    held = pool.allocate(1)
    assert ids(held) == [0]
    pool.touch(pool.lookup_prefix([h("a0"), h("a1")]))  # a0 misses, so nothing is touched
    assert pool.blocks[1].ref_cnt == 0
    pool.uncache([pool.blocks[1]])
    assert queue_ids(pool) == [1, 2, 3]
    assert pool.take_events() == []


def test_a_hash_cached_twice_stays_with_its_first_block(pool):
    # Two requests compute the same block at once; the first to finish caches it.
    first, second = pool.allocate(1), pool.allocate(1)
    assert ids(pool.cache_full_blocks(first, [h("same")])) == [0]
    # The second one's copy is not cached: the hash keeps pointing at block 0.
    assert pool.cache_full_blocks(second, [h("same")]) == []
    assert second[0].block_hash is None
    assert pool.get_cached_block(h("same")) is first[0]
    # Caching a block again under its own hash is a no-op.
    assert pool.cache_full_blocks(first, [h("same")]) == []


def test_cache_full_blocks_rejects_bad_input_and_changes_nothing(pool):
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks[:1], [h("a0")])
    before = snapshot(pool)
    # Length mismatch.
    with pytest.raises(ValueError, match="2 blocks but 1 hashes"):
        pool.cache_full_blocks(blocks[1:], [h("a1")])
    # A block that already carries another hash (the valid first pair is not applied either).
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_blocks([blocks[1], blocks[0]], [h("a1"), h("other")])
    # The same block given two different hashes in one call.
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_blocks([blocks[2], blocks[2]], [h("p"), h("q")])
    # A free block.
    free_block = pool.free_queue.blocks()[0]
    with pytest.raises(ValueError, match="free"):
        pool.cache_full_blocks([blocks[1], free_block], [h("a1"), h("z")])
    assert snapshot(pool) == before
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks", [0, -1, True, 2.0, "4", None])
def test_bad_pool_size_raises_value_error(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


@pytest.mark.parametrize("count", [-1, 1.0, True, None])
def test_allocate_bad_count_raises_value_error(pool, count):
    before = snapshot(pool)
    with pytest.raises(ValueError, match="allocate"):
        pool.allocate(count)
    assert snapshot(pool) == before


def test_freeing_twice_raises_and_corrupts_nothing(pool):
    # A request holds two blocks, one cached; it frees them once.
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks[:1], [h("a0")])
    pool.free(blocks)
    before = snapshot(pool)
    # Freeing them again is a bug in the caller: ValueError, and nothing moves.
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(blocks)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_freeing_more_references_than_held_in_one_call_changes_nothing(pool):
    # Block 0 is held once, block 1 twice.
    blocks = pool.allocate(2)
    pool.touch(blocks[1:])
    before = snapshot(pool)
    # One call that frees block 1 twice is fine; block 0 twice is not, and nothing changes.
    with pytest.raises(ValueError, match="block 0"):
        pool.free([blocks[1], blocks[1], blocks[0], blocks[0]])
    assert snapshot(pool) == before
    pool.check_invariants()
    # The valid part alone works.
    pool.free([blocks[1], blocks[1], blocks[0]])
    assert pool.num_free_blocks == 4


def test_touch_of_a_free_block_removes_it_from_the_middle_of_the_queue(pool):
    # Block 2 sits in the middle of the free queue.
    assert queue_ids(pool) == [0, 1, 2, 3]
    pool.touch([pool.blocks[2]])
    # It leaves the queue in O(1) and the rest keep their order.
    assert queue_ids(pool) == [0, 1, 3]
    assert ids(pool.allocate(3)) == [0, 1, 3]
    assert pool.allocate(1) is None
