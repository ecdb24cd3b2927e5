"""How a disk tier directory is laid out over shards: their names, their count, and which
shard holds a block (`kvtier.tiers.disk.shards` has the tier that uses them).

A sharded directory holds `shard-<i>-of-<n>` directories, each a whole `DiskTier`
directory; one with data.mdb at its root is one environment (the layout before shards).
The name carries the count, so a directory opens with the count it was written with.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvtier.hashing import BlockHash

#: Shards of a new disk tier directory of at least `SHARDING_BUDGET_BYTES` unless set
#: (`EngineConfig.disk_shards`, `kvtier cache import --shards`): LMDB commits one write
#: transaction at a time per environment, so several take a long prefill's blocks side by
#: side (docs/BENCHMARKS.md, "The disk tier's writers", says how much).
LARGE_BUDGET_SHARDS = 4
#: Budgets below this get one environment: a quarter of a small budget would evict early,
#: and nothing fills a small tier fast enough to need a second writer.
SHARDING_BUDGET_BYTES = 4 << 30
#: The most shards a directory may have (each holds two files and a writer thread).
MAX_SHARDS = 64
_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")


def default_shards(budget_bytes: int) -> int:
    """Shards of a new directory of `budget_bytes` when none are asked for."""
    return LARGE_BUDGET_SHARDS if budget_bytes >= SHARDING_BUDGET_BYTES else 1


def shard_name(index: int, count: int) -> str:
    """The directory name of shard `index` of `count`."""
    return f"shard-{index}-of-{count}"


def shard_of(block_hash: BlockHash, count: int) -> int:
    """The shard of `count` that holds `block_hash` (its last eight bytes, modulo)."""
    return int.from_bytes(block_hash[-8:], "little") % count


def existing_shards(root: str | os.PathLike[str]) -> int | None:
    """How many shards the disk tier directory `root` was written with: 1 for one
    environment at its root (data.mdb there), n for `shard-<i>-of-<n>` directories, None
    when it holds neither (new, or empty). Raises ValueError for a mix of layouts, counts
    that disagree, or missing shards: guessing would strand or misplace blocks."""
    root = Path(root)
    if not root.is_dir():
        return None
    counts: dict[int, set[int]] = {}
    for entry in os.listdir(root):
        match = _SHARD_DIR.fullmatch(entry)
        if match and (root / entry).is_dir():
            counts.setdefault(int(match[2]), set()).add(int(match[1]))
    single = os.path.lexists(root / "data.mdb")
    if not counts:
        return 1 if single else None
    if single or len(counts) > 1:
        found = ", ".join(f"{n} shards" for n in sorted(counts)) + (", data.mdb" if single
                                                                   else "")
        raise ValueError(f"disk cache {root} mixes layouts ({found}); move the extra files "
                         "away or clear it (`kvtier cache clear`)")
    (count, present), = counts.items()
    missing = sorted(set(range(count)) - present)
    if missing:
        raise ValueError(f"disk cache {root} lacks shard directories "
                         f"{', '.join(shard_name(i, count) for i in missing)}; restore them "
                         "or clear the cache (`kvtier cache clear`)")
    return count


def shard_dirs(root: str | os.PathLike[str], count: int) -> list[Path]:
    """The directories of `root`'s `count` shards, in shard order (`[root]` for one)."""
    root = Path(root)
    if count == 1:
        return [root]
    return [root / shard_name(i, count) for i in range(count)]


def check_shard_count(count: object) -> int:
    """`count` as a number of shards; ValueError saying what is allowed otherwise."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"a disk tier has 1 to {MAX_SHARDS} shards, got {count!r}")
    return count
