"""Does sharing one file descriptor between the I/O threads cost the disk tier's cold reads?

The disk tier reads `data.mdb` through one descriptor that every I/O thread shares, so the
kernel keeps one readahead state for all of them: each thread's read of a 16 MiB group
looks, to it, like a jump from another thread's. `raw_sequential_read`, the bar the tier is
held to, opens one descriptor per thread. This probe writes one document's blocks (a chain
of 2 MiB Llama-3-8B blocks, in write transactions of 32 as write-backs store them) to a
fresh tier and reads it back cold as a restore does (`disk_tier_read`, order "document":
groups of 8 from the tail backward, 4 threads), with the tier's descriptor:

  * shared: as the tier does it;
  * shared_seq: shared, with POSIX_FADV_SEQUENTIAL on it;
  * per_thread: one descriptor per reading thread;
  * per_thread_seq: that, with POSIX_FADV_SEQUENTIAL on each;
  * a suffix _g<N> reads in groups of N blocks instead of 8, _t<N> on N threads instead
    of 4 (e.g. shared_g16, shared_t8, shared_g4_t8); _fresh reads into destination buffers
    never written before (`disk_tier_read(resident=False)`, as the bench did until then).

Each round reads with every variant and then the raw file; medians over the rounds.

    python3 scripts/disk_fd_probe.py [--doc-blocks 65,513,2049] [--rounds 3] [--dir .]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import threading
from pathlib import Path

import torch
from kvtier.cli.bench.diskread import disk_tier_read, raw_sequential_read, write_chain

from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier

VARIANTS = ("shared", "shared_seq", "per_thread", "per_thread_seq", "shared_g16", "shared_t8")


def variant_option(variant: str, letter: str, default: int) -> int:
    """The N of a `_<letter><N>` suffix of `variant`, else `default`."""
    found = re.search(rf"_{letter}(\d+)", variant)
    return int(found.group(1)) if found else default


def data_file_opener(variant: str, opened: list[int]):
    """A replacement for `DiskTier._data_file` giving `variant`'s descriptor."""
    local = threading.local()
    shared: dict[str, int] = {}
    sequential = "_seq" in variant

    def open_one(tier: DiskTier) -> int:
        fd = os.open(tier.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
        if sequential:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        opened.append(fd)
        return fd

    def data_file(tier: DiskTier) -> int:
        if variant.startswith("shared"):
            if "fd" not in shared:
                shared["fd"] = open_one(tier)
            return shared["fd"]
        if not hasattr(local, "fd"):
            local.fd = open_one(tier)
        return local.fd

    return data_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-blocks", default="65,513,2049")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16)
    original = DiskTier._data_file
    summary = []
    for num_blocks in [int(n) for n in args.doc_blocks.split(",")]:
        with tempfile.TemporaryDirectory(prefix="kvtier-fdprobe-", dir=args.dir) as scratch:
            path = Path(scratch) / "kv"
            write_chain(path, layout, num_blocks)
            variants = args.variants.split(",")
            gb_s: dict[str, list[float]] = {v: [] for v in variants}
            gb_s["raw_best"] = []
            for round_index in range(args.rounds):
                for variant in variants:
                    opened: list[int] = []
                    DiskTier._data_file = data_file_opener(variant, opened)
                    try:
                        result = disk_tier_read(path, layout,
                                                threads=variant_option(variant, "t", 4),
                                                group_blocks=variant_option(variant, "g", 8),
                                                max_blocks=num_blocks,
                                                order="document",
                                                resident="_fresh" not in variant)
                    finally:
                        DiskTier._data_file = original
                        for fd in opened:
                            os.close(fd)
                    assert result["verified"] == num_blocks, result
                    assert result["cold"], "the page cache could not be dropped (needs root)"
                    gb_s[variant].append(result["gb_s"])
                raw = raw_sequential_read(scratch, num_blocks * layout.bytes_per_block)
                gb_s["raw_best"].append(raw["best_gb_s"])
                raw_rates = {k: v for k, v in raw.items() if k.endswith("gb_s")}
                print(f"{num_blocks} blocks, round {round_index}: "
                      + ", ".join(f"{k} {v[-1]:.2f}" for k, v in gb_s.items())
                      + f" (raw: {json.dumps(raw_rates)})", flush=True)
            medians = {k: statistics.median(v) for k, v in gb_s.items()}
            row = {"blocks": num_blocks, "gb_s": medians,
                   "vs_raw": {v: medians[v] / medians["raw_best"] for v in variants},
                   "runs": gb_s}
            summary.append(row)
            print(json.dumps({k: row[k] for k in ("blocks", "gb_s", "vs_raw")}), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
