"""The way up for hit blocks: disk and remote reads into host slots, and host -> GPU copies.

  * `feed`: a load's blocks waiting for a host slot get one (in order, while slots can be
    had) and are read into it on the I/O threads, split over them or as one job.
  * A read that landed commits its slots (the host tier caches the blocks) and waits for
    `copy_landed_reads`, which the manager calls once per `poll`: one host -> GPU copy job
    for every read that landed since (a restore lands a read every few milliseconds, and a
    job each cost the engine thread a launch, its events and a plan per read).
  * `copy_to_gpu`: host slots to GPU blocks in one job, which waits only for the compute
    queued before the loads took their blocks (`Load.blocks_free`).

`LoadPath` is driven by the `TierManager` from the engine thread; its jobs run on the
manager's `TransferEngine` through the `submit` callable it is given (as `kvtier.stores`
does for the way down).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvtier.config import TierConfig
from kvtier.layout import KVLayout
from kvtier.loads import Load, LoadBlock
from kvtier.remote_io import RemoteWrites, remote_read_job
from kvtier.stats import Direction, Tier, TierCounters
from kvtier.stores import chunks
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.transfer import JobId, SwapJob, disk_read_job, timed_job

if TYPE_CHECKING:
    from kvtier.tiers.remote import RemoteTier

Submit = Callable[..., JobId]


class LoadPath:
    """Reads into host slots and copies to the GPU for one manager's loads.

    kv_cache: [num_gpu_blocks, *layout.block_shape]. host: the host tier, or (`host_caches`
    False) the staging slab in front of the disk and remote tiers. disk, remote,
    remote_writes: the tiers below, None when off. submit(job, on_done, *loads): runs a job
    for `loads`. counters: the manager's per-tier counters.
    """

    def __init__(self, kv_cache: torch.Tensor, host: HostTier | None, host_caches: bool,
                 disk: DiskTier | None, remote: RemoteTier | None,
                 remote_writes: RemoteWrites | None, config: TierConfig, layout: KVLayout,
                 submit: Submit, counters: dict[Tier, TierCounters]) -> None:
        self.kv_cache, self._host, self.host_caches = kv_cache, host, host_caches
        self.disk, self.remote, self._remote_writes = disk, remote, remote_writes
        self.io_threads = config.io_threads
        self.bytes_per_block = layout.bytes_per_block
        #: Remote hits are kept on the local disk too (through the host tier's write-back).
        self.remote_keeps_on_disk = (disk is not None and config.remote is not None
                                     and config.remote.write_to_disk)
        self._submit = submit
        self._counters = counters
        # Reads landed in host slots, waiting for their host -> GPU copy.
        self._landed_reads: list[tuple[Load, list[LoadBlock]]] = []

    @property
    def host(self) -> HostTier:
        assert self._host is not None, "loads below the GPU need the host tier or its slab"
        return self._host

    def feed(self, load: Load) -> None:
        """Give host slots to the load's waiting disk hits, in order, and start reading them
        (split over the I/O threads)."""
        ready: list[LoadBlock] = []
        while load.waiting:
            slot = self.host.allocate_slot(load.waiting[0].meta)
            if slot is None:  # SlotId 0 is falsy: compare with None
                break
            load.waiting[0].slot = slot
            ready.append(load.waiting.popleft())
        num_jobs = self.io_threads if load.split_reads else 1
        for from_remote in (False, True):
            sources = [lb for lb in ready if lb.from_remote is from_remote]
            for chunk in chunks(sources, max(1, -(-len(sources) // num_jobs))):
                dests = [self.host.slot_array(lb.slot) for lb in chunk]  # uint8 [block bytes]
                metas = [lb.meta for lb in chunk]
                if from_remote:
                    # Without host caching, a copy for the local disk is made in the job.
                    keep = self.disk if self.remote_keeps_on_disk and not self.host_caches \
                        else None
                    job, results = remote_read_job(self.remote, metas, dests,
                                                   self.bytes_per_block, keep)
                    self._remote_writes.offers.remember([meta.block_hash for meta in metas])
                else:
                    job, results = disk_read_job(self.disk, metas, dests,
                                                 self.bytes_per_block, load.cancelled)
                self._submit(timed_job(job, load.read_spans), lambda ok, c=chunk, r=results:
                             self._finish_read(load, c, r), load)

    def _finish_read(self, load: Load, items: list[LoadBlock],
                     results: list[bool]) -> None:
        """Disk or remote reads landed in host slots: copy the good ones to the GPU."""
        landed = []
        cancelled = load.cancelled.is_set()
        # A job cancelled before it started read nothing (no result): no failure. One that
        # ran and missed a block (pruned meanwhile) failed that block, cancelled or not.
        ran = bool(results) or not cancelled
        for lb, ok in itertools.zip_longest(items, results, fillvalue=False):
            assert lb.slot is not None
            if ok:
                if self.host_caches:  # a duplicate stays reserved and is freed after the copy
                    # A remote block kept on disk goes there by the host tier's write-back.
                    self.host.commit(lb.slot, dirty=lb.from_remote
                                      and self.remote_keeps_on_disk)
                landed.append(lb)
            else:
                self.host.free_slot(lb.slot)
                lb.slot, lb.done = None, True
                self._counters[Tier.REMOTE if lb.from_remote else Tier.DISK].failures += ran
        load.read_blocks += len(landed)
        if cancelled:  # the bytes stay in the host tier; the GPU blocks are the caller's now
            for lb in landed:
                assert lb.slot is not None
                self.host.release(lb.slot)
                lb.slot, lb.done = None, True
            return
        if landed:  # copied with the other reads that landed by the end of this poll
            self._landed_reads.append((load, landed))

    def copy_landed_reads(self) -> None:
        """One host -> GPU copy for every disk or remote read that landed since the last
        call: a restore lands a read every few milliseconds, and one copy job each would
        cost the engine thread a launch, its events and a plan per read."""
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
                lb.slot, lb.done, lb.ok = None, True, ok
            self._counters[Tier.HOST].failures += 0 if ok else len(items)

        # The blocks were the loads' since their events: no later step of the model uses them.
        after = tuple(load.blocks_free for load in loads) if self.kv_cache.is_cuda else None
        job_id = self._submit(SwapJob(Direction.HOST_TO_GPU, self.host.slab, self.kv_cache,
                                      mapping, after), finish, *loads)
        for lb in items:
            lb.copy_job = job_id
