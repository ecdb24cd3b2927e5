"""The way up for hit blocks: reads from the tiers below into host slots, and host -> GPU
copies.

  * `feed`: a load's blocks waiting for a host slot get one (in order, while slots can be
    had) and are read into it on the I/O threads by their tier's own read jobs, split over
    the threads or as one job per tier.
  * A read that landed commits its slots (a caching host keeps the blocks) and waits for
    `copy_landed_reads`, which the manager calls once per `poll`: one host -> GPU copy job
    for every read that landed since (a restore lands a read every few milliseconds, and a
    job each cost the engine thread a launch, its events and a plan per read).
  * `copy_to_gpu`: host slots to GPU blocks in one job, which waits only for the compute
    queued before the loads took their blocks (`Load.blocks_free`).
  * `prefetch`: blocks a request still waiting for GPU room will restore are read from a
    tier below into host slots ahead of it, and land as cached host blocks; its restore
    then copies them from the host. At most `PREFETCH_SHARE` of the host slots are in
    flight that way, so loads under way keep the slots they need.

`LoadPath` is driven by the `TierManager` from the engine thread; its jobs run on the
manager's `TransferEngine` through the `TierStack`'s `submit` (as `kvtier.stores` does for
the way down).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from kvtier.hashing import BlockHash
from kvtier.loads import Load, LoadBlock, LoadState
from kvtier.stats import Direction, Tier
from kvtier.tier_stack import TierStack
from kvtier.tiers.base import LowerTier
from kvtier.tiers.host import HostTier, SlotId
from kvtier.tiers.record import BlockBuffer, BlockMeta
from kvtier.transfer import IOJob, SwapJob, chunks, timed_job

#: Share of the host slots that prefetch reads may hold in flight at once.
PREFETCH_SHARE = 1 / 8


class LoadPath:
    """Reads into host slots and copies to the GPU for one manager's loads.

    tiers: the manager's tiers (its host slab must exist to load anything from below).
    io_threads: how many read jobs a split load's blocks of one tier are spread over.
    """

    def __init__(self, tiers: TierStack, io_threads: int) -> None:
        self.tiers = tiers
        self.io_threads = io_threads
        # Reads landed in host slots, waiting for their host -> GPU copy.
        self._landed_reads: list[tuple[Load, list[LoadBlock]]] = []
        #: Read jobs from the tiers below submitted and not finished (prefetches included).
        self.num_reads_in_flight = 0
        #: Blocks whose prefetch read is in flight.
        self.prefetching: set[BlockHash] = set()

    @property
    def host(self) -> HostTier:
        assert self.tiers.host is not None, "loads below the GPU need the host tier or its slab"
        return self.tiers.host

    def feed(self, load: Load) -> None:
        """Give host slots to the load's waiting hits below the host, in order, and start
        reading them (split over the I/O threads)."""
        ready: list[LoadBlock] = []
        while load.waiting:
            slot = self.host.allocate_slot(load.waiting[0].meta)
            if slot is None:  # SlotId 0 is falsy: compare with None
                break
            load.waiting[0].slot = slot
            ready.append(load.waiting.popleft())
        num_jobs = self.io_threads if load.split_reads else 1
        for tier in self.tiers.lower:
            sources = [lb for lb in ready if lb.source is tier]
            for chunk in chunks(sources, max(1, -(-len(sources) // num_jobs))):
                self._read(load, tier, chunk)

    def _read(self, load: Load, tier: LowerTier, items: list[LoadBlock]) -> None:
        dests = [self.host.slot_array(lb.slot) for lb in items]  # uint8 [bytes_per_block]
        metas = [lb.meta for lb in items]
        job, results = tier.read_job(metas, dests)
        keeper = self.tiers.lower.keeper_of(tier)
        if keeper is not None and not self.host.caches:
            # A caching host writes the copy back itself; a staging slab forgets the block
            # once copied, so the copy is made in the job.
            job = _also_into(job, results, keeper, metas, dests)
        self._start_read(tier, metas,
                         timed_job(_unless_cancelled(job, load.cancelled), load.read_spans),
                         lambda ok: self._finish_read(load, items, results, keeper is not None),
                         load)

    def _start_read(self, tier: LowerTier, metas: list[BlockMeta], job: IOJob,
                    on_done: Callable[[bool], None], *loads: Load) -> None:
        """Submit a read `job` of `metas` from `tier`, counted in `num_reads_in_flight`
        until `on_done` runs."""
        offers = self.tiers.offers_to(tier)
        if offers is not None:  # read from the store: no need to offer it back
            offers.remember([meta.block_hash for meta in metas])
        self.num_reads_in_flight += 1

        def done(ok: bool) -> None:
            self.num_reads_in_flight -= 1
            on_done(ok)

        self.tiers.submit(job, done, *loads)

    def _finish_read(self, load: Load, items: list[LoadBlock], results: list[bool],
                     keep_below: bool) -> None:
        """Reads landed in host slots (all from one tier): copy the good ones to the GPU.
        `keep_below`: the blocks also go to the write-back tier (committed dirty)."""
        landed = []
        cancelled = load.cancelled.is_set()
        # A job cancelled before it started read nothing (no result): no failure. One that
        # ran and missed a block (pruned meanwhile) failed that block, cancelled or not.
        ran = bool(results) or not cancelled
        for lb, ok in itertools.zip_longest(items, results, fillvalue=False):
            assert lb.slot is not None and lb.source is not None
            if ok:
                # A duplicate (or any block on a staging slab) stays reserved and is freed
                # after the copy. A block to keep in the write-back tier goes there dirty.
                self.host.commit(lb.slot, dirty=keep_below)
                landed.append(lb)
            else:
                self.host.free_slot(lb.slot)
                lb.slot, lb.state = None, LoadState.FAILED
                self.tiers.counters[lb.source.kind].failures += ran
        load.read_blocks += len(landed)
        if cancelled:  # the bytes stay in the host tier; the GPU blocks are the caller's now
            for lb in landed:
                assert lb.slot is not None
                self.host.release(lb.slot)
                lb.slot, lb.state = None, LoadState.FAILED
            return
        if landed:  # copied with the other reads that landed by the end of this poll
            self._landed_reads.append((load, landed))

    @property
    def prefetch_room(self) -> int:
        """Prefetch reads that may start now (`PREFETCH_SHARE` of the host slots, less
        those in flight)."""
        return max(0, max(1, int(self.host.num_slots * PREFETCH_SHARE)) - len(self.prefetching))

    def prefetch(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """Read into host slots, in order, the blocks of `metas` that the host lacks, that
        are not being read ahead already, and that a tier below with a local lookup holds:
        into free or clean slots only (never a dirty or pinned one), while `prefetch_room`
        lasts; they land as cached host blocks and no GPU block is held. Returns the blocks
        held below whose read could not start now."""
        wanted = [meta for meta in metas if not self.host.contains(meta.block_hash)
                  and meta.block_hash not in self.prefetching]
        later: list[BlockMeta] = []
        for tier in self.tiers.lower:
            if not wanted:
                break
            if not tier.lookup_is_local:
                continue
            held = tier.contains([meta.block_hash for meta in wanted])
            below = [meta for meta, hit in zip(wanted, held) if hit]
            later += below[self._prefetch_from(tier, below):]
            wanted = [meta for meta, hit in zip(wanted, held) if not hit]
        return later

    def _prefetch_from(self, tier: LowerTier, metas: Sequence[BlockMeta]) -> int:
        """Start reading `metas` (held by `tier`) into host slots while slots and
        `prefetch_room` last; returns how many reads started."""
        slots: list[tuple[BlockMeta, SlotId]] = []
        for meta in metas[:self.prefetch_room]:
            slot = self.host.allocate_slot(meta)
            if slot is None:
                break
            slots.append((meta, slot))
        per_job = max(1, -(-len(slots) // self.io_threads))
        for chunk in chunks(slots, per_job):
            self._prefetch_read(tier, chunk)
        return len(slots)

    def _prefetch_read(self, tier: LowerTier, items: list[tuple[BlockMeta, SlotId]]) -> None:
        metas = [meta for meta, _ in items]
        job, results = tier.read_job(metas, [self.host.slot_array(slot) for _, slot in items])
        keep_below = self.tiers.lower.keeper_of(tier) is not None
        self.prefetching.update(meta.block_hash for meta in metas)

        def landed(ok: bool) -> None:
            for (meta, slot), hit in itertools.zip_longest(items, results, fillvalue=False):
                self.prefetching.discard(meta.block_hash)
                # Cached (and no longer pinned) unless the read failed or another read
                # cached the block first.
                if hit and self.host.commit(slot, dirty=keep_below):
                    self.host.unpin(slot)
                    continue
                self.host.free_slot(slot)
                if results and not hit:  # the job ran and missed it (pruned meanwhile)
                    self.tiers.counters[tier.kind].failures += 1

        # After the reads restores wait on (`IOJob.ahead`).
        self._start_read(tier, metas, dataclasses.replace(job, ahead=True), landed)

    def copy_landed_reads(self) -> None:
        """One host -> GPU copy for every read from below that landed since the last call."""
        if not self._landed_reads:
            return
        reads, self._landed_reads = self._landed_reads, []
        self.copy_to_gpu([load for load, _ in reads],
                         [lb for _, items in reads for lb in items])

    def copy_to_gpu(self, loads: list[Load], items: list[LoadBlock]) -> None:
        """Copy `items` (of `loads`) from their host slots to their GPU blocks, one job."""
        mapping = torch.tensor([[lb.slot, lb.gpu_block.block_id] for lb in items],
                               dtype=torch.int64)  # [n, 2] (slot, gpu block)

        def finish(ok: bool) -> None:
            for lb in items:
                assert lb.slot is not None
                self.host.release(lb.slot)  # freed if it only staged the bytes
                lb.slot, lb.state = None, LoadState.ARRIVED if ok else LoadState.FAILED
            self.tiers.counters[Tier.HOST].failures += 0 if ok else len(items)

        kv_cache = self.tiers.kv_cache
        # The blocks were the loads' since their events: no later step of the model uses them.
        after = tuple(load.blocks_free for load in loads) if kv_cache.is_cuda else None
        job_id = self.tiers.submit(SwapJob(Direction.HOST_TO_GPU, self.host.slab, kv_cache,
                                           mapping, after), finish, *loads)
        for lb in items:
            lb.copy_job, lb.state = job_id, LoadState.COPYING


def _unless_cancelled(job: IOJob, cancelled: threading.Event) -> IOJob:
    """`job`, reading nothing (its results stay empty) when `cancelled` is set before it
    starts."""
    def run() -> int:
        return 0 if cancelled.is_set() else job.run()

    return dataclasses.replace(job, run=run)


def _also_into(job: IOJob, results: list[bool], keeper: LowerTier,
               metas: Sequence[BlockMeta], dests: Sequence[BlockBuffer]) -> IOJob:
    """`job`, then storing the blocks it read intact (`results`) in `keeper` too, before it
    finishes."""
    def run() -> int:
        num_bytes = job.run()
        hits = [i for i, ok in enumerate(results) if ok]
        if hits:
            keeper.put([metas[i] for i in hits], [dests[i] for i in hits])
        return num_bytes

    return dataclasses.replace(job, run=run)
