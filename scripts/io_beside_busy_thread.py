"""Disk-tier writes and reads (warm, and cold where the page cache can be dropped) on four
I/O threads, alone and beside a thread that runs Python flat out (as the engine thread does
while it launches kernels), side by side in one run: writes with the copy-and-checksum done
in one call per block (as now) and in 256 KiB chunks (as before); reads of 8-block groups
with one preadv per run of neighbouring records (as now) and one per record (as before).
Prints MB/s and how fast the busy thread still ran.

    python3 scripts/io_beside_busy_thread.py [--switch-interval-ms 0.5] [--blocks 128]

Each time an I/O thread gives the GIL up (a long copy, a hash, a pread) it has to win it
back from the busy thread, which yields only at its switch interval: the number of such
releases per block, not the bytes, bounds the I/O threads beside a busy engine thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import kvtier.tiers.lmdb_value as lmdb_value
import numpy as np
import torch
import xxhash
from kvtier.cli.bench.diskread import drop_page_cache

import kvtier.tiers.record as record
from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import BlockMeta

LAYOUT = KVLayout(32, 8, 128, 16, torch.bfloat16)  # Llama-3-8B's 2 MiB blocks
WHOLE, RUN = record.copy_checksummed, lmdb_value.MAX_RUN_VALUES


def chunked(src, dest, chunk: int = 256 * 1024) -> int:
    """The earlier copy-and-checksum: 256 KiB at a time (two GIL releases per chunk)."""
    source = np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)
    target = np.frombuffer(memoryview(dest).cast("B"), dtype=np.uint8)
    hasher = xxhash.xxh3_64()
    for start in range(0, target.nbytes, chunk):
        part = target[start:start + chunk]
        np.copyto(part, source[start:start + chunk])
        hasher.update(part)
    return hasher.intdigest()


def spin(stop: threading.Event, counts: list[int]) -> None:
    count = 0
    while not stop.is_set():
        count += 1
    counts.append(count)


def timed(work, num_threads: int, busy: bool) -> tuple[float, float | None]:
    """Seconds for `work(k)` on threads k = 0..num_threads-1, and the busy thread's loops/s."""
    stop, counts = threading.Event(), []
    spinner = threading.Thread(target=spin, args=(stop, counts))
    if busy:
        spinner.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    stop.set()
    if busy:
        spinner.join()
    return seconds, counts[0] / seconds if counts else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--switch-interval-ms", type=float, default=0.5)
    parser.add_argument("--blocks", type=int, default=128, help="per thread")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    num_threads, num_blocks = 4, args.blocks
    payloads = [torch.randint(0, 255, (LAYOUT.bytes_per_block,), dtype=torch.uint8)
                for _ in range(32)]
    dests = [[torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(8)]
             for _ in range(num_threads)]
    _, alone = timed(lambda k: time.sleep(0.5), 1, busy=True)
    print(f"switch interval {args.switch_interval_ms} ms; busy thread alone "
          f"{alone / 1e6:.1f} M loops/s; before: copy and hash in 256 KiB chunks, one preadv "
          "per record; now: one copy and one hash, one preadv per run of records")
    total_mb = num_threads * num_blocks * LAYOUT.bytes_per_block / 1e6
    with tempfile.TemporaryDirectory(dir=args.dir) as path, \
            DiskTier(path, LAYOUT, 1 << 40) as disk:
        for busy in (False, True):
            for name, copy, run_values in (("before", chunked, 1),
                                           ("now", WHOLE, lmdb_value.MAX_RUN_VALUES)):
                record.copy_checksummed = copy
                lmdb_value.MAX_RUN_VALUES = run_values
                metas = [[BlockMeta(os.urandom(16), b"p" * 16, tuple(range(16)))
                          for _ in range(num_blocks)] for _ in range(num_threads)]

                def write(k: int, metas=metas) -> None:
                    for i in range(0, num_blocks, 32):
                        disk.put(metas[k][i:i + 32], payloads[:len(metas[k][i:i + 32])])

                def read(k: int, metas=metas) -> None:
                    for i in range(0, num_blocks, 8):
                        group = metas[k][i:i + 8]
                        assert all(disk.get_many_into(group, dests[k][:len(group)]))

                for what, work in (("write", write), ("read (warm)", read),
                                   ("read (cold)", read)):
                    if what == "read (cold)" and not drop_page_cache():
                        continue  # not root: no cold figure
                    seconds, loops = timed(work, num_threads, busy)
                    beside = f"; busy thread at {loops / alone:.2f}x" if busy else ""
                    print(f"{what:12s} {name:6s} {'beside a busy thread' if busy else 'alone':21s} "
                          f"{total_mb / seconds:7.0f} MB/s{beside}", flush=True)
                disk.delete([meta.block_hash for group in metas for meta in group])
    record.copy_checksummed, lmdb_value.MAX_RUN_VALUES = WHOLE, RUN


if __name__ == "__main__":
    main()
