"""The way down for computed blocks: GPU -> host -> the tiers below.

  * Write-through: a newly cached full GPU block is copied to a host slot asynchronously,
    in two phases. `write_through` takes an extra pool reference on the block (its GPU
    memory stays as computed) and records where the compute stream stands; `submit_pending`
    later finds the slots and starts the copy, ordered after that point only. The engine
    submits while the GPU runs its next step, so that the host work of the stores (slots,
    evictions, the copy plan) is not spent between steps, when the GPU waits; under memory
    pressure the scheduler starts them sooner, when an allocation fails, before it preempts
    anyone. A block the write-back tier already holds is not copied (it would only be
    written back again). The slot is pinned during the copy and indexed once the bytes
    landed. With the host tier off, a small staging slab carries the bytes on to every
    tier below, then forgets them.
  * Deferred write-through: when no slot can be had now (every slot dirty, pinned or
    reserved), the block is not waited for. It keeps its pool reference while the GPU pool
    has room, and is copied once write-backs free a slot; when an allocation finds the pool
    short, deferred blocks give their references up (`release_deferred`: those a restore
    would compute first, the oldest first), so the GPU evicts what is stored below before
    them and is never held for the disk. A block the GPU reuses before its copy is counted
    skipped (`SkipReason.GPU_REUSED`), never dropped silently.
  * Placement: a block may come with a load rank, saying that a later restore will load it
    rather than compute it (the tail of a long prefix, past where the restore fronts are
    expected to meet) and how dear it is to compute. Such blocks take the host slots first,
    queued or deferred, the higher rank first (`kvtier.deferred_stores`): when blocks come
    faster than the disk takes them, the disk gets what restores will read, from the end of
    each prefix.
  * Write-back: dirty host blocks are written to the write-back tier (the disk) ahead of
    demand, least recently used first: as many as slots are needed, and while any are dirty
    at least `write_depth` batches in flight, so the disk writes at its own speed whenever
    there is a backlog. A slot is evicted only once its block is clean (its write
    committed).
  * Ledger: every block offered is accounted for on its way to the write-back tier
    (`kvtier.store_ledger`): written, a duplicate, skipped with a reason, or pending.
  * Every block once: a block that landed in the host is offered to each tier that takes
    every block (the shared remote store), and written in batches once per step.

Each tier's writes are the jobs it builds itself (`LowerTier.write_job`), counted under its
kind. `StorePath` is driven by the `TierManager` from the engine thread; its jobs run on the
manager's `TransferEngine` through the `TierStack`'s `submit`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from kvtier.config import DEFAULT_READ_RESERVE_SHARE
from kvtier.deferred_stores import DeferredStores, Store, order_key
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.stats import Direction, Tier, busy_seconds
from kvtier.store_ledger import SkipReason, StoreLedger, StoreLedgerStats
from kvtier.tier_stack import TierStack
from kvtier.tiers.base import LowerTier
from kvtier.tiers.host import HostTier, SlotId
from kvtier.tiers.record import BlockMeta
from kvtier.transfer import JobId, SwapJob, chunks, timed_job

#: A batched `submit_pending` starts the queued write-throughs once this many blocks wait,
#: or once they were offered `STORE_MAX_OFFERS` times (the engine offers once a step), or
#: when the GPU pool runs low. Each copy job costs host time whatever its size, enough to
#: slow the decode steps of a small model when every step started one for the block or two
#: it filled (docs/ARCHITECTURE.md).
STORE_BATCH_BLOCKS = 8
STORE_MAX_OFFERS = 8
#: Seconds the read reserve is kept whole after the last read from the tiers below:
#: restores come in bursts (a conversation's next turn, a batch of documents), and slots
#: handed to stores between two of them would be dirty when the next one reads. With no
#: read for this long (a run of fresh prompts), stores may take all but
#: `1 / IDLE_READ_RESERVE_DIVISOR` of it: the host tier is then nearly whole the disk's
#: write buffer, and the first reads of the next restore still start at once
#: (docs/BENCHMARKS.md, "What chose the defaults").
READ_RESERVE_HOLD_S = 2.0
IDLE_READ_RESERVE_DIVISOR = 8
#: Write-back batches kept in flight while dirty host blocks wait, unless the caller says
#: otherwise: LMDB runs one write transaction at a time, so two keep the next batch queued
#: while one commits.
DEFAULT_WRITE_DEPTH = 2


class StorePath:
    """Write-through, deferred write-through, write-back and every-block writes over one
    manager's tiers (`tiers.host` must exist: the host tier, or the staging slab in front of
    the tiers below)."""

    def __init__(self, tiers: TierStack, write_depth: int = DEFAULT_WRITE_DEPTH,
                 read_reserve_share: float = DEFAULT_READ_RESERVE_SHARE) -> None:
        assert tiers.host is not None, "stores need the host tier or its staging slab"
        self.tiers, self.pool, self.kv_cache = tiers, tiers.pool, tiers.kv_cache
        self.host: HostTier = tiers.host
        self.write_back = tiers.lower.write_back
        self._counters = tiers.counters
        self._storing: set[BlockHash] = set()  # write-through in flight
        # Write-through copies in flight, oldest first: job id -> the GPU blocks it holds.
        self._copying: dict[JobId, list[KVCacheBlock]] = {}
        # Write-throughs not submitted yet: (blocks held with a reference, with their metas
        # and hints; the compute stream's event after the step that computed them, None on
        # a CPU).
        self._pending: list[tuple[list[Store], torch.cuda.Event | None]] = []
        self._num_offers = 0  # batched offers the queued write-throughs were held back from
        # Write-throughs that found no host slot (see `_defer`), in placement order. Bounded
        # by the GPU's cached blocks: an entry leaves when the GPU reuses its block
        # (`drop_evicted`).
        self._deferred = DeferredStores()
        # Deferred blocks still holding a pool reference, by block id, oldest first: those
        # a restore would compute, and those it would load (released in that order; for one
        # prefix the oldest of the latter are its shallowest, the last to be written).
        self._held_head: dict[int, KVCacheBlock] = {}
        self._held_tail: dict[int, KVCacheBlock] = {}
        self._num_writing_back = 0
        self._write_depth = write_depth
        #: Where the offered blocks went (kept only with a write-back tier).
        self.ledger = StoreLedger()
        # Offered blocks committed dirty on the host (not yet written), and those carried by
        # the staging slab to the write-back tier: the ledger's pending ones.
        self._offered_dirty: set[BlockHash] = set()
        self._num_staged = 0
        # (start, end) on `time.monotonic` of the write jobs the write-back tier ran since
        # it was last idle (appended by the I/O threads), and the seconds it was busy
        # writing before that: spans are folded into the total whenever no write job is in
        # flight, so none still to come can overlap them, and the list stays bounded.
        self._write_spans: list[tuple[float, float]] = []
        self._write_busy_s = 0.0
        self._num_write_jobs = 0
        num_slots, caches = self.host.num_slots, self.host.caches
        self._writeback_reserve = max(1, num_slots // 8) if caches else 0
        #: Slots write-throughs leave to reads from the tiers below when the host tier runs
        #: out of evictable ones (writes outpacing the disk): without them, every slot a
        #: write-back cleaned went to the next store, and no disk read ever started.
        #: They are kept whole only while reads from below were wanted in the last
        #: `READ_RESERVE_HOLD_S` (`progress`, `read_reserve`).
        self._read_reserve = int(num_slots * read_reserve_share) \
            if caches and self.write_back is not None else 0
        self._idle_read_reserve = max(1, self._read_reserve // IDLE_READ_RESERVE_DIVISOR) \
            if self._read_reserve else 0
        self._last_read_at = -math.inf  # time.monotonic() of the last wanted read

    def write_through(self, blocks: Sequence[KVCacheBlock], metas: Sequence[BlockMeta],
                      load_ranks: Sequence[int | None] | None = None) -> None:
        """Queue newly cached GPU blocks (`metas[i]` names `blocks[i]`) for copying to host
        slots: each is held with a pool reference until `submit_pending` copies or drops it,
        and the copy will follow the work queued on the current stream now (the step that
        computed the blocks), not the steps launched meanwhile. `load_ranks[i]`: None when
        a later restore is expected to compute block i (the default), else how dear it is
        to compute: ranked blocks take host slots before the others, the higher rank first
        (`kvtier.deferred_stores`)."""
        if not blocks:
            return
        self.pool.touch(blocks)
        computed = None
        if self.kv_cache.is_cuda:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.kv_cache.device))
        hints = [None] * len(blocks) if load_ranks is None else list(load_ranks)
        assert len(hints) == len(blocks), "one load rank per block"
        if self.write_back is not None:
            self.ledger.offered += len(blocks)
        self._pending.append((list(zip(blocks, metas, hints)), computed))

    @property
    def num_pending(self) -> int:
        """Blocks queued by `write_through` and not submitted yet."""
        return sum(len(stores) for stores, _ in self._pending)

    @property
    def num_deferred(self) -> int:
        """Write-throughs waiting for a host slot (their blocks still cached on the GPU)."""
        return len(self._deferred)

    def backlog(self) -> int:
        """Offered blocks not yet in the write-back tier nor accounted otherwise: queued,
        deferred, being copied, dirty on the host or being written (0 without a write-back
        tier)."""
        if self.write_back is None:
            return 0
        copying = sum(len(blocks) for blocks in self._copying.values())
        dirty = sum(1 for block_hash in self._offered_dirty
                    if (slot := self.host.slot_of(block_hash)) is not None
                    and self.host.is_dirty(slot))
        return self.num_pending + self.num_deferred + copying + dirty + self._num_staged

    def ledger_stats(self) -> StoreLedgerStats:
        """Where the offered blocks went (see `kvtier.store_ledger`)."""
        return self.ledger.snapshot(self.backlog(),
                                    self._write_busy_s + busy_seconds(self._write_spans))

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
        stores = self._not_stored_below([store for entry, _ in pending for store in entry])
        self.schedule_writebacks(len(stores) + self.num_deferred)
        # The copy follows every step that computed its blocks.
        after = tuple(dict.fromkeys(event for _, event in pending if event is not None))
        no_slot = {store[0].block_id for store in self._copy_to_host(stores, held=True,
                                                                    after=after or None)}
        # Deferred in the order they were offered (a prompt's, from its head on), so that a
        # short pool takes back the shallowest of a tail first, the last it would write.
        for store in stores:
            if store[0].block_id in no_slot:
                self._defer(store)  # keeping its reference

    def _not_stored_below(self, stores: list[Store]) -> list[Store]:
        """`stores` less the blocks the write-back tier holds already (a prompt computed
        though its blocks were stored, because reading them would not have been faster):
        copying those to the host would only make them dirty there, to be written back as
        duplicates, with a copy of their bytes and host slots spent on the way. Their pool
        references are dropped; the ledger counts them written. Kept when a tier takes
        every block (the remote store may not hold them) or the tier cannot answer now."""
        if self.write_back is None or self.tiers.offers or not self.host.caches or not stores:
            return stores
        held = self.write_back.contains([meta.block_hash for _, meta, _ in stores])
        if not any(held):
            return stores
        self.ledger.written += sum(held)
        self.pool.free([store[0] for store, stored in zip(stores, held) if stored])
        return [store for store, stored in zip(stores, held) if not stored]

    def _batch_due(self) -> bool:
        low = max(STORE_BATCH_BLOCKS, self.pool.num_blocks // 16)
        return (self.num_pending >= STORE_BATCH_BLOCKS or self._num_offers + 1 >= STORE_MAX_OFFERS
                or self.pool.num_free_blocks <= low)

    def progress(self, num_slots_wanted: int, reading: bool = False) -> None:
        """Once per engine step, after finished jobs ran: retry deferred write-throughs and
        start the write-backs that `num_slots_wanted` more slots (for loads) and the
        deferred ones need. `reading`: reads from the tiers below are in flight (they, or
        loads wanting slots, keep the read reserve for `READ_RESERVE_HOLD_S`)."""
        if reading or num_slots_wanted:
            self._last_read_at = time.monotonic()
        if self.num_deferred:
            self._retry_deferred()
        self.schedule_writebacks(num_slots_wanted + self.num_deferred)

    def drop_evicted(self, events: Sequence[tuple[BlockHash, int]]) -> None:
        """The GPU pool reused these (hash, block id) blocks: deferred write-throughs of
        them can no longer be copied, and are counted skipped (`SkipReason.GPU_REUSED`)."""
        for block_hash, block_id in events:
            store = self._deferred.get(block_hash)
            if store is not None and store[0].block_id == block_id:
                self._deferred.remove(block_hash)
                self._skip(SkipReason.GPU_REUSED)

    def release_deferred(self, num_blocks: int, freeing_only: bool = True) -> int:
        """Drop the pool references of up to `num_blocks` deferred write-throughs (the GPU
        pool is short): those a restore would compute first, each kind oldest first. They
        stay deferred and enter the free queue as its most recent blocks, so the GPU evicts
        every other cached block before them. With `freeing_only`, only blocks the deferral
        alone holds are released: one a request also holds (a prefix hit) would not come
        free, and releasing it instead of another left allocations short. Returns how many
        were released."""
        released: list[KVCacheBlock] = []
        for held in (self._held_head, self._held_tail):
            picked = []
            for block_id, block in held.items():
                if len(released) + len(picked) >= num_blocks:
                    break
                if block.ref_cnt == 1 or not freeing_only:
                    picked.append(block_id)
            released += [held.pop(block_id) for block_id in picked]
        self.pool.free(released)
        return len(released)

    @property
    def num_held(self) -> int:
        """Deferred write-throughs that still hold their GPU block."""
        return len(self._held_head) + len(self._held_tail)

    def abandon_backlog(self) -> int:
        """Give up what is still deferred or dirty and not being written (closing ran out of
        time): counted skipped (`SkipReason.FLUSH_TIMEOUT`), dirty slots marked clean. The
        writes under way end as they end. Returns how many blocks were given up."""
        self.release_deferred(self.num_held, freeing_only=False)
        num = self.num_deferred
        self._deferred.clear()
        for slot in self.host.dirty_slots():
            if self.host.num_pins(slot):  # being written (or read): its write is counted
                continue
            block_hash = self.host.meta(slot).block_hash
            if block_hash in self._offered_dirty:
                self._offered_dirty.discard(block_hash)
                num += 1
            self.host.mark_clean(slot)
        if self.write_back is not None:
            self.ledger.skip(SkipReason.FLUSH_TIMEOUT, num)
        return num

    def _skip(self, reason: SkipReason, num_blocks: int = 1) -> None:
        if self.write_back is not None:
            self.ledger.skip(reason, num_blocks)

    def write_back_all(self) -> bool:
        """Start writing every dirty, unpinned host block back; False when there is none
        (or no write-back tier). The caller waits for the jobs (a deferred store may follow
        them)."""
        if self.write_back is None:
            return False
        dirty = [s for s in self.host.dirty_slots() if self.host.num_pins(s) == 0]
        for chunk in chunks(dirty, self.write_back.write_batch):
            self._write_back(chunk)
        return bool(dirty)

    def send_offers(self) -> None:
        """Write the blocks offered to the tiers that take every block since the last call,
        in batches; each slot is unpinned once its batch is done, whatever the outcome (a
        refused or lost block is counted and dropped, never retried)."""
        for offers in self.tiers.offers:
            for chunk in offers.take():
                self._write(offers.tier, chunk, lambda c=chunk: [self.host.unpin(s) for s in c])

    # ---- write-through -------------------------------------------------------------------

    def _defer(self, store: Store) -> None:
        """No host slot for this write-through now: count it under the host's rejections,
        and retry it when write-backs free slots, holding its pool reference until the pool
        runs short (`release_deferred`; then `drop_evicted` counts it skipped once the GPU
        reuses its block)."""
        self._counters[Tier.HOST].rejected += 1
        self._deferred.push(store)
        held = self._held_head if store[2] is None else self._held_tail
        held[store[0].block_id] = store[0]

    def _retry_deferred(self) -> None:
        """Write through the deferred blocks the GPU still caches, in placement order
        (`kvtier.deferred_stores`), while host slots can be had without waiting. Costs
        O((slots to be had + stale entries dropped) log entries), not O(entries)."""
        num_room = self._store_room()  # at most: some clean slots are pinned
        stores: list[Store] = []
        orders: dict[int, int] = {}  # block id -> its place among the deferred
        while len(stores) < num_room and (entry := self._deferred.pop()) is not None:
            store, order = entry
            if self.pool.get_cached_block(store[1].block_hash) is store[0]:
                stores.append(store)
                orders[store[0].block_id] = order
            else:  # reused by the GPU (its eviction was not reported to us)
                self._skip(SkipReason.GPU_REUSED)
        no_slot = self._copy_to_host(stores, held=False)
        waiting = {store[0].block_id for store in no_slot}
        # The copies took references of their own; the deferred ones are dropped.
        done = [s[0] for s in stores if s[0].block_id not in waiting
                and (self._held_head.pop(s[0].block_id, None) is not None
                     or self._held_tail.pop(s[0].block_id, None) is not None)]
        self.pool.free(done)
        for store in no_slot:  # back in the places they had
            self._deferred.push(store, orders[store[0].block_id])

    def _copy_to_host(self, stores: Sequence[Store], held: bool,
                      after: tuple[torch.cuda.Event, ...] | None = None) -> list[Store]:
        """Copy cached GPU blocks to host slots, all in one job (`after`: as `SwapJob`'s),
        in placement order (`kvtier.deferred_stores`); a block already stored or being stored
        is a duplicate. `held`: each block comes with a pool reference, kept for its copy or
        its deferral and dropped for a duplicate; else the copies take one. Returns, in
        order, the stores no slot could be had for (once one finds none, the later ones
        would not either), still holding their reference when `held`."""
        items: list[tuple[KVCacheBlock, BlockMeta, SlotId]] = []
        no_slot: list[Store] = []
        room = self._store_room()
        for store in sorted(stores, key=lambda s: order_key(s[2])):  # stable
            block, meta, _ = store
            # (A staging slab caches nothing: the tiers' writes skip blocks they hold.)
            if (meta.block_hash in self._storing or meta.block_hash in self._deferred
                    or self.host.contains(meta.block_hash)):
                if self.write_back is not None:
                    self.ledger.duplicate += 1
                continue
            slot = None if no_slot or len(items) >= room else self.host.allocate_slot(meta)
            if slot is None:  # not waited for
                no_slot.append(store)
                continue
            items.append((block, meta, slot))
            self._storing.add(meta.block_hash)
        if held:  # in sequence order, as the pool frees a chain
            kept = {block.block_id for block, _, _ in items}
            kept.update(block.block_id for block, _, _ in no_slot)
            self.pool.free([block for block, _, _ in stores if block.block_id not in kept])
        elif items:
            self.pool.touch([block for block, _, _ in items])
        if items:
            mapping = torch.tensor([[b.block_id, slot] for b, _, slot in items],
                                   dtype=torch.int64)  # [n, 2] (gpu block, slot)
            job = SwapJob(Direction.GPU_TO_HOST, self.kv_cache, self.host.slab, mapping,
                          after=after)
            # (`job_id` is bound before the completion runs: that is in a later poll.)
            job_id = self.tiers.submit(job, lambda ok: self._finish_copy(job_id, items, ok))
            self._copying[job_id] = [block for block, _, _ in items]
        return no_slot

    def _store_room(self) -> int:
        """Slots write-throughs may take now, at most: the free and clean ones (some of
        those may be pinned) beyond the reserve kept for reads, while it is kept."""
        return self.host.num_free_slots + self.host.num_clean - self.read_reserve

    @property
    def read_reserve(self) -> int:
        """Host slots write-throughs leave to reads now: the configured share while reads
        from below were wanted in the last `READ_RESERVE_HOLD_S`, else
        `1 / IDLE_READ_RESERVE_DIVISOR` of it (at least one slot)."""
        recent = time.monotonic() - self._last_read_at < READ_RESERVE_HOLD_S
        return self._read_reserve if recent else self._idle_read_reserve

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
        if not ok:
            self._skip(SkipReason.FAILED, len(items))
        staged = []
        for slot in slots:  # a failed copy, or a block another copy cached first, is dropped
            if ok and self.host.commit(slot, dirty=self.write_back is not None):
                if self.write_back is not None:
                    self._offered_dirty.add(self.host.meta(slot).block_hash)
                self.host.unpin(slot)
                for offers in self.tiers.offers:  # pinned until its batch is written
                    if offers.is_new(self.host.meta(slot).block_hash):
                        self.host.pin(slot)
                        offers.pending.append(slot)
            elif ok and not self.host.caches:
                staged.append(slot)
            else:
                if ok and self.write_back is not None:  # another copy cached it first
                    self.ledger.duplicate += 1
                self.host.free_slot(slot)
        if self.write_back is not None:
            self._num_staged += len(staged)
        # A staging slab carries its blocks down at once, then forgets them.
        below = self.tiers.lower.staging_order()
        for chunk in chunks(staged, below[0].write_batch if below else 1):
            self._write_staged(chunk, below)

    def _write_staged(self, slots: list[SlotId], tiers: list[LowerTier]) -> None:
        """Write RESERVED staging slots to each of `tiers` in turn, then free them."""
        if not tiers:
            for slot in slots:
                self.host.free_slot(slot)
            return
        offers = self.tiers.offers_to(tiers[0])
        if offers is not None:
            offers.remember([self.host.meta(slot).block_hash for slot in slots])
        offered = tiers[0] is self.write_back

        def then() -> None:
            if offered:  # the write accounted for them in the ledger
                self._num_staged -= len(slots)
            self._write_staged(slots, tiers[1:])

        self._write(tiers[0], slots, then, offered)

    # ---- write-back ----------------------------------------------------------------------

    def schedule_writebacks(self, num_needed: int) -> None:
        """Start writing dirty host blocks back, least recently used first, so that
        `num_needed` slots plus a small reserve can be had without waiting, and so that
        `write_depth` batches are in flight while any dirty block waits (the disk writes at
        its speed whenever there is a backlog)."""
        if self.write_back is None or not self.host.num_dirty:
            return
        available = self.host.num_free_slots + self.host.num_clean + self._num_writing_back
        shortfall = num_needed + self._writeback_reserve - available
        depth = self._write_depth * self.write_back.write_batch - self._num_writing_back
        wanted = max(shortfall, depth)
        if wanted > 0:
            for chunk in chunks(self.host.writeback_candidates(wanted),
                                self.write_back.write_batch):
                self._write_back(chunk)

    def _write_back(self, slots: list[SlotId]) -> None:
        """Write CACHED dirty slots to the write-back tier; pinned meanwhile, clean after."""
        assert self.write_back is not None
        for slot in slots:
            self.host.pin(slot)
        self._num_writing_back += len(slots)

        offered = [self.host.meta(slot).block_hash in self._offered_dirty for slot in slots]

        def finish() -> None:
            for slot in slots:
                # Clean even when the write failed or was refused: the block is then lost
                # on eviction (counted skipped), but a broken or full disk must not wedge
                # the host tier.
                self._offered_dirty.discard(self.host.meta(slot).block_hash)
                self.host.unpin(slot)
                self.host.mark_clean(slot)
            self._num_writing_back -= len(slots)

        self._write(self.write_back, slots, finish, offered)

    def _write(self, tier: LowerTier, slots: list[SlotId], then: Callable[[], object],
               offered: bool | list[bool] = False) -> None:
        """Write host slots (pinned or reserved by the caller) to `tier` on the I/O pool with
        the job the tier builds; count what it refused or lost, then run `then()`.
        `offered` (per slot, or for all): the slot carries a block the ledger follows."""
        payloads = [self.host.slot_array(slot) for slot in slots]  # uint8 [bytes_per_block]
        job, stored = tier.write_job([self.host.meta(slot) for slot in slots], payloads)
        timed = tier is self.write_back
        if timed:
            job = timed_job(job, self._write_spans)
            self._num_write_jobs += 1
        counters = self._counters[tier.kind]
        followed = [offered] * len(slots) if isinstance(offered, bool) else offered

        def finish(ok: bool) -> None:  # `stored` is empty when the job raised
            counters.rejected += stored.count(False)
            counters.failures += len(slots) - len(stored)
            for index, follow in enumerate(followed):
                if not follow:
                    continue
                if index >= len(stored):
                    self.ledger.skip(SkipReason.FAILED)
                elif stored[index]:
                    self.ledger.written += 1
                else:
                    self.ledger.skip(SkipReason.REFUSED)
            if timed:
                self._num_write_jobs -= 1
                if self._num_write_jobs == 0:  # idle: no span still to come overlaps these
                    spans, self._write_spans[:] = list(self._write_spans), []
                    self._write_busy_s += busy_seconds(spans)
            then()

        self.tiers.submit(job, finish)

