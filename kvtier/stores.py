"""The way down for computed blocks: GPU -> host -> disk (and the remote tier).

  * Write-through: a newly cached full GPU block is copied to a host slot asynchronously,
    in two phases. `write_through` takes an extra pool reference on the block (its GPU
    memory stays as computed) and records where the compute stream stands; `submit_pending`
    later finds the slots and starts the copy, ordered after that point only. The engine
    submits while the GPU runs its next step, so that the host work of the stores (slots,
    evictions, the copy plan: ~0.5-1 ms a step on an H100 host) is not spent between
    steps, when the GPU waits; under memory pressure the scheduler starts them sooner, when
    an allocation fails, before it preempts anyone. The slot is pinned during the copy and
    indexed once the bytes landed. With the host tier off and a disk tier on, a small
    staging slab carries the bytes on to disk.
  * Deferred write-through: when no slot can be had now (every slot dirty, pinned or
    reserved), the block is not waited for. It is remembered, without a reference, and
    copied once write-backs free a slot, if the GPU still caches it then.
  * Write-back: the least recently used dirty host blocks are written to disk ahead of
    demand; a slot is evicted only once its block is clean (its disk write committed).

`StorePath` is driven by the `TierManager` from the engine thread; its jobs run on the
manager's `TransferEngine` through the `submit` callable it is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvtier.block_pool import BlockPool
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.remote_io import RemoteWrites
from kvtier.stats import Direction, Tier, TierCounters
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier, SlotId
from kvtier.tiers.record import BlockMeta
from kvtier.transfer import IOJob, JobId, SwapJob, disk_write_job

#: Blocks per LMDB write transaction.
DISK_WRITE_BATCH = 32
#: A batched `submit_pending` starts the queued write-throughs once this many blocks wait,
#: or once they were offered `STORE_MAX_OFFERS` times (the engine offers twice a step), or
#: when the GPU pool runs low. Each copy job costs ~0.2-0.4 ms of host time whatever its
#: size: on an H100 a decode step of a 0.5B / 1B model (1.8 / 2.3 ms) took 1.15x / 1.09x as
#: long when every step started one for the block or two it filled.
STORE_BATCH_BLOCKS = 8
STORE_MAX_OFFERS = 16

Submit = Callable[[SwapJob | IOJob, Callable[[bool], None]], JobId]


def chunks(items: list, size: int) -> list[list]:
    """`items` cut into consecutive lists of at most `size`."""
    return [items[i:i + size] for i in range(0, len(items), size)]


class StorePath:
    """Write-through, deferred write-through and write-back over one manager's tiers.

    kv_cache: [num_gpu_blocks, *layout.block_shape], the GPU blocks `pool` hands out.
    host: the host tier, or (`host_caches` False) the staging slab in front of the disk.
    disk, remote_writes: the tiers below, None when off. submit: runs a job and calls its
    completion with whether it succeeded. counters: the manager's per-tier counters.
    """

    def __init__(self, pool: BlockPool, kv_cache: torch.Tensor, host: HostTier,
                 host_caches: bool, disk: DiskTier | None, remote_writes: RemoteWrites | None,
                 bytes_per_block: int, submit: Submit,
                 counters: dict[Tier, TierCounters]) -> None:
        self.pool, self.kv_cache, self.host = pool, kv_cache, host
        self.host_caches, self.disk, self.remote_writes = host_caches, disk, remote_writes
        self.bytes_per_block = bytes_per_block
        self._submit = submit
        self._counters = counters
        self._storing: set[BlockHash] = set()  # write-through in flight
        # Write-through copies in flight, oldest first: job id -> the GPU blocks it holds.
        self._copying: dict[JobId, list[KVCacheBlock]] = {}
        # Write-throughs not submitted yet: (blocks held with a reference, with their metas;
        # the compute stream's event after the step that computed them, None on a CPU).
        self._pending: list[tuple[list[tuple[KVCacheBlock, BlockMeta]],
                                  torch.cuda.Event | None]] = []
        self._num_offers = 0  # batched offers the queued write-throughs were held back from
        # Write-throughs that found no host slot, oldest first (see `_defer`).
        self._deferred: OrderedDict[BlockHash, tuple[KVCacheBlock, BlockMeta]] = OrderedDict()
        self._num_writing_back = 0
        self._writeback_reserve = max(1, host.num_slots // 8) if host_caches else 0
        #: Slots write-throughs leave to reads from the tiers below when the host tier runs
        #: out of evictable ones (writes outpacing the disk): without them, every slot a
        #: write-back cleaned went to the next store, and no disk read ever started.
        self._read_reserve = host.num_slots // 16 if host_caches and disk is not None else 0

    def write_through(self, blocks: Sequence[KVCacheBlock], metas: Sequence[BlockMeta]) -> None:
        """Queue newly cached GPU blocks (`metas[i]` names `blocks[i]`) for copying to host
        slots: each is held with a pool reference until `submit_pending` copies or drops it,
        and the copy will follow the work queued on the current stream now (the step that
        computed the blocks), not the steps launched meanwhile."""
        if not blocks:
            return
        self.pool.touch(blocks)
        computed = None
        if self.kv_cache.is_cuda:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.kv_cache.device))
        self._pending.append((list(zip(blocks, metas)), computed))

    @property
    def num_pending(self) -> int:
        """Blocks queued by `write_through` and not submitted yet."""
        return sum(len(pairs) for pairs, _ in self._pending)

    def submit_pending(self, batch: bool = False) -> None:
        """Start the copies `write_through` queued, as one job: a block already stored or
        being stored is skipped, one without a slot now is deferred (its reference dropped).
        `batch`: only once `STORE_BATCH_BLOCKS` are queued, they were held back
        `STORE_MAX_OFFERS` times, or the GPU pool has few free blocks left (see
        `STORE_BATCH_BLOCKS`); the queued blocks stay held on the GPU meanwhile."""
        if not self._pending:
            return
        if batch and not self._batch_due():
            self._num_offers += 1
            return
        pending, self._pending, self._num_offers = self._pending, [], 0
        pairs = [pair for entry, _ in pending for pair in entry]
        self.schedule_writebacks(len(pairs) + len(self._deferred))
        # The copy follows every step that computed its blocks.
        after = tuple(dict.fromkeys(event for _, event in pending if event is not None))
        for block, meta in self._copy_to_host(pairs, held=True, after=after or None):
            self._defer(block, meta)

    def _batch_due(self) -> bool:
        low = max(STORE_BATCH_BLOCKS, self.pool.num_blocks // 16)
        return (self.num_pending >= STORE_BATCH_BLOCKS or self._num_offers + 1 >= STORE_MAX_OFFERS
                or self.pool.num_free_blocks <= low)

    def progress(self, num_slots_wanted: int) -> None:
        """Once per engine step, after finished jobs ran: retry deferred write-throughs and
        start the write-backs that `num_slots_wanted` more slots (for loads) and the
        deferred ones need."""
        if self._deferred:
            self._retry_deferred()
        self.schedule_writebacks(num_slots_wanted + len(self._deferred))

    def write_back_all(self) -> bool:
        """Start writing every dirty, unpinned host block to disk; False when there is none
        (or no disk). The caller waits for the jobs (a deferred store may follow them)."""
        if not self.host_caches or self.disk is None:
            return False
        dirty = [s for s in self.host.dirty_slots() if self.host.num_pins(s) == 0]
        for chunk in chunks(dirty, DISK_WRITE_BATCH):
            self._write_to_disk(chunk, staged=False)
        return bool(dirty)

    # ---- write-through -------------------------------------------------------------------

    def _defer(self, block: KVCacheBlock, meta: BlockMeta) -> None:
        """No host slot for `block`'s write-through now: count it skipped, and retry it when
        write-backs free slots, if the GPU still caches it then (holding no reference)."""
        self._counters[Tier.HOST].rejected += 1
        self._deferred[meta.block_hash] = (block, meta)
        if len(self._deferred) > self.host.num_slots:  # older ones would be evicted anyway
            self._deferred.popitem(last=False)

    def _retry_deferred(self) -> None:
        """Write through the deferred blocks the GPU still caches, oldest first, while host
        slots can be had without waiting. Costs O(slots to be had + stale entries dropped),
        not O(entries): a host tier that stays dirty keeps up to a slab's worth of them."""
        num_room = self._store_room()  # at most: some clean slots are pinned
        pending: list[tuple[KVCacheBlock, BlockMeta]] = []
        while self._deferred and len(pending) < num_room:
            block_hash, (block, meta) = self._deferred.popitem(last=False)
            if self.pool.get_cached_block(block_hash) is block:  # else reused: dropped
                pending.append((block, meta))
        for block, meta in reversed(self._copy_to_host(pending, held=False)):  # in front
            self._deferred[meta.block_hash] = (block, meta)
            self._deferred.move_to_end(meta.block_hash, last=False)

    def _copy_to_host(self, pairs: Sequence[tuple[KVCacheBlock, BlockMeta]], held: bool,
                      after: tuple[torch.cuda.Event, ...] | None = None
                      ) -> list[tuple[KVCacheBlock, BlockMeta]]:
        """Copy cached GPU blocks to host slots, all in one job (`after`: as `SwapJob`'s); a
        block already stored or being stored is skipped. `held`: each block comes with a
        pool reference, kept for its copy and dropped otherwise; else the copies take one.
        Returns, in order, the pairs no slot could be had for (once one finds none, the
        later ones would not either), holding no reference."""
        items: list[tuple[KVCacheBlock, BlockMeta, SlotId]] = []
        no_slot: list[tuple[KVCacheBlock, BlockMeta]] = []
        room = self._store_room()
        for block, meta in pairs:
            # (Staging: the disk write itself skips blocks already on disk.)
            if meta.block_hash in self._storing or (
                    self.host_caches and self.host.contains(meta.block_hash)):
                continue
            slot = None if no_slot or len(items) >= room else self.host.allocate_slot(meta)
            if slot is None:  # not waited for
                no_slot.append((block, meta))
                continue
            items.append((block, meta, slot))
            self._storing.add(meta.block_hash)
        if held:  # in sequence order, as the pool frees a chain
            copied = {block.block_id for block, _, _ in items}
            self.pool.free([block for block, _ in pairs if block.block_id not in copied])
        elif items:
            self.pool.touch([block for block, _, _ in items])
        if items:
            mapping = torch.tensor([[b.block_id, slot] for b, _, slot in items],
                                   dtype=torch.int64)  # [n, 2] (gpu block, slot)
            job = SwapJob(Direction.GPU_TO_HOST, self.kv_cache, self.host.slab, mapping,
                          after=after)
            # (`job_id` is bound before the completion runs: that is in a later poll.)
            job_id = self._submit(job, lambda ok: self._finish_copy(job_id, items, ok))
            self._copying[job_id] = [block for block, _, _ in items]
        return no_slot

    def _store_room(self) -> int:
        """Slots write-throughs may take now, at most: the free and clean ones (some of
        those may be pinned) beyond the reserve kept for reads."""
        return self.host.num_free_slots + self.host.num_clean - self._read_reserve

    def copies_freeing(self, num_blocks: int) -> list[JobId]:
        """The oldest write-through copies in flight whose landing frees `num_blocks` GPU
        blocks (those no request holds besides the copy), or [] when all of them together
        free fewer."""
        job_ids: list[JobId] = []
        num_freed = 0
        for job_id, blocks in self._copying.items():
            if num_freed >= num_blocks:
                break
            job_ids.append(job_id)
            num_freed += sum(1 for block in blocks if block.ref_cnt == 1)
        return job_ids if num_freed >= num_blocks else []

    def _finish_copy(self, job_id: JobId, items: list[tuple[KVCacheBlock, BlockMeta, SlotId]],
                     ok: bool) -> None:
        del self._copying[job_id]
        self.pool.free([block for block, _, _ in items])
        self._storing.difference_update(meta.block_hash for _, meta, _ in items)
        slots = [slot for _, _, slot in items]
        self._counters[Tier.HOST].failures += 0 if ok else len(items)
        if ok and not self.host_caches:
            for chunk in chunks(slots, DISK_WRITE_BATCH):
                if self.remote_writes is not None:  # to the remote tier first, then to disk
                    self.remote_writes.write(chunk, lambda c=chunk: self._after_staged_remote(c))
                else:
                    self._write_to_disk(chunk, staged=True)
            return
        for slot in slots:  # a failed copy, or a block another copy cached first, is dropped
            if ok and self.host.commit(slot, dirty=self.disk is not None):
                self.host.unpin(slot)
                if self.remote_writes is not None:  # pinned until its batch is written
                    self.remote_writes.offer(slot)
            else:
                self.host.free_slot(slot)

    def _after_staged_remote(self, slots: list[SlotId]) -> None:
        if self.disk is not None:
            self._write_to_disk(slots, staged=True)
        else:
            for slot in slots:
                self.host.free_slot(slot)

    # ---- write-back ----------------------------------------------------------------------

    def schedule_writebacks(self, num_needed: int) -> None:
        """Start writing dirty host blocks to disk, least recently used first, so that
        `num_needed` slots plus a small reserve can be had without waiting."""
        if not self.host_caches or self.disk is None:
            return
        available = self.host.num_free_slots + self.host.num_clean + self._num_writing_back
        shortfall = num_needed + self._writeback_reserve - available
        if shortfall > 0:
            for chunk in chunks(self.host.writeback_candidates(shortfall), DISK_WRITE_BATCH):
                self._write_to_disk(chunk, staged=False)

    def _write_to_disk(self, slots: list[SlotId], staged: bool) -> None:
        """Write host slots to disk on the I/O pool. `staged`: RESERVED staging slots, freed
        afterwards; else CACHED dirty slots, pinned meanwhile and clean afterwards."""
        payloads = [self.host.slot_array(slot) for slot in slots]  # uint8 [bytes_per_block]
        job, stored = disk_write_job(self.disk, [self.host.meta(slot) for slot in slots],
                                     payloads, self.bytes_per_block)

        def finish(ok: bool) -> None:  # `stored` is empty when the job raised
            self._counters[Tier.DISK].rejected += stored.count(False)
            self._counters[Tier.DISK].failures += len(slots) - len(stored)
            for slot in slots:
                if staged:
                    self.host.free_slot(slot)
                    continue
                # Clean even when the write failed or was refused: the block is then lost
                # on eviction, but a broken or full disk must not wedge the host tier.
                self.host.unpin(slot)
                self.host.mark_clean(slot)
            self._num_writing_back -= 0 if staged else len(slots)

        if not staged:
            for slot in slots:
                self.host.pin(slot)
            self._num_writing_back += len(slots)
        self._submit(job, finish)
