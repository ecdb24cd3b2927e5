"""Why pages of the disk tier's file survive a page-cache drop: `kvtier bench longctx` with,
after every drop, the kernel's counters (/proc/meminfo: Dirty, Writeback, Mapped,
Unevictable, Mlocked) and this process's mappings of data.mdb (/proc/self/smaps: Rss,
Locked) printed beside the share of the file still cached.

    python3 scripts/cold_drop_probe.py bench longctx --model random:llama3-8b ... --cold

drop_caches leaves dirty, mapped, locked and in-flight pages; the counters say which.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.cli import main as cli_main
from kvtier.cli.bench import longctx

MEMINFO_FIELDS = ("Cached", "Dirty", "Writeback", "Mapped", "Unevictable", "Mlocked")


def meminfo() -> dict[str, int]:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in MEMINFO_FIELDS:
            values[name] = int(rest.split()[0]) >> 10  # MiB
    return values


def mappings_of(path: Path) -> dict[str, int]:
    """Rss / Locked (kB) summed over this process's mappings of `path`."""
    totals = {"maps": 0, "Rss": 0, "Locked": 0}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path)
            totals["maps"] += inside
        elif inside and fields and fields[0].rstrip(":") in ("Rss", "Locked"):
            totals[fields[0].rstrip(":")] += int(fields[1])  # kB
    return totals


def main() -> None:
    measure = longctx.resident_fraction

    def reporting(path: Path) -> float | None:
        share = measure(path)
        print(f"after drop: {path.name} cached {share}, meminfo MiB {meminfo()}, "
              f"mapped here {mappings_of(path.resolve())}", file=sys.stderr, flush=True)
        return share

    longctx.resident_fraction = reporting
    sys.argv = ["kvtier", *sys.argv[1:]]
    cli_main.app()


if __name__ == "__main__":
    main()
