"""This process's copy of the block hashes a disk tier holds: lookups that read no pages.

A lookup in LMDB walks the tree's pages, and after the page cache has dropped them each page
is a read from the disk on the caller's thread, with the GPU idle behind it, for every block
of a long prefix (docs/ARCHITECTURE.md, "Disk reads by pread"). So the disk tier keeps the
set of its stored hashes in memory, tagged with the directory's key generation, a counter in
LMDB that every commit adding or removing a block bumps, whichever process makes it
(`LmdbIndex.key_generation`). A lookup reads the generation (one small page) and, when it
equals the copy's, answers from the copy. When another process has written since, or the
copy is still loading, LMDB answers and the copy is loaded again in the background. For a
short while after a lookup found the copy current (`DiskTier`'s `keys_fresh_s`) lookups
skip even that read and answer on the caller's thread: an engine looks up every step, and
each read of the generation is a hop to the tier's lookup thread (the deadline guards the
engine against a stalled disk), two GIL handoffs behind busy I/O threads. Another
process's commits are then seen that much later.

The copy is a hint like every lookup: a read validates the value it finds, so a stale answer
costs a block computed instead of read, never a wrong block.

The copy also keeps where each value lay (its first overflow page and length, read from the
leaf node), so that a read goes there without a tree lookup: after a dropped page cache each
lookup is a page read from the disk, made holding the GIL. A place is a hint as well: the
read checks the page and the record, and looks the block up afresh when they are not it
(`kvtier.tiers.disk.read`). Memory: about 135 bytes a block (a million blocks, 2 TB of an
8B model's KV, take about 135 MB).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import lmdb

from kvtier.hashing import BlockHash
from kvtier.tiers.disk.index import GuardedEnv, LmdbIndex
from kvtier.tiers.disk.key_changes import KeyChanges, pack_spot, unpack_spot
from kvtier.tiers.disk.lmdb_keys import read_keys
from kvtier.tiers.disk.lmdb_value import ValueSpot

logger = logging.getLogger(__name__)

# Leaf pages (about 120 hashes each) read per transaction when loading the copy.
_SCAN_LEAVES = 64


#: What a `DiskKeySet` tells its watcher, in the order it happens to the copy:
#: ("loaded", [hashes]) the copy now holds exactly these; ("dropped", None) it holds nothing;
#: ("changed", KeyChanges) a commit's changes were applied to it; ("current", None) a lookup
#: found it at the stored generation.
KeyEvent = tuple[str, object]


class DiskKeySet:
    """The hashes stored at one key generation, kept current by this process's own commits.

    Thread-safe. States: not loaded (`generation` None; lookups return None), loaded at a
    generation (lookups at that generation are answered). `committed` moves a loaded copy
    forward when this process's commit started at its generation, and drops it otherwise (a
    commit of another process came between). A load takes a snapshot in a read transaction;
    this process's commits during the load are replayed onto it in `install`. A watcher
    (`watch`) is told every change of the copy (`KeyEvent`), in order, under the copy's lock:
    how a disk worker keeps the engine's process a replica of it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[BlockHash, int] = {}  # hash -> packed spot of its value (0: unknown)
        self._generation: int | None = None
        self._replay: list[tuple[int, int, KeyChanges]] | None = None  # while loading
        # When a lookup last found the copy at the stored generation (monotonic seconds).
        self._confirmed_at: float | None = None
        self._watcher: Callable[[KeyEvent], None] | None = None

    def watch(self, watcher: Callable[[KeyEvent], None]) -> None:
        """Tell `watcher` the copy as it is now ("loaded" or "dropped"), then every change
        of it. It runs under the copy's lock: it must not call back into this object."""
        with self._lock:
            self._watcher = watcher
            watcher(("loaded", list(self._keys)) if self._generation is not None
                    else ("dropped", None))

    def _tell(self, event: KeyEvent) -> None:
        if self._watcher is not None:  # the caller holds the lock
            self._watcher(event)

    @property
    def generation(self) -> int | None:
        """The key generation the copy is at; None while it is not loaded."""
        with self._lock:
            return self._generation

    def lookup(self, generation: int, block_hashes: Sequence[BlockHash]) -> list[bool] | None:
        """Whether each hash is stored, if the copy is at `generation` (the stored one, read
        by the caller); None otherwise."""
        with self._lock:
            if self._generation != generation:
                return None
            self._confirmed_at = time.monotonic()
            self._tell(("current", None))
            return self._stored(block_hashes)

    def confirm(self, generation: int) -> bool:
        """Whether the copy is at `generation` (the stored one, read by the caller); a
        lookup after it may answer from the copy for a while (`lookup_recent`)."""
        with self._lock:
            if self._generation != generation:
                return False
            self._confirmed_at = time.monotonic()
            self._tell(("current", None))
            return True

    def lookup_recent(self, block_hashes: Sequence[BlockHash],
                      max_age_s: float) -> list[bool] | None:
        """Whether each hash is stored, if a `lookup` found the copy current at most
        `max_age_s` ago and it is still loaded (this process's commits keep it current);
        None otherwise. Reads nothing of LMDB."""
        with self._lock:
            confirmed = self._confirmed_at
            if self._generation is None or confirmed is None \
                    or time.monotonic() - confirmed > max_age_s:
                return None
            return self._stored(block_hashes)

    def _stored(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        keys = self._keys  # the caller holds the lock
        return [h in keys for h in block_hashes]

    def spots(self, block_hashes: Sequence[BlockHash]) -> list[ValueSpot | None]:
        """Where each block's value lay when last seen (None: not known), at any generation:
        a hint for a read, which checks what it finds there."""
        with self._lock:
            keys = self._keys
            return [unpack_spot(keys.get(h, 0)) for h in block_hashes]

    def committed(self, before: int, after: int, changes: KeyChanges) -> None:
        """Record this process's commit that moved the generation from `before` to `after`.
        Called in commit order (the caller holds a lock across its write transactions)."""
        if before == after:
            return
        with self._lock:
            if self._replay is not None:
                self._replay.append((before, after, changes))
            if self._generation is None:
                return
            if self._generation != before:
                self._drop()
                return
            changes.apply_to(self._keys)
            self._generation = after
            self._tell(("changed", changes))

    def start_load(self) -> bool:
        """Begin a load unless one runs; True when the caller should load (then call
        `install` or `abandon_load`). From now on this process's commits are kept for
        replay."""
        with self._lock:
            if self._replay is not None:
                return False
            self._replay = []
            return True

    def install(self, generation: int, keys: Iterable[tuple[BlockHash, int]]) -> bool:
        """Adopt the snapshot `keys` (hash, packed spot) read at `generation`, with the
        commits made since it began replayed; False (copy left unloaded) when another
        process's commit came in between."""
        with self._lock:
            replay, self._replay = self._replay or [], None
            loaded = dict(keys)
            for before, after, changes in replay:
                if after <= generation:
                    continue  # in the snapshot already
                if before != generation:
                    self._drop()
                    return False
                changes.apply_to(loaded)
                generation = after
            self._keys, self._generation, self._confirmed_at = loaded, generation, None
            self._tell(("loaded", list(loaded)))
            return True

    def abandon_load(self) -> None:
        """End a load that failed or was stopped; the copy stays as it was."""
        with self._lock:
            self._replay = None

    def _drop(self) -> None:
        self._keys, self._generation, self._confirmed_at = {}, None, None
        self._tell(("dropped", None))


class StoredKeys:
    """A disk tier's lookups, answered from a `DiskKeySet` while it is current, and its
    write transactions, whose changes reach the copy in commit order.

    `data_fd()` opens (once) the data file the copy is loaded from with `pread`; `path`
    names the directory in log lines. `start_load` loads the copy in a background thread;
    `close` stops a load and waits for it.
    """

    def __init__(self, env: GuardedEnv, index: LmdbIndex, data_fd: Callable[[], int],
                 page_size: int, path: str | os.PathLike[str]) -> None:
        self._env, self._index, self._data_fd = env, index, data_fd
        self._page_size, self._path = page_size, path
        self._keys = DiskKeySet()
        # Held across each write transaction of this process and the update of the copy
        # that follows it, so that updates reach the copy in commit order.
        self._write_lock = threading.Lock()
        self._loader: threading.Thread | None = None
        self._closing = threading.Event()

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each hash is stored: from the copy when it is at the stored generation,
        else from LMDB's tree (and the copy is loaded again in the background)."""
        with self._env.txn() as txn:
            found = self._keys.lookup(self._index.key_generation(txn), block_hashes)
            if found is not None:
                return found
            found = self._index.has_many(txn, block_hashes)
        # While this process commits, the copy lags LMDB until the commit's changes reach it.
        if not self._write_lock.locked():
            self.start_load()
        return found

    def contains_recent(self, block_hashes: Sequence[BlockHash],
                        max_age_s: float) -> list[bool] | None:
        """`contains` from the copy alone, without a transaction, while a lookup found it
        current within `max_age_s` (`DiskKeySet.lookup_recent`); None otherwise."""
        return self._keys.lookup_recent(block_hashes, max_age_s)

    def in_memory(self, wait: float = 0.0) -> bool:
        """Whether the copy is at the stored key generation, waiting up to `wait` seconds for
        it to load (a load starts when it is behind)."""
        deadline = time.monotonic() + wait
        while True:
            if self._env.closed:
                return False
            with self._env.txn() as txn:
                if self._keys.confirm(self._index.key_generation(txn)):
                    return True
            self.start_load()
            loader = self._loader
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if loader is not None:
                loader.join(min(left, 0.05))
            else:
                time.sleep(min(left, 0.01))

    def spots(self, block_hashes: Sequence[BlockHash]) -> list[ValueSpot | None]:
        """Where each block's value lay when the copy last saw it (`DiskKeySet.spots`)."""
        return self._keys.spots(block_hashes)

    def watch(self, watcher: Callable[[KeyEvent], None]) -> None:
        """`DiskKeySet.watch` on the copy."""
        self._keys.watch(watcher)

    @contextmanager
    def write(self) -> Iterator[tuple[lmdb.Transaction, KeyChanges]]:
        """A write transaction, and the record of the blocks it adds and removes (pass it to
        `LmdbIndex`), which reaches the copy once the transaction commits."""
        changes = KeyChanges()
        with self._write_lock:
            with self._env.txn(write=True) as txn:
                before = self._index.key_generation(txn)
                yield txn, changes
                after = self._index.key_generation(txn)
            self._keys.committed(before, after, changes)

    def start_load(self) -> None:
        """Load the copy in a background thread, unless a load runs or the keys close."""
        if self._closing.is_set() or not self._keys.start_load():
            return
        loader = threading.Thread(target=self._load, name="kvtier-disk-keys", daemon=True)
        self._loader = loader
        loader.start()

    def close(self) -> None:
        """Stop a load under way and wait for it; no load starts afterwards."""
        self._closing.set()
        loader = self._loader
        if loader is not None:
            loader.join()

    def _load(self) -> None:
        """Read every stored hash and install them with the key generation read before the
        first (`DiskKeySet.install` replays this process's commits made meanwhile; another
        process's commits leave the copy unloaded). The tree is read with pread, never
        through the map (`kvtier.tiers.disk.lmdb_keys`), a chunk of leaf pages per transaction:
        a map resize, which waits for every open transaction, waits for one chunk."""
        began = time.perf_counter()
        generation: int | None = None
        entries: list[tuple[BlockHash, int]] = []
        try:
            fd = self._data_fd()
            done = False
            while not done and not self._closing.is_set():
                with self._env.txn() as txn:
                    if generation is None:
                        generation = self._index.key_generation(txn)
                    after = entries[-1][0] if entries else None
                    chunk, done = read_keys(fd, self._page_size,
                                            self._index.blocks_record(txn), after,
                                            _SCAN_LEAVES)
                entries += [(BlockHash(key), pack_spot(page, size) if page else 0)
                            for key, page, size in chunk]
        except (lmdb.Error, OSError, ValueError) as exc:  # closed, or the file misread
            logger.info("disk cache %s: lookups stay on LMDB (%s)", self._path, exc)
            generation = None
        if generation is None or self._closing.is_set():
            self._keys.abandon_load()
        elif self._keys.install(generation, entries):
            logger.debug("disk cache %s: %d block hashes in memory after %.3f s", self._path,
                         len(entries), time.perf_counter() - began)
