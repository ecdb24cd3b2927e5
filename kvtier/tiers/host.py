"""The host tier: one slab of (pinned) host memory carved into block-sized slots.

    slab: [num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]

A slot is FREE, RESERVED (handed out by `allocate_slot`; its bytes are arriving or it only
stages a transfer) or CACHED (indexed under its block hash; `lookup` finds it). Pins count the
transfers reading or writing a slot; a pinned slot is never evicted nor reused. A CACHED slot
is dirty while its bytes exist nowhere below the host (not yet written back to disk); the
eviction policy only ever evicts clean, unpinned slots, so a dirty block leaves the host only
after the manager wrote it back and called `mark_clean`.

A slab has one role (`HostRole`): a CACHE indexes the blocks that land in it, so lookups
find them; a STAGING slab only carries bytes between the GPU and the tiers below (the host
tier is off): nothing is ever indexed in it, so it holds no hit, no dirty block and nothing
to write back, and every slot goes back to the free list once its transfer is done.

Not thread-safe: the tier manager owns it and drives it from one thread. Transfer threads only
read or write the bytes of slots the manager pinned for them.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

import numpy as np
import torch

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.shared_host_memory import SharedHostMemory
from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy

if TYPE_CHECKING:
    from kvtier.tiers.record import BlockMeta

SlotId = NewType("SlotId", int)


class HostRole(enum.Enum):
    """What a host slab is for (see the module docstring)."""

    CACHE = "cache"
    STAGING = "staging"


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    CACHED = "cached"


@dataclass(slots=True)
class _Slot:
    state: SlotState = SlotState.FREE
    meta: BlockMeta | None = None
    num_pins: int = 0
    dirty: bool = False


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def allocate_slab(layout: KVLayout, num_slots: int, pin_memory: bool,
                  shared: SharedHostMemory | None = None) -> torch.Tensor:
    """An uninitialised `[num_slots, *block_shape]` host tensor, pinned if asked; with
    `shared`, a view of that memory (which must hold exactly the slab's bytes).

    Raises as `check_slab` does; OSError when the allocation or the pinning fails.
    """
    num_bytes = check_slab(layout, num_slots, pin_memory)
    if shared is not None:
        if shared.num_bytes != num_bytes:
            raise ValueError(f"the shared memory holds {shared.num_bytes} bytes, the slab "
                             f"{num_bytes}")
        return shared.data.view(layout.dtype).view(num_slots, *layout.block_shape)
    try:
        return torch.empty((num_slots, *layout.block_shape), dtype=layout.dtype,
                           pin_memory=pin_memory)
    except RuntimeError as exc:
        what = "pin" if pin_memory else "allocate"
        raise OSError(f"could not {what} a host slab of {num_bytes / 2**30:.2f} GiB: {exc}; "
                      "lower the host capacity (or the locked-memory limit is too small)") from exc


def check_slab(layout: KVLayout, num_slots: int, pin_memory: bool) -> int:
    """The bytes of a slab of `num_slots`. Raises ValueError when `num_slots` is not
    positive, when pinning is asked without CUDA, or when the slab is larger than the
    memory the kernel reports as available."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
        raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
    if pin_memory and not torch.cuda.is_available():
        raise ValueError("pin_memory=True needs CUDA; use plain host memory without a GPU")
    num_bytes = num_slots * layout.bytes_per_block
    available = available_memory_bytes()
    if available is not None and num_bytes > available:
        raise ValueError(f"the host tier needs {num_bytes / 2**30:.2f} GiB ({num_slots} slots "
                         f"of {layout.bytes_per_block} bytes) but only "
                         f"{available / 2**30:.2f} GiB are available; lower the host capacity")
    return num_bytes


class HostTier:
    """Block-sized slots of one host slab, an index hash -> slot, pins and a policy.

    `pin_memory=True` needs CUDA (page-locked memory makes GPU copies asynchronous and
    fast). The policy (LRU by default) orders the clean cached blocks, the eviction
    candidates. `role`: a cache, or a staging slab (see the module
    docstring). `shared`: the slab lives in memory another process can map
    (`shared_memory`: a disk worker process reads and writes its slots). Raises as
    `allocate_slab` and `SharedHostMemory` do.
    """

    def __init__(self, layout: KVLayout, num_slots: int, pin_memory: bool,
                 policy: EvictionPolicy[BlockHash] | None = None,
                 role: HostRole = HostRole.CACHE, shared: bool = False) -> None:
        self.layout, self.role = layout, role
        self.num_slots = num_slots
        #: The slab's memory when it is shared with another process, else None.
        self.shared_memory: SharedHostMemory | None = None
        if shared:
            self.shared_memory = SharedHostMemory(check_slab(layout, num_slots, pin_memory),
                                                  pin=pin_memory)
        # [num_slots, *block_shape]
        self.slab = allocate_slab(layout, num_slots, pin_memory, self.shared_memory)
        # The same memory as numpy rows: a row costs far less than a tensor view, and a
        # restore takes one per block on the engine thread.
        self._slab_rows = self.slab.view(torch.uint8).view(num_slots, -1).numpy()
        self.policy: EvictionPolicy[BlockHash] = policy if policy is not None else LRUPolicy()
        self._slots = [_Slot() for _ in range(num_slots)]
        self._free: deque[SlotId] = deque(SlotId(i) for i in range(num_slots))
        self._index: dict[BlockHash, SlotId] = {}
        # Dirty cached blocks, least recently used first: the write-back order.
        self._dirty: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_evictions = 0

    def close(self) -> None:
        """Give back a shared slab's page-locking and file (nothing for a private slab);
        call it once no copy uses the slab. Idempotent."""
        if self.shared_memory is not None:
            self.shared_memory.close()

    # ---- queries -------------------------------------------------------------------------

    @property
    def caches(self) -> bool:
        """Whether blocks that land here are kept and found by lookups (else: staging)."""
        return self.role is HostRole.CACHE

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    @property
    def num_dirty(self) -> int:
        """Cached slots whose block is not yet written anywhere below the host."""
        return len(self._dirty)

    @property
    def num_clean(self) -> int:
        """Cached slots that may be evicted once unpinned."""
        return len(self._index) - len(self._dirty)

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `block_hash` is cached here (does not count as a use)."""
        return block_hash in self._index

    def slot_of(self, block_hash: BlockHash) -> SlotId | None:
        """The slot caching `block_hash`, or None; not a use (for inspection and tests)."""
        return self._index.get(block_hash)

    def lookup(self, block_hash: BlockHash) -> SlotId | None:
        """The slot caching `block_hash`, marked as used for the policy; None on a miss."""
        slot = self._index.get(block_hash)
        if slot is None:
            return None
        if block_hash in self._dirty:
            self._dirty.move_to_end(block_hash)
        else:
            self.policy.on_hit(block_hash)
        return slot

    def meta(self, slot: SlotId) -> BlockMeta:
        meta = self._slots[slot].meta
        assert meta is not None, f"slot {slot} is free and has no block"
        return meta

    def state(self, slot: SlotId) -> SlotState:
        return self._slots[slot].state

    def num_pins(self, slot: SlotId) -> int:
        return self._slots[slot].num_pins

    def is_dirty(self, slot: SlotId) -> bool:
        return self._slots[slot].dirty

    def slot_tensor(self, slot: SlotId) -> torch.Tensor:
        """The slot's block as a view `[num_layers, 2, block_size, num_kv_heads, head_dim]`."""
        return self.slab[slot]

    def slot_bytes(self, slot: SlotId) -> torch.Tensor:
        """The slot's bytes as a contiguous uint8 tensor view `[bytes_per_block]`."""
        return self.slab[slot].view(torch.uint8).view(-1)

    def slot_array(self, slot: SlotId) -> np.ndarray:
        """The slot's bytes as a uint8 numpy view `[bytes_per_block]` of the slab (for disk
        and remote I/O: cheaper to make than `slot_bytes`)."""
        return self._slab_rows[slot]

    # ---- slots ---------------------------------------------------------------------------

    def allocate_slot(self, meta: BlockMeta) -> SlotId | None:
        """A RESERVED slot for `meta`'s block, pinned once for the caller.

        Takes a free slot, else evicts the policy's first clean, unpinned cached slot.
        Returns None, changing nothing, when every slot is reserved, pinned or dirty.
        The caller later calls `commit` (the bytes landed) or `free_slot`.
        """
        if self._free:
            slot = self._free.popleft()
        else:
            victims = self.policy.victims(1, self._is_evictable)
            if not victims:
                return None
            slot = self._index[victims[0]]
            self._drop_cached(slot)
            self.num_evictions += 1
        entry = self._slots[slot]
        assert entry.state is SlotState.FREE and entry.num_pins == 0, f"slot {slot}: {entry}"
        entry.state, entry.meta, entry.num_pins, entry.dirty = SlotState.RESERVED, meta, 1, False
        return slot

    def commit(self, slot: SlotId, dirty: bool) -> bool:
        """The RESERVED slot's bytes landed: index it under its block hash (pins unchanged).

        `dirty`: the block exists nowhere below the host yet (it must be written back before
        its slot can be evicted). Returns False, leaving the slot RESERVED, when the hash is
        already cached in another slot, or always on a staging slab; the caller then frees
        this one when done with it.
        """
        entry = self._slots[slot]
        assert entry.state is SlotState.RESERVED and entry.meta is not None, \
            f"commit of slot {slot} in state {entry.state}"
        block_hash = entry.meta.block_hash
        if block_hash in self._index or self.role is HostRole.STAGING:
            return False
        entry.state, entry.dirty = SlotState.CACHED, dirty
        self._index[block_hash] = slot
        if dirty:
            self._dirty[block_hash] = None
        else:
            self.policy.on_put(block_hash)
        return True

    def free_slot(self, slot: SlotId) -> None:
        """Give back a RESERVED slot (its transfer failed, or it only staged bytes).

        Only the allocator's own pin may remain; it is dropped.
        """
        entry = self._slots[slot]
        assert entry.state is SlotState.RESERVED, f"free_slot of slot {slot} in {entry.state}"
        assert entry.num_pins <= 1, f"slot {slot} is still pinned {entry.num_pins} times"
        entry.state, entry.meta, entry.num_pins, entry.dirty = SlotState.FREE, None, 0, False
        self._free.append(slot)

    def release(self, slot: SlotId) -> None:
        """A transfer is done with the slot: unpin a CACHED slot, free a RESERVED one (it
        only staged bytes, or duplicates a block cached in another slot)."""
        if self._slots[slot].state is SlotState.RESERVED:
            self.free_slot(slot)
        else:
            self.unpin(slot)

    def pin(self, slot: SlotId) -> None:
        """One more transfer uses the slot: it is not evicted or reused until `unpin`."""
        entry = self._slots[slot]
        assert entry.state is not SlotState.FREE, f"pin of free slot {slot}"
        entry.num_pins += 1

    def unpin(self, slot: SlotId) -> None:
        entry = self._slots[slot]
        assert entry.num_pins > 0, f"unpin of slot {slot} that is not pinned"
        entry.num_pins -= 1

    def mark_clean(self, slot: SlotId) -> None:
        """The CACHED slot's block now also lives below the host: it may be evicted."""
        entry = self._slots[slot]
        assert entry.state is SlotState.CACHED, f"mark_clean of slot {slot} in {entry.state}"
        if entry.dirty:
            entry.dirty = False
            assert entry.meta is not None
            del self._dirty[entry.meta.block_hash]
            self.policy.on_put(entry.meta.block_hash)  # an eviction candidate from now on

    def remove(self, block_hash: BlockHash) -> bool:
        """Forget a cached block and free its slot; False if it is not cached.

        Raises ValueError if the slot is pinned (a transfer still uses it).
        """
        slot = self._index.get(block_hash)
        if slot is None:
            return False
        if self._slots[slot].num_pins:
            raise ValueError(f"slot {slot} of block {block_hash.hex()[:16]} is pinned by a "
                             "transfer; remove it after the transfer completed")
        self._drop_cached(slot)
        self._free.append(slot)
        return True

    def writeback_candidates(self, num_slots: int) -> list[SlotId]:
        """Up to `num_slots` dirty, unpinned cached slots in eviction order (first to go
        first): the blocks to write back so that slots can be freed."""
        slots: list[SlotId] = []
        for block_hash in self._dirty:
            if len(slots) >= num_slots:
                break
            slot = self._index[block_hash]
            if not self._slots[slot].num_pins:  # a pinned one is being written (or read)
                slots.append(slot)
        return slots

    def dirty_slots(self) -> list[SlotId]:
        """Every dirty cached slot, pinned or not (to flush at shutdown)."""
        return [self._index[block_hash] for block_hash in self._dirty]

    # ---- internals -----------------------------------------------------------------------

    def _is_evictable(self, block_hash: BlockHash) -> bool:
        return self._slots[self._index[block_hash]].num_pins == 0  # the policy's are clean

    def _drop_cached(self, slot: SlotId) -> None:
        """Un-index a cached slot and reset it to FREE (the caller reuses or queues it)."""
        entry = self._slots[slot]
        assert entry.state is SlotState.CACHED and entry.meta is not None
        block_hash = entry.meta.block_hash
        del self._index[block_hash]
        if entry.dirty:
            del self._dirty[block_hash]
        else:
            self.policy.on_remove(block_hash)
        entry.state, entry.meta, entry.num_pins, entry.dirty = SlotState.FREE, None, 0, False

    def check_invariants(self, idle: bool = False) -> None:
        """Assert the slot bookkeeping is consistent; with `idle` (no transfer in flight),
        also that no slot is pinned or reserved (O(num_slots); for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is twice in the free list"
        num_dirty = 0
        for slot, entry in enumerate(self._slots):
            assert entry.num_pins >= 0, f"slot {slot} has negative pins"
            assert (entry.state is SlotState.FREE) == (slot in free), f"slot {slot}: {entry}"
            if entry.state is SlotState.FREE:
                assert entry.num_pins == 0 and entry.meta is None and not entry.dirty
            if entry.state is SlotState.CACHED:
                assert entry.meta is not None and self._index.get(entry.meta.block_hash) == slot
                num_dirty += entry.dirty
            if entry.state is SlotState.RESERVED:
                assert not entry.dirty, f"reserved slot {slot} is dirty"
            assert not idle or (entry.num_pins == 0 and entry.state is not SlotState.RESERVED), \
                f"slot {slot} is pinned or reserved while no transfer is in flight: {entry}"
        for slot in self._index.values():
            assert self._slots[slot].state is SlotState.CACHED, f"index points at {slot}"
        assert num_dirty == len(self._dirty), f"dirty count {len(self._dirty)} != {num_dirty}"
        assert all(self._slots[self._index[h]].dirty for h in self._dirty), "a clean one dirty"
        assert len(self.policy) + len(self._dirty) == len(self._index), \
            "the policy tracks other keys than the clean cached ones"
