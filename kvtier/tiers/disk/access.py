"""The disk tier's access order: reads mark blocks as used, and the marks reach LMDB's LRU
order (`LmdbIndex.touch`) in batches, with the next write transaction or in one of their
own once enough are pending. The order is advisory: marks that find no room are dropped."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import lmdb

from kvtier.hashing import BlockHash
from kvtier.tiers.disk.index import GuardedEnv, LmdbIndex, is_disk_full

logger = logging.getLogger(__name__)


class PendingTouches:
    """Blocks used since the last write of the access order, oldest first, a use moving a
    block to the end; thread-safe. `flush_every`: how many make `add` ask for a write."""

    def __init__(self, flush_every: int) -> None:
        self.flush_every = flush_every
        self._lock = threading.Lock()
        self._hashes: dict[BlockHash, None] = {}

    def add(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Mark blocks as just used; True when `flush_every` are pending."""
        with self._lock:
            for block_hash in block_hashes:
                self._hashes.pop(block_hash, None)
                self._hashes[block_hash] = None
            return len(self._hashes) >= self.flush_every

    def take(self) -> list[BlockHash]:
        """The pending blocks, oldest use first; none are pending afterwards."""
        with self._lock:
            hashes = list(self._hashes)
            self._hashes.clear()
        return hashes


def touch_in(index: LmdbIndex, txn: lmdb.Transaction, block_hashes: list[BlockHash]) -> None:
    """Record uses of the blocks still stored, inside the write transaction `txn`."""
    index.touch(txn, [h for h in block_hashes if index.has(txn, h)])


def write_touches(env: GuardedEnv, index: LmdbIndex, block_hashes: list[BlockHash],
                  path: str | os.PathLike[str]) -> None:
    """Record uses in a write transaction of their own. When the map is full and cannot
    grow, or the disk refuses the commit, they are dropped (logged) rather than failing the
    read or close that asked for them."""
    if not block_hashes:
        return
    for _ in range(2):
        try:
            with env.txn(write=True) as txn:
                touch_in(index, txn, block_hashes)
            return
        except lmdb.MapFullError:
            if not env.grow(len(block_hashes) * 256, full=True):
                break
        except lmdb.Error as exc:
            if not is_disk_full(exc):
                raise
            break
    logger.info("disk cache %s: no room to record %d accesses; dropped them", path,
                len(block_hashes))
