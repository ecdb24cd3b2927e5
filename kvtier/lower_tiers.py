"""The tiers below the host (disk, remote) as far as reading their own stats goes: those read
LMDB or the remote tier's counters, so they may be taken on any thread (a metrics scrape's
worker rather than the engine's), and closing the tiers waits for a read under way."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvtier.tiers.disk import DiskStats, DiskTier

if TYPE_CHECKING:
    from kvtier.tiers.remote import RemoteStats, RemoteTier

#: (the disk tier's stats, the remote tier's), each None when that tier is off or closed.
LowerTierStats = tuple["DiskStats | None", "RemoteStats | None"]


class LowerTiers:
    """The disk and remote tiers of one manager (each None when off), closed once."""

    def __init__(self, disk: DiskTier | None, remote: RemoteTier | None) -> None:
        self.disk, self.remote = disk, remote
        self._closed = False
        self._lock = threading.Lock()  # orders stats reads before the close

    def stats(self) -> LowerTierStats:
        """(the disk tier's stats, the remote tier's), each None when that tier is off, both
        None once closed. Safe on any thread."""
        with self._lock:
            if self._closed:
                return None, None
            return (self.disk.stats() if self.disk is not None else None,
                    self.remote.stats() if self.remote is not None else None)

    def close(self) -> None:
        """Close both tiers, after any stats read under way. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self.disk is not None:
                self.disk.close()
            if self.remote is not None:
                self.remote.close()
            self._closed = True
