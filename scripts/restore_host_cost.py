"""What a disk restore costs the host per block, apart from the bytes.

Blocks of a small layout (32 KiB: reading and copying them is cheap) are written to a disk
tier; a fresh manager over it, with an empty host tier, then loads them the way a restore
does: groups of `--group` blocks from the tail backward, `--window` groups in flight,
polled and completed as they land, while the I/O threads read. Reports the wall time per
block, the engine thread's CPU time per block, and a profile of the engine thread.

    python3 scripts/restore_host_cost.py [--blocks 2048] [--group 8] [--window 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvtier.config import TierConfig  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.manager import TierManager  # noqa: E402
from tests.kvtier.manager_cases import chain, evict_gpu, random_blocks, write  # noqa: E402


def main() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.bfloat16)
    n = args.blocks
    with tempfile.TemporaryDirectory() as tmp:
        config = TierConfig.from_slots(layout, n + 8, n + 8, disk_path=Path(tmp) / "disk",
                                       num_disk_blocks=2 * n)
        metas = chain(layout, "doc", n)
        first = TierManager(layout, config)
        write(first, metas, random_blocks(layout, n, 0))
        first.flush()
        written = first.stats()
        first.close()
        m = TierManager(layout, config)
        try:
            m.drain()
            evict_gpu(m)
            blocks = m.allocate(n)
            assert blocks is not None
            profile = cProfile.Profile()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            thread0 = time.thread_time()
            if args.profile:
                profile.enable()
            top, in_flight, landed, done = n, [], 0, 0
            while done < n:
                while top > 0 and len(in_flight) < args.window:
                    start = max(0, top - args.group)
                    in_flight.append(m.prepare_load(metas[start:top], blocks[start:top],
                                                    split_reads=False, known_on_disk=True))
                    top = start
                m.poll()
                for load_id in [i for i in in_flight if m.is_load_ready(i, advance=False)]:
                    arrived = m.complete_load_blocks(load_id)
                    landed, done = landed + sum(arrived), done + len(arrived)
                    in_flight.remove(load_id)
                time.sleep(0.0005)
            if args.profile:
                profile.disable()
            wall = time.perf_counter() - wall0
            engine = time.thread_time() - thread0
            print(f"{n} blocks ({landed} landed): wall {wall * 1e3:.1f} ms "
                  f"({wall / n * 1e6:.1f} us/block), "
                  f"engine thread CPU {engine * 1e3:.1f} ms ({engine / n * 1e6:.1f} us/block), "
                  f"process CPU {(time.process_time() - cpu0) * 1e3:.1f} ms")
            if landed < n:
                print("not landed:", {t.value: c for t, c in m.stats().tiers.items()},
                      "writer:", written)
            if args.profile:
                pstats.Stats(profile).sort_stats("tottime").print_stats(20)
        finally:
            m.close()


if __name__ == "__main__":
    main()
