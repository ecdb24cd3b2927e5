"""The engine's replica of a disk worker's copies of the stored hashes: lookups that never
leave the engine's process.

A disk tier in the engine's process answers a lookup from its in-memory copy of the stored
hashes in microseconds (`kvtier.tiers.disk.keys`). Asking a worker process instead is a
round trip (0.1-0.2 ms on an idle machine, more beside a busy model), and an engine looks
up every step. So the worker sends every change of each shard's copy (`KeyEvent`: loaded,
dropped, changed by a commit, found current), in order, and `KeyReplica` replays them.
A lookup is answered here while every shard's copy is loaded and was found current within
`fresh_s` (the worker checks every half of it); otherwise the caller asks the worker.

Like every lookup it is a hint: a read validates what it finds, so a stale answer costs a
block computed instead of read, never a wrong block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvtier.hashing import BlockHash
from kvtier.tiers.disk.key_changes import KeyChanges
from kvtier.tiers.disk.keys import KeyEvent
from kvtier.tiers.disk.shard_layout import shard_of


class KeyReplica:
    """The stored hashes of `num_shards` shards as their worker's events tell them.
    Thread-safe: events arrive on the reply thread, lookups come from the engine's."""

    def __init__(self, num_shards: int, fresh_s: float) -> None:
        self.num_shards, self.fresh_s = num_shards, fresh_s
        self._lock = threading.Lock()
        # Per shard: hash -> packed spot, as the worker's copy holds them (spots unused here).
        self._keys: list[dict[BlockHash, int] | None] = [None] * num_shards
        self._current_at: list[float | None] = [None] * num_shards

    def apply(self, shard: int, event: KeyEvent) -> None:
        """Replay one event of shard `shard`'s copy."""
        kind, payload = event
        with self._lock:
            keys = self._keys[shard]
            if kind == "loaded":
                assert isinstance(payload, list)
                self._keys[shard], self._current_at[shard] = dict.fromkeys(payload, 0), None
            elif kind == "dropped":
                self._keys[shard], self._current_at[shard] = None, None
            elif kind == "changed" and keys is not None:
                assert isinstance(payload, KeyChanges)
                payload.apply_to(keys)
            elif kind == "current" and keys is not None:
                self._current_at[shard] = time.monotonic()

    def clear(self) -> None:
        """Forget every shard's copy (the worker is gone): lookups go to the caller."""
        with self._lock:
            self._keys = [None] * self.num_shards
            self._current_at = [None] * self.num_shards

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[bool] | None:
        """Whether each hash is stored, while every shard's copy is loaded and was found
        current within `fresh_s`; None otherwise (ask the worker)."""
        oldest = time.monotonic() - self.fresh_s
        with self._lock:
            if any(at is None or at < oldest for at in self._current_at):
                return None
            shards = self._keys
            if self.num_shards == 1:
                keys = shards[0]
                assert keys is not None, "a current copy is loaded"
                return [h in keys for h in block_hashes]
            return [h in shards[shard_of(h, self.num_shards)]  # type: ignore[operator]
                    for h in block_hashes]
