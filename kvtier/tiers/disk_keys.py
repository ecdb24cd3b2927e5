"""This process's copy of the block hashes a disk tier holds: lookups that read no pages.

A lookup in LMDB walks the tree's pages, and after the page cache has dropped them each page
is a read from the disk on the caller's thread: 0.1-0.28 s for the 2,048 hashes of a 32K-token
prefix on the lent H100, with the GPU idle behind it. So the disk tier keeps the set of its
stored hashes in memory, tagged with the directory's key generation, a counter in LMDB that
every commit adding or removing a block bumps, whichever process makes it
(`LmdbIndex.key_generation`). A lookup reads the generation (one small page) and, when it
equals the copy's, answers from the copy. When another process has written since, or the
copy is still loading, LMDB answers and the copy is loaded again in the background.

The copy is a hint like every lookup: a read validates the value it finds, so a stale answer
costs a block computed instead of read, never a wrong block. Memory: about 100 bytes a block
(a million blocks, 2 TB of an 8B model's KV, take about 100 MB).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.hashing import BlockHash


@dataclass(slots=True)
class KeyChanges:
    """What one write transaction did to the set of stored hashes, in order: `cleared`, it
    first removed every block; then each `(hash, stored)` in `steps` added (True) or removed
    (False) one."""

    steps: list[tuple[BlockHash, bool]] = field(default_factory=list)
    cleared: bool = False

    def added(self, block_hash: bytes) -> None:
        self.steps.append((BlockHash(bytes(block_hash)), True))

    def removed(self, block_hash: bytes) -> None:
        self.steps.append((BlockHash(bytes(block_hash)), False))

    def clear(self) -> None:
        self.steps.clear()
        self.cleared = True

    def apply_to(self, keys: set[BlockHash]) -> None:
        if self.cleared:
            keys.clear()
        for block_hash, stored in self.steps:
            if stored:
                keys.add(block_hash)
            else:
                keys.discard(block_hash)


class DiskKeySet:
    """The hashes stored at one key generation, kept current by this process's own commits.

    Thread-safe. States: not loaded (`generation` None; lookups return None), loaded at a
    generation (lookups at that generation are answered). `committed` moves a loaded copy
    forward when this process's commit started at its generation, and drops it otherwise (a
    commit of another process came between). A load takes a snapshot in a read transaction;
    this process's commits during the load are replayed onto it in `install`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[BlockHash] = set()
        self._generation: int | None = None
        self._replay: list[tuple[int, int, KeyChanges]] | None = None  # while loading

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
            keys = self._keys
            return [h in keys for h in block_hashes]

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

    def start_load(self) -> bool:
        """Begin a load unless one runs; True when the caller should load (then call
        `install` or `abandon_load`). From now on this process's commits are kept for
        replay."""
        with self._lock:
            if self._replay is not None:
                return False
            self._replay = []
            return True

    def install(self, generation: int, keys: Iterable[BlockHash]) -> bool:
        """Adopt the snapshot `keys` read at `generation`, with the commits made since it
        began replayed; False (copy left unloaded) when another process's commit came in
        between."""
        with self._lock:
            replay, self._replay = self._replay or [], None
            loaded = set(keys)
            for before, after, changes in replay:
                if after <= generation:
                    continue  # in the snapshot already
                if before != generation:
                    self._drop()
                    return False
                changes.apply_to(loaded)
                generation = after
            self._keys, self._generation = loaded, generation
            return True

    def abandon_load(self) -> None:
        """End a load that failed or was stopped; the copy stays as it was."""
        with self._lock:
            self._replay = None

    def _drop(self) -> None:
        self._keys, self._generation = set(), None
