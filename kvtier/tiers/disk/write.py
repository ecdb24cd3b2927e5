"""The disk tier's write transactions: new records written within the budget, pruning
least-recently-used blocks for room, growing the map, splitting a batch that does not fit.

`DiskTier.put` decides which blocks are new (one lookup); a `RecordWriter` writes them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence

import lmdb

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.tiers.disk.access import PendingTouches
from kvtier.tiers.disk.index import GuardedEnv, LmdbIndex, is_disk_full
from kvtier.tiers.disk.keys import StoredKeys
from kvtier.tiers.record import BlockMeta, assemble_record

logger = logging.getLogger(__name__)


class RecordWriter:
    """Writes records into one disk tier's LMDB (`map_`, `index`, `keys`) within
    `budget_bytes` of record bytes. Pending access-order updates (`touches`) ride on each
    write transaction. `count(**deltas)` receives the tier's counters (puts, pruned,
    refused); `write_hook`, for tests, is called with each write transaction's metas, inside
    it, before its puts. Thread-safe as LMDB's write transactions are (one at a time)."""

    def __init__(self, path: str | os.PathLike[str], layout: KVLayout, budget_bytes: int,
                 map_: GuardedEnv, index: LmdbIndex, keys: StoredKeys,
                 touches: PendingTouches, count: Callable[..., None],
                 write_hook: Callable[[Sequence[BlockMeta]], None] | None = None) -> None:
        self.path = path
        self.layout = layout
        self.budget_bytes = budget_bytes
        self._map = map_
        self._index = index
        self._keys = keys
        self._touches = touches
        self._count = count
        self._write_hook = write_hook
        self._scratch = threading.local()

    def _assemble(self, meta: BlockMeta, view: memoryview, size: int) -> memoryview:
        """The record in a per-thread scratch buffer, which LMDB copies on put.

        Assembled inside the write transaction, right before its put: the payload is
        checksummed while it is copied into the scratch (one pass over it), and LMDB's copy
        then reads the scratch while it is still in cache. Assembling a batch's records
        before the transaction (so that they overlap another batch's commit) took a scratch
        the batch's size and measured slower on a real disk: each commit took longer
        (docs/BENCHMARKS.md, "The disk tier behind a small host tier").
        """
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or len(scratch) < size:
            scratch = self._scratch.buffer = bytearray(size)
        return assemble_record(meta, self.layout, view, scratch)

    def write(self, records: list[tuple[BlockMeta, memoryview, int]],
                 touched: list[BlockHash], keep: frozenset[BlockHash]
                 ) -> tuple[set[BlockHash] | None, int]:
        """Write the records of `records` (meta, payload, record size) and touch `touched`:
        the hashes of both that are stored at the commit (None when the batch had to be
        split: ask afterwards), and how many records were written. Blocks in `keep` (the
        caller's whole batch) are never pruned to make room.

        A full map is grown up to its limit; past it, or when the disk refuses the commit
        (the commit is then rolled back, committed blocks are untouched), least-recently-used
        blocks are pruned in commits of their own and the write retried. A batch that still
        fails is split in halves; a single block that still fails is refused.
        """
        need = sum(size for _, _, size in records)
        self._map.grow(need)
        pressure = 0
        while pressure < 3 * need:
            map_size = self._map.map_size
            try:
                return self._write_batch(records, touched, keep, pressure)
            except lmdb.MapFullError:
                if self._map.grow(need, full=True, failed_at=map_size):
                    continue
            except lmdb.Error as exc:
                if not is_disk_full(exc):
                    raise
                logger.info("disk cache %s: commit failed (%s); pruning", self.path, exc)
            pressure += need
            if not self._prune_committed(need, keep):
                break
        if len(records) > 1:
            half = len(records) // 2
            return None, (self.write(records[:half], touched, keep)[1]
                          + self.write(records[half:], [], keep)[1])
        logger.warning("disk cache %s: no room for a block (map or disk full); refused it",
                       self.path)
        self._count(refused=len(records))
        return None, 0

    def _write_batch(self, records: list[tuple[BlockMeta, memoryview, int]],
                     touched: list[BlockHash], keep: frozenset[BlockHash],
                     pressure: int) -> tuple[set[BlockHash], int]:
        """One write transaction of `_put_new`: its hashes stored at the commit, and how
        many records it wrote."""
        with self._keys.write() as (txn, changes):
            if self._write_hook is not None:
                self._write_hook([meta for meta, _, _ in records])
            # Earlier reads first, then this batch: the batch is the most recent use.
            uses = self._touches.take() + touched
            alive = [h for h, ok in zip(uses, self._index.has_many(txn, uses)) if ok]
            self._index.touch(txn, alive)
            stored = set(alive).intersection(touched)
            found = self._index.has_many(txn, [meta.block_hash for meta, _, _ in records])
            stored.update(meta.block_hash for (meta, _, _), hit in zip(records, found) if hit)
            absent = [item for item, hit in zip(records, found) if not hit]
            need = sum(size for _, _, size in absent)
            limit = max(0, self.budget_bytes - pressure)
            over = self._index.counter(txn, "bytes_used") + need - limit
            num_pruned = self._index.evict(txn, over, keep, changes)[0] if over > 0 else 0
            room = limit - self._index.counter(txn, "bytes_used")
            fitting = []
            for meta, view, size in absent:
                if size <= room:
                    fitting.append((meta, view, size))
                    room -= size
            # Each record built right before its put, in the one scratch LMDB copies from.
            added = self._index.insert_many(
                txn, ((meta.block_hash, self._assemble(meta, view, size))
                      for meta, view, size in fitting), changes)
            stored.update(meta.block_hash for (meta, _, _), ok in zip(fitting, added) if ok)
        num_stored = sum(added)
        self._count(puts=num_stored, pruned=num_pruned, refused=len(absent) - num_stored)
        return stored, num_stored

    def _prune_committed(self, num_bytes: int, keep: frozenset[BlockHash]) -> bool:
        """Prune in a commit of its own; False if nothing could be pruned or written."""
        try:
            with self._keys.write() as (txn, changes):
                num_pruned, _ = self._index.evict(txn, num_bytes, keep, changes)
            # LMDB reuses the pages freed by commit N from commit N + 2 on (one reader may
            # still hold snapshot N - 1); a second small commit makes them usable right away.
            with self._map.txn(write=True) as txn:
                self._index.set_counter(txn, "budget_bytes", self.budget_bytes)
        except lmdb.Error as exc:
            if not (isinstance(exc, lmdb.MapFullError) or is_disk_full(exc)):
                raise
            return False
        self._count(pruned=num_pruned)
        return num_pruned > 0
