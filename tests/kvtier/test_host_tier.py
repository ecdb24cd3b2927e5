"""HostTier on a 3-slot slab: slots, index, pins, dirty blocks and eviction order."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.tiers.host import HostTier, SlotState, allocate_slab, available_memory_bytes
from kvtier.tiers.record import BlockMeta

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float16)


def meta(i: int) -> BlockMeta:
    return BlockMeta(BlockHash(bytes([i + 1]) * 16), BlockHash(b"\0" * 16), (i, i + 1))


def cached(host: HostTier, i: int, dirty: bool = False) -> int:
    """Allocate, commit and unpin a slot for block i (as a finished write-through)."""
    slot = host.allocate_slot(meta(i))
    assert slot is not None
    assert host.commit(slot, dirty=dirty)
    host.unpin(slot)
    host.check_invariants(idle=True)
    return slot


@pytest.fixture
def host() -> HostTier:
    return HostTier(LAYOUT, num_slots=3, pin_memory=False)


def test_slab_and_slot_views(host):
    assert host.slab.shape == (3, *LAYOUT.block_shape) and host.slab.dtype == torch.float16
    slot = cached(host, 0)
    # slot_bytes is a view of the slab: bytes written there are the slot's block.
    data = torch.randn(LAYOUT.block_shape).half()
    host.slot_bytes(slot).copy_(data.view(torch.uint8).view(-1))
    assert torch.equal(host.slot_tensor(slot), data)
    assert host.slot_bytes(slot).numel() == LAYOUT.bytes_per_block


def test_reserved_slots_are_invisible_until_committed(host):
    slot = host.allocate_slot(meta(0))
    assert slot is not None and host.state(slot) is SlotState.RESERVED
    assert host.lookup(meta(0).block_hash) is None and not host.contains(meta(0).block_hash)
    assert host.commit(slot, dirty=False)
    assert host.lookup(meta(0).block_hash) == slot
    host.unpin(slot)
    host.check_invariants(idle=True)


def test_clean_slots_are_evicted_least_recently_used_first(host):
    slots = [cached(host, i) for i in range(3)]
    assert host.num_free_slots == 0
    # Block 0 is read, so block 1 is now the coldest.
    host.lookup(meta(0).block_hash)
    slot = host.allocate_slot(meta(3))
    assert slot == slots[1] and not host.contains(meta(1).block_hash)
    assert host.num_evictions == 1
    host.commit(slot, dirty=False)
    host.unpin(slot)
    host.check_invariants(idle=True)


def test_pinned_dirty_and_reserved_slots_are_never_evicted(host):
    a = cached(host, 0)
    cached(host, 1, dirty=True)
    host.pin(a)
    reserved = host.allocate_slot(meta(2))  # the last free slot, reserved by a transfer
    assert reserved is not None
    # Nothing can go: a is pinned, block 1 is dirty, the third slot is reserved.
    assert host.allocate_slot(meta(3)) is None
    assert host.contains(meta(0).block_hash) and host.contains(meta(1).block_hash)
    host.check_invariants()
    # Once unpinned, a is the only candidate.
    host.unpin(a)
    assert host.allocate_slot(meta(3)) == a
    host.check_invariants()


def test_dirty_blocks_leave_only_after_mark_clean(host):
    slots = [cached(host, i, dirty=True) for i in range(3)]
    assert host.num_dirty == 3 and host.writeback_candidates(2) == slots[:2]
    assert host.allocate_slot(meta(3)) is None
    # A block being written back is pinned, so it is not offered twice.
    host.pin(slots[0])
    assert host.writeback_candidates(3) == slots[1:]
    host.unpin(slots[0])
    host.mark_clean(slots[0])
    assert host.num_dirty == 2 and host.num_clean == 1
    assert host.allocate_slot(meta(3)) == slots[0]
    host.check_invariants()


def test_dirty_blocks_are_written_back_least_recently_used_first(host):
    slots = [cached(host, i, dirty=True) for i in range(3)]
    assert host.lookup(meta(0).block_hash) == slots[0]  # a read makes block 0 the newest
    assert host.writeback_candidates(3) == [slots[1], slots[2], slots[0]]
    assert host.dirty_slots() == [slots[1], slots[2], slots[0]]
    host.check_invariants(idle=True)


def test_a_block_written_back_is_evicted_after_the_blocks_clean_before_it(host):
    dirty = cached(host, 0, dirty=True)
    clean = [cached(host, i) for i in (1, 2)]
    host.mark_clean(dirty)  # its write committed: it joins the eviction order as its newest
    host.check_invariants(idle=True)
    assert host.allocate_slot(meta(3)) == clean[0]
    assert host.allocate_slot(meta(4)) == clean[1]
    assert host.allocate_slot(meta(5)) == dirty


def test_duplicate_commit_leaves_the_slot_reserved_for_release(host):
    first = cached(host, 0)
    second = host.allocate_slot(meta(0))
    assert second is not None and not host.commit(second, dirty=False)
    assert host.lookup(meta(0).block_hash) == first
    host.release(second)  # a reserved slot is freed, not indexed
    assert host.state(second) is SlotState.FREE
    host.pin(first)
    host.release(first)  # a cached slot is unpinned and stays cached
    assert host.state(first) is SlotState.CACHED and host.num_pins(first) == 0
    host.check_invariants(idle=True)


def test_remove(host):
    slot = cached(host, 0)
    host.pin(slot)
    with pytest.raises(ValueError, match="pinned"):
        host.remove(meta(0).block_hash)
    host.unpin(slot)
    assert host.remove(meta(0).block_hash) and not host.remove(meta(0).block_hash)
    assert host.num_free_slots == 3
    host.check_invariants(idle=True)


def test_slab_larger_than_available_memory_is_refused():
    available = available_memory_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    num_slots = available // LAYOUT.bytes_per_block + 1
    with pytest.raises(ValueError, match="available"):
        allocate_slab(LAYOUT, num_slots, pin_memory=False)
    with pytest.raises(ValueError, match="positive"):
        allocate_slab(LAYOUT, 0, pin_memory=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pinning_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        HostTier(LAYOUT, 2, pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slab_is_pinned_with_cuda():
    assert HostTier(LAYOUT, 2, pin_memory=True).slab.is_pinned()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin", "clean", "read"]),
                          st.integers(0, 4)), max_size=40))
@example([("store", 1), ("store", 3), ("pin", 1), ("store", 4)])  # pinned and coldest
@example([("store", 0), ("store", 2), ("store", 1)])  # every block dirty
def test_a_pinned_slot_keeps_its_block(ops):
    """Whatever happens, a pinned slot still holds the block it held when pinned, and a
    dirty block is never dropped."""
    host = HostTier(LAYOUT, num_slots=2, pin_memory=False)
    pins: dict[int, int] = {}  # slot -> block number, for slots we pinned
    dirty: set[int] = set()  # blocks stored dirty and not cleaned since
    for op, i in ops:
        slot = host.slot_of(meta(i).block_hash)
        if op == "store" and slot is None:
            new = host.allocate_slot(meta(i))
            if new is not None:
                assert new not in pins, "a pinned slot was handed out again"
                host.commit(new, dirty=i % 2 == 0)
                host.unpin(new)
                if i % 2 == 0:
                    dirty.add(i)
        elif op == "pin" and slot is not None and slot not in pins:
            host.pin(slot)
            pins[slot] = i
        elif op == "unpin" and pins:
            pinned = next(iter(pins))
            host.unpin(pinned)
            del pins[pinned]
        elif op == "clean" and slot is not None and host.is_dirty(slot):
            host.mark_clean(slot)
            dirty.discard(i)
        elif op == "read":
            assert host.lookup(meta(i).block_hash) == slot
        for pinned, block in pins.items():
            assert host.state(pinned) is SlotState.CACHED
            assert host.meta(pinned) == meta(block)
        assert all(host.contains(meta(block).block_hash) for block in dirty)
        host.check_invariants(idle=not pins)
