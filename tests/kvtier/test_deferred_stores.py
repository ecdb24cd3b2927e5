"""The order deferred write-throughs get host slots in (`kvtier.deferred_stores`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.deferred_stores import DeferredStores
from kvtier.free_queue import BlockId, KVCacheBlock
from kvtier.tiers.record import BlockMeta


def store(block_id, rank):
    name = f"b{block_id}".encode()
    return (KVCacheBlock(BlockId(block_id)), BlockMeta(name, b"parent", (block_id,)), rank)


def drain(deferred):
    ids = []
    while (entry := deferred.pop()) is not None:
        ids.append(entry[0][0].block_id)
    return ids


def test_ranked_blocks_first_the_deepest_first_then_the_rest_oldest_first():
    deferred = DeferredStores()
    # Two prompts' blocks as steps offer them: a head (None), then tails ranked by position.
    for block_id, rank in [(0, None), (1, None), (2, 2), (3, 3), (10, None), (4, 4),
                           (12, 2), (13, 3)]:
        deferred.push(store(block_id, rank))
    # Equal ranks: the oldest first.
    assert drain(deferred) == [4, 3, 13, 2, 12, 0, 1, 10]
    assert len(deferred) == 0 and deferred.pop() is None


def test_a_store_put_back_keeps_its_place():
    deferred = DeferredStores()
    for block_id in range(4):
        deferred.push(store(block_id, None))
    first, order = deferred.pop()
    deferred.push(store(9, 1))  # a ranked one meanwhile: ahead of everything
    deferred.push(first, order)  # found no slot: back where it was
    assert drain(deferred) == [9, 0, 1, 2, 3]


def test_removed_stores_are_not_popped_and_leftovers_are_dropped():
    deferred = DeferredStores()
    for block_id in range(200):
        deferred.push(store(block_id, block_id % 7))
    for block_id in range(0, 200, 2):
        deferred.remove(f"b{block_id}".encode())
    assert len(deferred) == 100 and b"b2" not in deferred and b"b3" in deferred
    assert len(deferred._heap) <= 2 * len(deferred) + 64
    ids = drain(deferred)
    assert sorted(ids) == list(range(1, 200, 2))
    assert ids == sorted(ids, key=lambda i: (-(i % 7), i))


@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "remove"]),
                          st.integers(0, 30), st.one_of(st.none(), st.integers(0, 5))),
                max_size=80))
def test_pops_follow_a_sorted_list(ops):
    """Against a list sorted by (ranked first, higher rank first, oldest first)."""
    deferred, model, order = DeferredStores(), [], 0
    for op, block_id, rank in ops:
        name = f"b{block_id}".encode()
        present = any(entry[2] == block_id for entry in model)
        if op == "push" and not present:
            deferred.push(store(block_id, rank))
            model.append((1 if rank is None else -rank, order, block_id))
            order += 1
        elif op == "remove" and present:
            deferred.remove(name)
            model = [entry for entry in model if entry[2] != block_id]
        elif op == "pop":
            entry = deferred.pop()
            if not model:
                assert entry is None
                continue
            expected = min(model)
            model.remove(expected)
            assert entry is not None and entry[0][0].block_id == expected[2]
        assert len(deferred) == len(model)
