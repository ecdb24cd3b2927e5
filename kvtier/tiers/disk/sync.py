"""When a disk tier that does not sync each commit puts its writes on the disk.

Without per-commit syncs the OS writes dirty pages back when it likes, so an OS crash or a
power loss may lose whatever it still holds (a process crash loses nothing: the pages are
the kernel's). `WriteSync` bounds that: once `every_bytes` have been written since the last
sync, a thread of its own syncs the environment, so no writer ever waits for the flush; and
`sync_now` syncs on the caller's thread, for a flush or a close that must leave everything on
the disk.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import lmdb

from kvtier.tiers.disk.index import DiskFilesGone

logger = logging.getLogger(__name__)


class WriteSync:
    """Runs `sync` (flush what was committed to the disk) in the background once
    `every_bytes` bytes were written since the last sync began, and on demand.

    `wrote(num_bytes)` is called by writers after their commits and never waits: at most
    one sync is asked for at a time, on a thread started at the first one. `num_syncs`
    counts finished syncs (background and on demand). A failed background sync is logged
    and the next one tried as usual: the blocks stay readable from the page cache, and a
    block the OS then fails to write back fails its checksum when read (a miss).
    Thread-safe. Raises ValueError for a non-positive `every_bytes`.
    """

    def __init__(self, sync: Callable[[], None], every_bytes: int, *, name: str) -> None:
        if isinstance(every_bytes, bool) or not isinstance(every_bytes, int) \
                or every_bytes <= 0:
            raise ValueError(f"sync_every_bytes must be a positive integer, got {every_bytes!r}")
        self._sync = sync
        self.every_bytes = every_bytes
        self._name = name
        self._cond = threading.Condition()
        self._unsynced = 0  # bytes written since the last sync began
        self._wanted = False
        self._closed = False
        self._num_syncs = 0
        self._thread: threading.Thread | None = None

    @property
    def num_syncs(self) -> int:
        """Syncs that finished, in the background or through `sync_now`."""
        with self._cond:
            return self._num_syncs

    def wrote(self, num_bytes: int) -> None:
        """Count `num_bytes` committed; ask the thread for a sync once `every_bytes` are
        unsynced. Never waits for a sync."""
        with self._cond:
            if self._closed:
                return
            self._unsynced += num_bytes
            if self._unsynced < self.every_bytes or self._wanted:
                return
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def sync_now(self) -> None:
        """Sync on the caller's thread: what was committed before the call is on the disk
        when it returns. Raises as `sync` does."""
        with self._cond:
            self._unsynced = 0
        self._sync()
        with self._cond:
            self._num_syncs += 1

    def close(self) -> None:
        """Stop the thread, after the sync it is running. Idempotent; `sync_now` still
        works afterwards (a close's last sync)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._wanted = False
                # Bytes committed from here on count toward the next sync (this one may or
                # may not include them).
                self._unsynced = 0
            try:
                self._sync()
            except (DiskFilesGone, ValueError):
                return  # set aside or closed: nothing left to sync
            except (OSError, lmdb.Error) as exc:
                logger.warning("%s: syncing the disk cache failed (%s); its recent blocks "
                               "stay in the page cache until the OS writes them", self._name,
                               exc)
                continue
            with self._cond:
                self._num_syncs += 1
