"""The tier manager: who holds which block hash, and the moves between GPU, host and the
tiers below. It owns the GPU cache, its `BlockPool`, the `HostTier`, the tiers below the host
(`kvtier.tiers.base.LowerTier`: disk, remote, ...) and the `TransferEngine`, and is driven from
one engine thread. Its lookup, load and store paths all work on one `TierStack`.

  * Lookups (`kvtier.prefix_lookup`): the GPU pool, the host, then each lower tier in turn.
  * Stores (`kvtier.stores`): newly cached full blocks are written through to host slots
    asynchronously (queued by `cache_full_blocks`, started by `submit_stores` while the GPU
    computes; deferred, never waited for, when no slot can be had then), dirty host blocks
    written back to the write-back tier (the disk) ahead of demand, and every block offered
    once to the tiers that take every block (the shared remote store).
  * Loads (`kvtier.load_path`): host hits are pinned and copied to the GPU; hits below are
    read into host slots by their tier's jobs (in waves when slots are short), then copied.
    `poll` advances the chains. A load whose copies are all queued on the GPU can complete
    at once: the compute stream then waits for them, so the request runs while its bytes
    are still crossing the bus.

Fail closed: a failed transfer or an invalid record makes its block a miss (a wrong KV block
is never served); pins and slots are released and the failure is counted.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.block_pool import BlockPool
from kvtier.config import TierConfig
from kvtier.device_cache import allocate_kv_cache
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.load_path import LoadPath
from kvtier.loads import Load, LoadBlock, LoadId, LoadState, PrefixHit
from kvtier.open_tiers import open_tiers
from kvtier.prefix_lookup import find_prefix
from kvtier.stats import ManagerStats, Tier, new_tier_counters
from kvtier.stores import StorePath
from kvtier.tier_stack import LowerTiers, TierStack
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.disk.shards import ShardedDiskTier
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.disk.worker_tier import DiskWorkerTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.record import BlockMeta
from kvtier.transfer import IOJob, JobId, SwapJob, TransferEngine
from kvtier.write_once import WriteOnce

#: Host hits per GPU copy job of a load: the first copies run while later blocks of a long
#: prefix are still being looked up and pinned.
_LOAD_COPY_CHUNK = 256

#: progress(blocks written so far, blocks still to write), called while a flush runs.
FlushProgress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a `TierManager.flush` did: blocks it saw written to the write-back tier, those it
    gave up when its time ran out (counted skipped, `SkipReason.FLUSH_TIMEOUT`), and its
    seconds."""

    num_written: int
    num_unwritten: int
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.num_unwritten > 0


class TierManager:
    """GPU block pool plus the host tier and the tiers below it, for one KV layout (see the
    module docstring).

    `kv_cache: [num_gpu_blocks, *layout.block_shape]` lives on `device`; on a CPU device the
    "GPU" is a CPU tensor and copies run synchronously. Not thread-safe. Raises ValueError
    for a config that does not fit the layout or the machine, and the lower tiers' errors.
    `disk_read_hook` is passed to the disk tier (`DiskTier` read_hook: tests slow its reads).
    """

    def __init__(self, layout: KVLayout, config: TierConfig,
                 device: torch.device | str = "cpu",
                 disk_read_hook: Callable[[BlockMeta], None] | None = None) -> None:
        self.layout, self.config, self.device = layout, config, torch.device(device)
        # [num_gpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = allocate_kv_cache(layout, config.num_gpu_blocks, self.device)
        self.pool = BlockPool(config.num_gpu_blocks)
        opened = open_tiers(config, layout, self.device, disk_read_hook)
        #: The host tier, or the staging slab the lower tiers' bytes pass through when it
        #: is off; None when nothing sits below the GPU.
        self.host: HostTier | None = opened.host
        #: The tiers below the host, fastest first; their stats are readable from any thread.
        self.lower_tiers = LowerTiers(opened.lower)
        self.disk_recovery = opened.disk_recovery
        self.transfers = TransferEngine(self.kv_cache.device, config.swap_method, config.io_threads,
                                        config.max_pending_io)
        self._on_done: dict[JobId, tuple[tuple[Load, ...], Callable[[bool], None]]] = {}
        # Finished jobs whose completion has not run yet (one before them raised).
        self._unhandled: list[tuple[JobId, bool]] = []
        #: Transfer jobs whose completion `poll` has run, since construction.
        self.num_jobs_completed = 0
        self._loads: dict[LoadId, Load] = {}
        self._load_ids = itertools.count()
        self._counters = new_tier_counters()  # per `Tier` kind, in blocks
        #: What the lookup, load and store paths work on.
        self.tiers = TierStack(self.pool, self.kv_cache, self.host, self.lower_tiers,
                               self._counters, self._submit,
                               [WriteOnce(tier) for tier in self.lower_tiers
                                if tier.write_policy is WritePolicy.EVERY_BLOCK])
        #: The way up: reads from below into host slots, host -> GPU copies.
        self.load_path = LoadPath(self.tiers, config.io_threads)
        #: The way down (None: no tier below the GPU).
        self.stores = (StorePath(self.tiers, config.write_depth, config.read_reserve_share)
                       if self.host is not None else None)
        self._closed = False

    @property
    def uses_disk_worker(self) -> bool:
        """Whether the disk tier runs in a worker process (`TierConfig.disk_worker`; False
        where the worker could not start and the tier runs in this process)."""
        return isinstance(self.lower_tiers.named("disk"), DiskWorkerTier)

    @property
    def disk(self) -> DiskTier | ShardedDiskTier | DiskWorkerTier | None:
        """The disk tier (one LMDB environment, or several; in this process or a worker),
        or None when it is off."""
        disk = self.lower_tiers.named("disk")
        assert disk is None or isinstance(disk, (DiskTier, ShardedDiskTier, DiskWorkerTier))
        return disk

    @property
    def remote(self) -> LowerTier | None:
        """The remote tier, or None when it is off."""
        return self.lower_tiers.named("remote")

    # ---- lookups and GPU blocks ----------------------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash],
               read_slow: Callable[[int], bool] | None = None,
               gaps: bool = False) -> PrefixHit:
        """The longest prefix of `block_hashes` held by some tier, each block from the
        fastest tier holding it. Takes no references and pins nothing (call `touch` on GPU
        hits, `prepare_load` for the rest); counts hits and misses per tier.

        `read_slow(i)`, asked once at the first block `i` that neither the GPU nor the host
        tier holds, says whether to look in the tiers below the host (False: the prefix
        ends there, and those tiers are not asked at all). `gaps`: go on past blocks no
        tier holds (their location None), up to the last block some tier holds: a stored
        tail is then usable behind a head the caller computes (a block's hash names its
        whole prefix, so a hit after a gap is still the right block)."""
        return find_prefix(block_hashes, self.tiers, read_slow, gaps)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """`num_blocks` GPU blocks with ref_cnt 1, or None when too few are free (write-
        throughs still waiting for a host slot first give up the blocks they hold, see
        `StorePath.release_deferred`). Raises ValueError for a negative count."""
        short = num_blocks - self.pool.num_free_blocks
        if short > 0 and self.stores is not None:  # deferred stores give their blocks up
            self.stores.release_deferred(short)
        blocks = self.pool.allocate(num_blocks)
        events = self.pool.take_events()
        if self.stores is not None and events:  # those not stored below are counted
            self.stores.drop_evicted([(e.block_hash, e.block_id) for e in events])
        return blocks

    def any_on_host(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether the host tier caches any of `hashes` now (False without host caching);
        stops at the first it finds."""
        host = self.tiers.caching_host
        return host is not None and any(map(host.contains, hashes))

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """One more reference on each block (e.g. GPU prefix hits a request will use)."""
        self.pool.touch(blocks)

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference on each block, in sequence order (see `BlockPool.free`)."""
        self.pool.free(blocks)

    # ---- loads ---------------------------------------------------------------------------

    def prepare_load(self, metas: Sequence[BlockMeta],
                     gpu_blocks: Sequence[KVCacheBlock], split_reads: bool = True,
                     known_on_disk: bool = False) -> LoadId:
        """Start loading the blocks `metas` names into `gpu_blocks` (allocated by the caller,
        held, not cached) from the host, else from the fastest tier below holding them (a
        tier whose lookup is a round trip is not asked again: a block it lost meanwhile
        fails its read). From the first block no tier holds onwards, all are misses at once.
        `split_reads` spreads the reads over the I/O threads; without it they go as one job
        per tier (a small load among many in flight, which `cancel_load` can then stop as a
        whole). `known_on_disk`: a lookup just found the blocks that are not on the host in
        a local disk tier; they are not looked up again (a block gone meanwhile is a failed
        read, and computed).

        The manager holds a reference on every block until `complete_load`, which must be
        called once per load (also when its request went away). Raises ValueError unless
        the blocks are distinct, one per meta, held and not cached.
        """
        if len(metas) != len(gpu_blocks) or len({b.block_id for b in gpu_blocks}) != len(metas):
            raise ValueError(f"{len(metas)} metas but {len(gpu_blocks)} GPU blocks; give one "
                             "distinct block per meta")
        for block in gpu_blocks:
            if block.ref_cnt == 0 or block.block_hash is not None:
                raise ValueError(f"{block}: load targets must be allocated by the caller "
                                 "and not cached")
        load = Load([LoadBlock(meta, block) for meta, block in zip(metas, gpu_blocks)],
                    split_reads=split_reads)
        if self.kv_cache.is_cuda:
            load.blocks_free = torch.cuda.Event()
            load.blocks_free.record(torch.cuda.current_stream(self.kv_cache.device))
        load_id = LoadId(next(self._load_ids))
        self._loads[load_id] = load
        self.pool.touch(gpu_blocks)
        from_host: list[LoadBlock] = []
        # Per lower tier, once asked: per block, whether it holds it.
        below: list[list[bool] | None] = [None] * len(self.lower_tiers)
        host = self.tiers.caching_host
        for i, lb in enumerate(load.blocks):
            lb.slot = host.lookup(lb.meta.block_hash) if host is not None else None
            if lb.slot is not None:
                host.pin(lb.slot)
                from_host.append(lb)
                if len(from_host) == _LOAD_COPY_CHUNK:
                    self.load_path.copy_to_gpu([load], from_host)
                    from_host = []
                continue
            lb.source = self._source(load.blocks, i, below, known_on_disk)
            if lb.source is None:
                for missing in load.blocks[i:]:
                    missing.state = LoadState.FAILED
                break
            load.waiting.append(lb)
        if from_host:
            self.load_path.copy_to_gpu([load], from_host)
        self.load_path.feed(load)
        return load_id

    def prefetch(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """Start reading into the host tier, in order, the blocks of `metas` that it lacks
        and a tier below with a local lookup holds (a request waiting for GPU room will
        restore them: they then come from the host); see `LoadPath.prefetch`. Returns the
        blocks held below whose read could not start now (none without a caching host
        tier)."""
        return self.load_path.prefetch(metas) if self.tiers.caching_host is not None else []

    @property
    def prefetch_room(self) -> int:
        """How many prefetch reads may start now (0 without a caching host tier)."""
        return self.load_path.prefetch_room if self.tiers.caching_host is not None else 0

    def _source(self, blocks: list[LoadBlock], i: int, below: list[list[bool] | None],
                known_on_disk: bool) -> LowerTier | None:
        """The fastest lower tier holding `blocks[i]` (None: none does). A tier with a local
        lookup is asked once, for block `i` onwards (`below` keeps its answers); a remote
        one is trusted: the lookup found the block there."""
        for k, tier in enumerate(self.lower_tiers):
            if not tier.lookup_is_local:
                return tier
            if below[k] is None:
                rest = [b.meta.block_hash for b in blocks[i:]]
                known = known_on_disk and tier.kind is Tier.DISK
                below[k] = [False] * i + ([True] * len(rest) if known else tier.contains(rest))
            if below[k][i]:
                return tier
        return None

    def is_load_ready(self, load_id: LoadId, advance: bool = True) -> bool:
        """Whether `complete_load` would not wait: every block arrived or failed, or is
        being copied on a GPU copy stream. `advance` polls transfers first. Raises
        ValueError for an unknown or completed load."""
        load = self._get_load(load_id)
        if advance:
            self.poll()
        return self._is_usable(load)

    def _is_usable(self, load: Load) -> bool:
        """Every block arrived, failed, or is being copied on a GPU copy stream."""
        copies = set()  # one job, many blocks
        for lb in load.blocks:
            if lb.state is LoadState.PENDING:
                return False
            if lb.state is LoadState.COPYING:
                copies.add(lb.copy_job)
        return all(self.transfers.is_on_stream(j) for j in copies)

    def _get_load(self, load_id: LoadId) -> Load:
        if load_id not in self._loads:
            raise ValueError(f"load {load_id} is unknown or already completed")
        return self._loads[load_id]

    def cancel_load(self, load_id: LoadId) -> list[bool]:
        """Stop what of a load has not started: its blocks waiting for a host slot, and its
        disk reads still queued, become misses; a read under way still lands in the host
        tier but is not copied to the GPU. Returns, per block, whether its bytes will still
        arrive on the GPU (their copy was already submitted); every other block of the load
        will never be written by it, so the caller may compute into it at once.
        `complete_load` must still be called. Raises ValueError for an unknown or completed
        load."""
        load = self._get_load(load_id)
        load.cancelled.set()
        for lb in load.waiting:
            lb.state = LoadState.FAILED
        load.waiting.clear()
        return [lb.state in (LoadState.COPYING, LoadState.ARRIVED) for lb in load.blocks]

    def complete_load(self, load_id: LoadId) -> int:
        """Finish a load, waiting for it if needed; returns how many LEADING blocks arrived
        intact. Those are now cached in the pool; the others stay allocated, uncached, and
        the caller recomputes them. Blocks still being copied on the GPU count as arrived:
        the current CUDA stream is made to wait for their copies, so the forward queued
        next reads them whole; their host slots stay pinned until a `poll` after the copies
        finished. Raises ValueError for an unknown or completed load."""
        arrived = self._complete(load_id, leading_only=True)
        return next((i for i, ok in enumerate(arrived) if not ok), len(arrived))

    def load_reads(self, load_id: LoadId) -> tuple[int, list[tuple[float, float]]]:
        """What the load's reads from the tiers below have done so far (call before completing
        it): the blocks read intact, whether or not they reach the GPU (a cancelled load's
        reads count), and the (start, end) on `time.monotonic` of each read job that ran.
        Raises ValueError for an unknown or completed load."""
        load = self._get_load(load_id)
        return load.read_blocks, list(load.read_spans)

    def complete_load_blocks(self, load_id: LoadId) -> list[bool]:
        """`complete_load` for a caller that uses every block that arrived, not only the
        leading ones: returns per block whether it arrived intact; each that did is cached
        in the pool. Raises ValueError for an unknown or completed load."""
        return self._complete(load_id, leading_only=False)

    def _complete(self, load_id: LoadId, leading_only: bool) -> list[bool]:
        load = self._get_load(load_id)
        if not self._is_usable(load):
            self.poll()
        while not self._is_usable(load):
            # Blocks waiting for a host slot wait for whatever is in flight to free one.
            pending = list(load.job_ids or self._on_done)
            assert pending, "poll() leaves a load unready only while transfers are in flight"
            self.transfers.wait(pending)
            self.poll()
        del self._loads[load_id]
        self.transfers.order_after({lb.copy_job for lb in load.blocks
                                    if lb.state is LoadState.COPYING})
        arrived = [lb.state is not LoadState.FAILED for lb in load.blocks]
        if leading_only and not all(arrived):
            arrived[arrived.index(False):] = [False] * (len(arrived) - arrived.index(False))
        # ref_cnt 1 is our own reference alone: the caller freed the block, so it is not
        # cached (a later owner would overwrite its bytes).
        held = [lb for lb, ok in zip(load.blocks, arrived) if ok and lb.gpu_block.ref_cnt > 1]
        self.pool.cache_full_blocks([lb.gpu_block for lb in held],
                                    [lb.meta.block_hash for lb in held])
        self.pool.free([lb.gpu_block for lb in load.blocks])
        return arrived

    # ---- stores --------------------------------------------------------------------------

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          metas: Sequence[BlockMeta],
                          load_ranks: Sequence[int | None] | None = None
                          ) -> list[KVCacheBlock]:
        """Cache full blocks in the pool and queue the newly cached ones for the host
        (`kvtier.stores`: each held until `submit_stores` starts its copy); returns the newly
        cached blocks. A block already stored below is not copied; one for which no host
        slot can be had then is copied later if the GPU still caches it. `load_ranks[i]` is
        a placement hint: None when a later restore is expected to compute `blocks[i]`,
        else how dear it is to compute (its index in its prompt, say; >= 0). Ranked blocks
        get host slots, and so the disk, first, the higher rank first
        (`kvtier.deferred_stores`). Raises ValueError as `BlockPool.cache_full_blocks`
        does, on a length mismatch or a negative rank."""
        if len(blocks) != len(metas) or (load_ranks is not None
                                         and len(load_ranks) != len(blocks)):
            raise ValueError(f"{len(blocks)} blocks but {len(metas)} metas"
                             + ("" if load_ranks is None else
                                f" and {len(load_ranks)} load ranks"))
        if load_ranks is not None and any(r is not None and r < 0 for r in load_ranks):
            raise ValueError(f"load ranks must be None or >= 0, got {list(load_ranks)!r:.200}")
        newly = self.pool.cache_full_blocks(blocks, [meta.block_hash for meta in metas])
        if self.stores is not None and newly:
            index_of = {block.block_id: i for i, block in enumerate(blocks)}
            indexes = [index_of[block.block_id] for block in newly]
            self.stores.write_through(
                newly, [metas[i] for i in indexes],
                None if load_ranks is None else [load_ranks[i] for i in indexes])
        return newly

    @property
    def num_stores_queued(self) -> int:
        """Blocks `cache_full_blocks` queued for the host that `submit_stores` has not
        started yet (each holds its GPU block)."""
        return 0 if self.stores is None else self.stores.num_pending

    def submit_stores(self, batch: bool = False) -> None:
        """Start the host copies `cache_full_blocks` queued (their slots, evictions and copy
        plans). The engine calls it while the GPU runs a step, so that this host work
        overlaps the GPU's instead of delaying the next launch, with `batch` (only once
        enough are queued: `kvtier.stores.STORE_BATCH_BLOCKS`); `drain` starts them all."""
        if self.stores is not None:
            self.stores.submit_pending(batch)

    def reclaim_store_blocks(self, num_blocks: int, wait: bool) -> bool:
        """Free GPU blocks that host stores hold, for an allocation `num_blocks` short:
        start the queued stores (their blocks come free as their copies land; on a CPU, at
        once), or else, with `wait`, wait for copies in flight that free that many
        (`wait_for_stores`). False when the stores had nothing to give. A scheduler asks
        this before it preempts a request (`wait`: when someone would be preempted)."""
        if self.num_stores_queued:
            self.submit_stores()
            self.poll()
            return True
        return wait and self.wait_for_stores(num_blocks)

    def wait_for_stores(self, num_blocks: int) -> bool:
        """Block until enough of the host copies in flight have landed to free `num_blocks`
        GPU blocks, and hand those back to the pool; False, without waiting, when all of them
        together would free fewer. A scheduler short of blocks asks this before it preempts
        a request: a step's copies take milliseconds, a preempted request its whole prefill."""
        job_ids = [] if self.stores is None else self.stores.copies_freeing(num_blocks)
        if not job_ids:
            return False
        self.transfers.wait(job_ids)
        self.poll()
        return True

    # ---- progress ------------------------------------------------------------------------

    def _submit(self, job: SwapJob | IOJob, on_done: Callable[[bool], None],
                *loads: Load) -> JobId:
        """Start `job`; `on_done(ok)` runs in the `poll` that sees it finish. `loads` wait
        for it (`Load.job_ids`)."""
        job_id = self.transfers.submit(job)
        self._on_done[job_id] = (loads, on_done)
        for load in loads:
            load.job_ids.add(job_id)
        return job_id

    def wait_for_transfers(self, timeout_s: float) -> None:
        """Block until a transfer finished that `poll` has not taken in yet, or for
        `timeout_s` seconds: what an engine with nothing to run but transfers in flight
        waits on (a disk read wakes it as it lands, not after a fixed sleep)."""
        self.transfers.wait_any(timeout_s)

    def poll(self) -> None:
        """Advance transfers without blocking: run the next step of every finished job
        (reads -> host -> GPU chains, stores landing, write-backs committing), start
        write-backs where the host runs short of evictable slots, and give freed slots to
        waiting loads. Call it once per engine step."""
        while finished := self._unhandled + self.transfers.get_finished():
            self._unhandled = []
            for index, (job_id, ok) in enumerate(finished):
                loads, on_done = self._on_done.pop(job_id)
                for load in loads:
                    load.job_ids.discard(job_id)
                try:
                    on_done(ok)
                except BaseException:
                    # A completion that raises is a bug; the jobs after it still complete
                    # in the next poll, or `drain` and `close` would wait for them forever.
                    self._unhandled = finished[index + 1:]
                    raise
                self.num_jobs_completed += 1
            self.load_path.copy_landed_reads()
        if self.stores is not None:
            self.stores.send_offers()  # this step's newly cached blocks, in batches
        # Only loads with blocks waiting for a host slot: a restore keeps hundreds of loads
        # in flight, and `_complete` polls once per load it completes. They take the slots
        # that write-backs just cleaned before deferred write-throughs do: a read serves a
        # request now, a store only may later (under serving load, deferred stores took
        # every cleaned slot and no disk read ever started).
        starved = [load for load in self._loads.values() if load.waiting]
        for load in starved:
            self.load_path.feed(load)
        starved = [load for load in starved if load.waiting]
        if self.stores is not None:
            self.stores.progress(sum(len(load.waiting) for load in starved),
                                 reading=self.load_path.num_reads_in_flight > 0)
        if starved and not self._on_done:  # nothing in flight can free a slot: misses
            for load in starved:
                self._counters[Tier.HOST].rejected += len(load.waiting)
                for lb in load.waiting:
                    lb.state = LoadState.FAILED
                load.waiting.clear()

    def drain(self) -> None:
        """Start the queued stores, then block until no transfer is in flight (each one's
        completion has run). Each poll meanwhile starts the write-backs that keep the disk
        busy, so dirty host blocks are written before it returns."""
        self.submit_stores()
        self.poll()
        while self._on_done:
            self.transfers.wait(list(self._on_done))
            self.poll()

    def flush(self, timeout_s: float | None = None,
              progress: FlushProgress | None = None) -> FlushReport:
        """Block until nothing is in flight and every block offered to the write-back tier
        is accounted for: queued and deferred write-throughs of blocks the GPU still caches
        are copied to the host as write-backs free slots, and every dirty host block is
        written back. With `timeout_s`, what is still unwritten once it has passed (and the
        jobs in flight have ended), or what can make no progress, is given up and counted
        skipped (`SkipReason.FLUSH_TIMEOUT`). `progress` is called after each round of
        writes. Ends with a sync of the tiers below the host (`LowerTier.sync`): what
        was written is then on their storage, not only in the OS's page cache."""
        began = time.monotonic()
        stores = self.stores
        written_before = 0 if stores is None else stores.ledger.written
        self.submit_stores()
        self.poll()
        while stores is not None:
            backlog = stores.backlog() if stores.write_back is not None else stores.num_deferred
            if progress is not None:
                progress(stores.ledger.written - written_before, backlog)
            if not backlog and not self._on_done:
                break
            if timeout_s is not None and time.monotonic() - began >= timeout_s:
                break
            if self._on_done:
                # What is in flight now (a few write batches and copies), then the next:
                # the poll copies deferred blocks into the slots the writes cleaned and
                # starts more writes. The deadline is kept to a round of these.
                self.transfers.wait(list(self._on_done))
                self.poll()
                continue
            stores.schedule_writebacks(stores.num_deferred)
            if not self._on_done:
                self.poll()
                if not self._on_done:
                    break  # nothing can move (no slot comes free for what is deferred)
        unwritten = 0
        if stores is not None and timeout_s is not None:
            # Give up what has not started; what is in flight ends and is counted.
            while stores.backlog():
                unwritten += stores.abandon_backlog()
                self.drain()
        else:
            self.drain()
        self.lower_tiers.sync()
        return FlushReport(0 if stores is None else stores.ledger.written - written_before,
                           unwritten, time.monotonic() - began)

    def close(self, timeout_s: float | None = None,
              progress: FlushProgress | None = None) -> FlushReport:
        """Wait for in-flight work, flush what is pending (`flush`, within `timeout_s`),
        stop the I/O threads and close the tiers below the host. Idempotent (a second call
        reports nothing). Loads not completed keep their GPU references."""
        if self._closed:
            return FlushReport(0, 0, 0.0)
        report = self.flush(timeout_s, progress)
        if self.stores is not None and self.stores.backlog():  # what no slot came free for
            report = FlushReport(report.num_written,
                                 report.num_unwritten + self.stores.abandon_backlog(),
                                 report.seconds)
        self.transfers.close()
        self.lower_tiers.close()
        if self.host is not None:
            self.host.close()
        self._closed = True
        return report

    # ---- inspection ----------------------------------------------------------------------

    def stats(self, lower_tiers: bool = True) -> ManagerStats:
        """Per-tier block counters, transfers per direction, pool and host occupancy;
        `lower_tiers=False` leaves out the tiers below the host's own stats (`disk` and
        `remote` None, `lower_tiers` empty), which read LMDB or the network: they can be read
        from any thread with `TierManager.lower_tiers.stats()`."""
        host = self.tiers.caching_host
        below = self.lower_tiers.stats_by_name() if lower_tiers else {}
        return ManagerStats(
            tiers={tier: counters.snapshot() for tier, counters in self._counters.items()},
            transfers=self.transfers.stats(), pool=self.pool.stats(),
            host_slots=host.num_slots if host else 0,
            host_free_slots=host.num_free_slots if host else 0,
            host_cached=host.num_cached if host else 0, host_dirty=host.num_dirty if host else 0,
            disk=below.get("disk"), num_loads_in_flight=len(self._loads),
            num_jobs_in_flight=len(self._on_done), remote=below.get("remote"), lower_tiers=below,
            stores=(self.stores.ledger_stats()
                    if self.stores is not None and self.stores.write_back is not None
                    else None))
