"""What a benchmark run wrote to the disk tier, beside what the disk itself writes.

`raw_sequential_write` is the bar: a file written sequentially in large chunks, synced
(`fdatasync`) as often as the tier commits, on the same file system. `disk_writes` puts the
tier's ledger (`kvtier.store_ledger`: blocks written, skipped with their reasons, lost) next
to the GB/s it wrote at while it was writing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.stats import Direction, ManagerStats

#: Bytes per write call of the raw file, and bytes between two syncs (about an LMDB commit
#: of 32 blocks of an 8B model).
_CHUNK = 8 << 20
_SYNC_EVERY = 64 << 20


def raw_sequential_write(directory: str | os.PathLike[str], num_bytes: int) -> dict[str, Any]:
    """Sequential write bandwidth (GB/s, 1e9 bytes) of a `num_bytes` file in `directory`,
    synced every `_SYNC_EVERY` bytes and at the end; the file is removed afterwards.
    Raises OSError when the directory cannot take the file."""
    path = Path(directory) / "kvtier-raw-write.bin"
    num_bytes = max(_CHUNK, num_bytes // _CHUNK * _CHUNK)
    chunk = np.random.default_rng(0).integers(0, 255, _CHUNK, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        unsynced = 0
        for _ in range(num_bytes // _CHUNK):
            os.write(fd, chunk)
            unsynced += _CHUNK
            if unsynced >= _SYNC_EVERY:
                os.fdatasync(fd)
                unsynced = 0
        os.fdatasync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"bytes": num_bytes, "seconds": seconds, "gb_s": num_bytes / seconds / 1e9}


def disk_writes(stats: ManagerStats, raw: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The disk tier's ledger and write speed from an engine's stats (None without a disk
    tier): GB/s over the seconds it was writing, and its ratio to `raw`'s when given."""
    if stats.stores is None:
        return None
    ledger = stats.stores.as_dict()
    num_bytes = stats.transfers[Direction.HOST_TO_DISK].num_bytes
    busy = stats.stores.write_busy_s
    gb_s = num_bytes / busy / 1e9 if busy > 0 else None
    return {**ledger, "bytes_written": num_bytes, "write_gb_s": gb_s,
            "raw_write_gb_s": None if raw is None else raw["gb_s"],
            "write_vs_raw": None if raw is None or gb_s is None else gb_s / raw["gb_s"]}
