"""The disk tier: KV blocks as LMDB values, least-recently-used first out.

One LMDB environment (a directory) holds four named databases:

    blocks  block hash -> record (header + block bytes, see `kvtier.tiers.record`)
    access  block hash -> big-endian access sequence number
    lru     sequence (8 bytes, big-endian) || block hash -> b""   (oldest first)
    meta    format version, next sequence number, bytes used, budget, layout names

The access order lives in LMDB, so it survives restarts and is shared by every process using
the directory. LMDB's own locks make it safe for several processes; within one process many
threads may read and write at once (writes are serialized by LMDB). Each call opens and ends
its own transactions; none is held across calls. Lookups are answered from this process's
copy of the stored hashes while it is current (`kvtier.tiers.disk.keys`), so a lookup reads
one page, not the tree, even after the page cache dropped it.

Write transactions are `kvtier.tiers.disk.write`'s, reads of values `kvtier.tiers.disk.read`'s;
lookups and stats run through `kvtier.tiers.disk.bounded_calls`.

Two LMDB rules shape the code: the map can only be resized while no transaction of this
process is open (`GuardedEnv`), and values read with buffers=True are only valid inside their
transaction (bytes are copied into the caller's tensor before it ends).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb
import torch

from kvtier.fsutil import PRIVATE_FILE_MODE, ensure_private_dir
from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.disk.access import PendingTouches, touch_in, write_touches
from kvtier.tiers.disk.bounded_calls import TIMED_OUT, BoundedCalls
from kvtier.tiers.disk.index import (
    DISK_FORMAT_VERSION,
    DataFileWatch,
    DiskFilesGone,
    GuardedEnv,
    LmdbIndex,
)
from kvtier.tiers.disk.keys import KeyEvent, StoredKeys
from kvtier.tiers.disk.read import RecordSource, read_records_into
from kvtier.tiers.disk.shard_layout import existing_shards
from kvtier.tiers.disk.sync import WriteSync
from kvtier.tiers.disk.write import RecordWriter
from kvtier.tiers.record import (
    BlockBuffer,
    BlockMeta,
    CorruptRecord,
    decode_record,
    dest_array,
    payload_view,
    record_size,
)

logger = logging.getLogger(__name__)

_MiB = 1 << 20
_INITIAL_MAP_BYTES = 64 * _MiB
#: The most address space a writable tier's map takes at open (x86-64 gives a process 128
#: TiB); a larger budget's map grows past it when needed.
MAX_INITIAL_MAP_BYTES = 1 << 40
#: Seconds a lookup (or a stats read) may take before the disk counts as stalled.
LOOKUP_DEADLINE_S = 0.5
#: Seconds after a lookup found the copy of the stored hashes current during which lookups
#: answer from it on the caller's thread (`kvtier.tiers.disk.keys`): another process's
#: writes are seen up to this much later.
KEYS_FRESH_S = 0.5


@dataclass(frozen=True, slots=True)
class DiskStats:
    """Counters of one DiskTier. `num_blocks` and `bytes_used` (record bytes) are the
    directory's, shared with other processes; the rest count this object's calls. `misses`
    include `rejected` (values that failed validation and were deleted); `refused` counts
    blocks not stored for lack of room. `durable`: each commit is synced (see `DiskTier`);
    `syncs`: syncs of the whole environment this object ran (in the background, `sync`,
    `close`)."""

    num_blocks: int
    bytes_used: int
    budget_bytes: int
    hits: int
    misses: int
    rejected: int
    puts: int
    pruned: int
    refused: int
    durable: bool = True
    syncs: int = 0


class DiskTier(LowerTier):
    """KV blocks of one layout in an LMDB directory, within `budget_bytes` of record bytes.

    `path` is created (mode 0o700) when missing. LMDB's map may reach `max_map_bytes`
    (default: the budget plus a quarter plus 64 MiB); past that, blocks are pruned or refused.
    A writable tier's map starts there, up to `MAX_INITIAL_MAP_BYTES`, unless
    `initial_map_bytes` asks for less (then it doubles when needed): without writemap the
    map is address space, not disk, and a resize must wait for every transaction of the
    process, a background sync of GiBs of dirty pages included, while lookups queue behind
    it past their deadline (docs/BENCHMARKS.md, "The disk tier's writers"). A read-only one
    maps its file.
    Access-order updates from reads ride on the next write transaction, or get one of
    their own once `touch_flush_every` are pending (a commit costs an fsync when durable).

    Durability. With `durable` (the default of this class, kept for direct users) each
    commit is fsynced (LMDB's meta page one commit later, which keeps the database
    consistent after a crash and may lose the last commit); every commit then waits for the
    disk, which holds writes well below its sequential speed. Without it (what the engine
    opens by default, `TierConfig.disk_durable`) the OS writes the pages back when it likes,
    and the tier syncs the whole environment on a thread of its own once `sync_every_bytes`
    (default 1 GiB) were written since the last sync, so no writer waits for a flush;
    `sync()` and `close()` sync on the caller's thread, so a clean shutdown leaves every
    block on the disk. A process crash loses nothing either way (committed pages are in the
    kernel's page cache). An OS crash or a power loss may lose the blocks written since the
    last sync (they miss) or leave the files inconsistent: the next open checks the tree
    (`kvtier.tiers.disk.check`) and `open_disk_tier` moves damaged files aside, and every
    value is checksummed when read, so a stale or torn block is a miss, never served.

    A directory written with another disk format is cleared on open (`format_reset` is then
    true) or, read-only, served as empty. Thread-safe; several processes may share `path`,
    but one process must not open it twice.

    Trouble under a running tier stays in the tier. data.mdb removed, replaced or cut
    short is noticed before the next transaction (`DataFileWatch`): the tier is then set
    aside (`unavailable` says why): every lookup and read misses, every store is refused,
    its stats count no block, and nothing touches the map again. A stalled disk stalls
    only the threads doing its I/O: `contains` and `stats`, which the engine and the
    server call, each run on a thread of the tier's own and are answered within
    `lookup_deadline_s`; past it a lookup makes the disk count as unavailable (every
    lookup a miss, at once) until the stalled call returns, and a stats read answers
    with the figures last read. Within `keys_fresh_s` of a lookup that found the copy of
    the stored hashes current, lookups answer from it on the caller's thread: they read
    nothing of the disk. `write_hook`, like `read_hook`, is for tests: it
    is called with the metas of each write transaction, inside it, before its puts.

    Raises ValueError for a bad budget or `sync_every_bytes`, the errors of
    `kvtier.fsutil.ensure_private_dir` for a bad directory, and FileNotFoundError when opened
    read-only where no cache exists.

    As a `LowerTier`: the local store the host writes back to, looked up in memory.
    """

    name = "disk"
    kind = Tier.DISK
    write_policy = WritePolicy.WRITE_BACK
    lookup_is_local = True
    #: Blocks per write transaction.
    write_batch = 32
    serial_writes = True  # one write transaction at a time

    def __init__(self, path: str | os.PathLike[str], layout: KVLayout, budget_bytes: int, *,
                 readonly: bool = False, max_map_bytes: int | None = None,
                 initial_map_bytes: int | None = None, durable: bool = True,
                 sync_every_bytes: int = 1 << 30, touch_flush_every: int = 1024,
                 read_hook: Callable[[BlockMeta], None] | None = None,
                 write_hook: Callable[[Sequence[BlockMeta]], None] | None = None,
                 lookup_deadline_s: float = LOOKUP_DEADLINE_S,
                 keys_fresh_s: float = KEYS_FRESH_S) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
                or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        self.path = ensure_private_dir(path, create=not readonly)
        if (existing_shards(self.path) or 1) > 1:
            raise ValueError(f"{self.path} is a sharded disk tier; open it with "
                             "kvtier.tiers.disk.recovery.open_disk_tier (or the engine)")
        if readonly and not (self.path / "data.mdb").exists():
            raise FileNotFoundError(f"{self.path} holds no kvtier disk cache (no data.mdb); "
                                    "open it writable once or check the path")
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.readonly = readonly
        #: Each commit is synced (else: `sync_every_bytes`, see the class docstring).
        self.durable = durable
        self._syncs = WriteSync(self._sync_env, sync_every_bytes, name="kvtier-disk-sync")
        self._fingerprint = layout.fingerprint()
        self._map_limit = max_map_bytes or budget_bytes + budget_bytes // 4 + _INITIAL_MAP_BYTES
        data_file = self.path / "data.mdb"
        data_bytes = data_file.stat().st_size if data_file.exists() else 0
        start = initial_map_bytes or (_INITIAL_MAP_BYTES if readonly
                                      else min(self._map_limit, MAX_INITIAL_MAP_BYTES))
        map_size = min(self._map_limit, max(start, data_bytes))
        # Values are read with pread, never through the map: no read-around for the tree.
        self._index = LmdbIndex.open(self.path, readonly=readonly, durable=durable,
                                     map_size=map_size, mode=PRIVATE_FILE_MODE,
                                     readahead=False)
        try:
            watch = DataFileWatch(self.path / "data.mdb")
        except BaseException:
            self._index.env.close()
            raise
        self._map = GuardedEnv(self._index.env, self._map_limit, watch)
        self._page_size = self._index.env.stat()["psize"]
        self._lock = threading.Lock()
        self._touches = PendingTouches(touch_flush_every)
        self._read_hook = read_hook
        self.lookup_deadline_s = lookup_deadline_s
        self.keys_fresh_s = keys_fresh_s
        # Lookups and stats each on a thread of their own: a slow stats read (a metrics
        # scrape) must not hold up the engine's lookups behind it.
        self._lookups = BoundedCalls("kvtier-disk-lookup")
        self._stats_calls = BoundedCalls("kvtier-disk-stats")
        self._last_stats: tuple[int, int] = (0, 0)
        self._data_fd: int | None = None  # data.mdb for payload reads, opened on first use
        self._keys = StoredKeys(self._map, self._index, self._data_file, self._page_size,
                                self.path)
        self._writer = RecordWriter(self.path, layout, budget_bytes, self._map, self._index,
                                    self._keys, self._touches, self._count, write_hook)
        self._counts = {name: 0 for name in ("hits", "misses", "rejected", "puts", "pruned",
                                              "refused")}
        self.format_reset = False
        self._stale = False
        try:
            self._check_format()
        except BaseException:
            self._index.env.close()
            raise
        if not self._stale:
            self._keys.start_load()

    # ---- lifecycle -----------------------------------------------------------------------

    def _check_format(self) -> None:
        if self.readonly:
            with self._map.txn() as txn:
                self._stale = self._index.format_version(txn) != DISK_FORMAT_VERSION
            if self._stale:
                logger.warning("disk cache %s has another format version; serving nothing "
                               "(open it writable to reset it)", self.path)
            return
        with self._map.txn(write=True) as txn:
            version = self._index.format_version(txn)
            if version != DISK_FORMAT_VERSION and (version is not None
                                                  or self._index.num_blocks(txn)):
                self._index.reset(txn)
                self.format_reset = True
            self._index.set_format_version(txn, DISK_FORMAT_VERSION)
            self._index.set_layout_name(txn, self._fingerprint, self.layout.describe())
            self._index.set_counter(txn, "budget_bytes", self.budget_bytes)
        if self.format_reset:
            logger.warning("disk cache %s had disk format %s; cleared it (this build writes "
                           "format %d)", self.path, version, DISK_FORMAT_VERSION)

    def close(self) -> None:
        """Flush pending access-order updates, sync (everything written is then on the
        disk) and close LMDB. Safe to call twice."""
        if self._map.closed:
            return
        self._keys.close()
        self._syncs.close()  # no background sync may outlive the environment
        try:
            if not self.readonly and self._map.gone is None:
                self._flush_touches()
                self.sync()
        finally:
            self._lookups.shutdown()
            self._stats_calls.shutdown()
            self._map.close()
            with self._lock:
                fd, self._data_fd = self._data_fd, None
            if fd is not None:
                os.close(fd)

    def sync(self) -> None:
        """Put every block written so far on the disk (one fdatasync of the data file, on
        the caller's thread). A failure is logged, not raised: the blocks stay readable
        from the page cache, and one the OS then fails to write back misses when read.
        Does nothing when read-only, closed or set aside."""
        if self.readonly or self._map.closed or self._map.gone is not None:
            return
        try:
            self._syncs.sync_now()
        except (DiskFilesGone, ValueError):
            pass  # set aside or closed meanwhile: nothing to sync
        except (OSError, lmdb.Error) as exc:
            logger.warning("disk cache %s: syncing failed (%s); recent blocks stay in the "
                           "page cache until the OS writes them", self.path, exc)

    def _sync_env(self) -> None:
        self._map.sync()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- queries -------------------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why the tier serves nothing now (its files went away under it, or a lookup
        outlasted `lookup_deadline_s` and has not returned); None while it serves."""
        if self._map.gone is not None:
            return self._map.gone
        if self._lookups.stalled:
            return f"a disk lookup has taken more than {self.lookup_deadline_s} s"
        return None

    @property
    def num_syncs(self) -> int:
        """Syncs of the whole environment this object ran (`DiskStats.syncs`); readable
        after `close`, whose last sync it counts."""
        return self._syncs.num_syncs

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each hash has a stored value (not validated: `get_into` may still miss).

        Answered from this process's copy of the stored hashes when it is current, else from
        LMDB's tree (and the copy is loaded again in the background); within
        `lookup_deadline_s`, else every hash is a miss (see the class docstring). Within
        `keys_fresh_s` of a lookup that found the copy current, from the copy on the
        caller's thread."""
        found = self.contains_from_memory(block_hashes)
        if found is not None:
            return found
        return self._bounded(self._lookups, self._contains_now, [False] * len(block_hashes),
                             list(block_hashes))

    def contains_from_memory(self, block_hashes: Sequence[BlockHash]) -> list[bool] | None:
        """`contains` answered at once on the caller's thread (within `keys_fresh_s` of a
        lookup that found the copy of the stored hashes current, or all misses for a tier
        set aside), else None: `contains` would ask the lookup thread."""
        if self._stale or self._map.gone is not None:
            return [False] * len(block_hashes)
        if self._lookups.stalled or self._map.closed:
            return None
        return self._keys.contains_recent(block_hashes, self.keys_fresh_s)

    def _contains_now(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        try:
            return self._keys.contains(block_hashes)
        except DiskFilesGone:
            return [False] * len(block_hashes)

    def _bounded(self, calls: BoundedCalls, fn: Callable, fallback: Any,
                 *args: object) -> Any:
        """`fn(*args)` on `calls`' thread, or `fallback` if the disk does not answer within
        the deadline (or still has not answered an earlier call there)."""
        if self._map.closed:
            raise ValueError(f"disk cache {self.path} is closed")
        answered, result = calls.call(self.lookup_deadline_s, fn, *args)
        if answered is None:
            raise ValueError(f"disk cache {self.path} is closed")
        if answered:
            return result
        if calls is self._lookups and result is TIMED_OUT:
            logger.warning("disk cache %s: a lookup took more than %s s; the disk tier counts "
                           "as unavailable until it returns", self.path, self.lookup_deadline_s)
        return fallback

    def watch_keys(self, watcher: Callable[[KeyEvent], None]) -> None:
        """Tell `watcher` this process's copy of the stored hashes and every change of it
        (`kvtier.tiers.disk.keys.DiskKeySet.watch`); `keys_in_memory` confirms it current."""
        self._keys.watch(watcher)

    def keys_in_memory(self, wait: float = 0.0) -> bool:
        """Whether lookups are answered from memory now: the copy of the stored hashes is at
        the stored key generation. Waits up to `wait` seconds for it to load (a load starts
        when it is behind)."""
        if self._stale or self._map.gone is not None:
            return False
        try:
            return self._keys.in_memory(wait)
        except DiskFilesGone:
            return False

    def stats(self) -> DiskStats:
        """The tier's counters; the stored figures are those last read when the disk does
        not answer within the deadline, and zero once the tier is set aside."""
        if self._map.gone is not None:
            num_blocks, bytes_used = 0, 0
        else:
            num_blocks, bytes_used = self._bounded(self._stats_calls, self._stored_figures,
                                                   self._last_stats)
        with self._lock:
            counts = dict(self._counts)
        return DiskStats(num_blocks=num_blocks, bytes_used=bytes_used,
                         budget_bytes=self.budget_bytes, **counts, durable=self.durable,
                         syncs=self._syncs.num_syncs)

    def _stored_figures(self) -> tuple[int, int]:
        try:
            with self._map.txn() as txn:
                figures = (self._index.num_blocks(txn), self._index.counter(txn, "bytes_used"))
        except DiskFilesGone:
            return 0, 0
        self._last_stats = figures
        return figures

    # ---- loads ---------------------------------------------------------------------------

    def get_into(self, meta: BlockMeta, dest: torch.Tensor) -> bool:
        """Copy the block `meta` names into `dest`; True on a verified hit.

        `dest` is a contiguous CPU tensor of exactly `bytes_per_block` bytes (any dtype). On
        False its contents are unspecified. A stored value with a bad header, checksum,
        length, layout, parent hash or token ids is deleted and counted as rejected.
        The payload is read from `data.mdb` with one `pread` at its offset (values are
        contiguous overflow pages), not faulted in page by page through the map. A
        `read_hook` given at construction is called with `meta` before each read (tests
        slow or fail reads with it; an exception it raises fails the whole batch).
        Raises ValueError for a bad `dest`.
        """
        return self.get_many_into([meta], [dest])[0]

    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        """`get_into` for a batch, in one read transaction."""
        if len(metas) != len(dests):
            raise ValueError(f"{len(metas)} metas but {len(dests)} destinations")
        arrays = [dest_array(dest, self.layout.bytes_per_block) for dest in dests]
        if self._stale or self._map.gone is not None:
            self._count(misses=len(metas))
            return [False] * len(metas)
        results: list[bool] = []
        rejects: list[BlockMeta] = []
        try:
            source = RecordSource(self._index, self._data_file(), self._page_size,
                                  self._fingerprint)
            with self._map.txn() as txn, txn.cursor(db=self._index.blocks) as cursor:
                if self._read_hook is not None:
                    for meta in metas:
                        self._read_hook(meta)
                hints = self._keys.spots([meta.block_hash for meta in metas])
                for meta, (ok, rejected) in zip(metas, read_records_into(
                        source, txn, cursor, metas, arrays, hints)):
                    results.append(ok)
                    if rejected:
                        rejects.append(meta)
        except DiskFilesGone:
            self._count(misses=len(metas))
            return [False] * len(metas)
        num_hits = sum(results)
        self._count(hits=num_hits, misses=len(metas) - num_hits)
        if rejects:
            self._reject(rejects)
        hit_hashes = [meta.block_hash for meta, ok in zip(metas, results) if ok]
        if hit_hashes:
            self.touch(hit_hashes)
        return results

    def _data_file(self) -> int:
        with self._lock:
            if self._data_fd is None:
                self._data_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
            return self._data_fd

    def _reject(self, metas: list[BlockMeta]) -> None:
        self._count(rejected=len(metas))
        if self.readonly or self._map.gone is not None:
            return
        with self._keys.write() as (txn, changes):
            for meta in metas:
                value = self._index.get(txn, meta.block_hash)
                # Another process may have replaced it with a good value meanwhile.
                if value is not None and not self._is_valid(value, meta):
                    self._index.remove(txn, meta.block_hash, changes)
            # A value damaged outside kvtier may have changed length, so the byte counter
            # may have drifted; rejections are rare, so count the values again.
            self._index.recount_bytes(txn)

    def _is_valid(self, value: memoryview, meta: BlockMeta) -> bool:
        try:
            header, _ = decode_record(value, self._fingerprint, self.layout.bytes_per_block)
        except CorruptRecord:
            return False
        return header.matches(meta)

    # ---- stores --------------------------------------------------------------------------

    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        """Store blocks in one write transaction; per block, whether it is present
        afterwards.

        A payload is `bytes_per_block` bytes as bytes, a memoryview, a C-contiguous numpy
        array or a contiguous CPU tensor. Hashes already stored are touched, not rewritten.
        Least-recently-used blocks are pruned first to stay within the budget; blocks that
        still do not fit (or meet a full map or disk) are refused and counted. Raises
        ValueError for a payload of the wrong size or kind.
        """
        return self.put_counted(metas, payloads)[0]

    def put_counted(self, metas: Sequence[BlockMeta], payloads: Sequence[object]
                    ) -> tuple[list[bool], int]:
        """`put`, and how many blocks this call wrote (those stored already, or stored by
        another process meanwhile, are not counted).

        One lookup (from memory, see `kvtier.tiers.disk.keys`) finds the blocks to write;
        the write transaction checks each of them once more (another process may have
        written it meanwhile) and says which blocks it leaves stored: no lookup after it.
        Runs on the caller's thread, not the lookup thread: writes are not bounded by the
        lookup deadline.
        """
        if len(metas) != len(payloads):
            raise ValueError(f"{len(metas)} metas but {len(payloads)} payloads")
        views = [payload_view(payload, self.layout.bytes_per_block) for payload in payloads]
        items: dict[BlockHash, tuple[BlockMeta, memoryview]] = {}
        for meta, view in zip(metas, views):
            items.setdefault(meta.block_hash, (meta, view))
        block_hashes = [meta.block_hash for meta in metas]
        if not items:
            return [], 0
        if self._map.gone is not None:
            self._count(refused=len(items))
            return [False] * len(metas), 0
        try:
            present = dict(zip(items, self._contains_now(list(items))))
            if self.readonly:
                self._count(refused=len(items) - sum(present.values()))
                return [present[h] for h in block_hashes], 0
            touched = [h for h, hit in present.items() if hit]
            # Sizes (and token ids) are checked here, outside the write transaction.
            new = [(meta, view, record_size(meta, view.nbytes))
                   for (meta, view), hit in zip(items.values(), present.values()) if not hit]
            if not new:  # all stored already (another writer may have stored them)
                self.touch(touched)
                return [True] * len(metas), 0
            stored, num_written = self._writer.write(new, touched, frozenset(items))
            if not self.durable and num_written:
                self._syncs.wrote(num_written * self.layout.bytes_per_block)
            if stored is None:  # pruned or split on the way: ask afterwards
                return self._contains_now(block_hashes), num_written
            return [h in stored for h in block_hashes], num_written
        except DiskFilesGone:
            return [False] * len(metas), 0

    # ---- access order and deletes --------------------------------------------------------

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Mark blocks as just used. Batched: written with the next write transaction, or
        once `touch_flush_every` are pending."""
        if not self.readonly and self._map.gone is None and self._touches.add(block_hashes):
            try:
                self._flush_touches()
            except DiskFilesGone:
                pass  # set aside: the access order is of no use any more

    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        """Remove blocks; how many were present. Raises ValueError when read-only."""
        if self.readonly:
            raise ValueError(f"disk cache {self.path} is open read-only; cannot delete")
        try:
            with self._keys.write() as (txn, changes):
                touch_in(self._index, txn, self._touches.take())
                return sum(self._index.remove(txn, h, changes) for h in block_hashes)
        except DiskFilesGone:
            return 0

    def _flush_touches(self) -> None:
        write_touches(self._map, self._index, self._touches.take(), self.path)

    # ---- plumbing ------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta
