"""What a benchmark run wrote to the disk tier, beside what the disk itself writes.

`raw_sequential_write` is the bar: a file written sequentially in large chunks, synced
(`fdatasync`) as often as the tier commits, on the same file system. `disk_writes` puts the
tier's ledger (`kvtier.store_ledger`: blocks written, skipped with their reasons, lost) next
to the GB/s it wrote at while it was writing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtier.cli.bench.diskread import write_raw_file

from kvtier.stats import Direction, ManagerStats

#: Bytes between two syncs of the raw file (about an LMDB commit of 32 blocks of an 8B
#: model).
_SYNC_EVERY = 64 << 20


def raw_sequential_write(directory: str | os.PathLike[str], num_bytes: int) -> dict[str, Any]:
    """Sequential write bandwidth (GB/s, 1e9 bytes) of a `num_bytes` file in `directory`,
    synced every `_SYNC_EVERY` bytes and at the end; the file is removed afterwards.
    Raises OSError when the directory cannot take the file."""
    path = Path(directory) / "kvtier-raw-write.bin"
    try:
        num_bytes, seconds = write_raw_file(path, num_bytes, sync_every=_SYNC_EVERY)
    finally:
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
