"""What a disk tier's lookup costs after a page-cache drop: the in-memory copy of its hashes
against a walk of LMDB's tree, and how long the copy takes to load on a cold start.

    python3 scripts/disk_lookup_probe.py --dir /tmp --blocks 6144 --block-kib 512 \
        --lookup 2048 --runs 3

Writes `--blocks` chained blocks of `--block-kib` KiB (a layout of that size) into a fresh
tier under `--dir`, reopens it, and per run: drops the page cache, times `contains` on the
first `--lookup` hashes of a chain (answered from memory), drops again, times the same
hashes through LMDB's tree, drops again and times a fresh open until the copy is loaded.
Needs root for the drops (says so and runs warm otherwise).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kvtier.cli.bench.diskread import drop_page_cache

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.record import metas_for


def layout_of(block_kib: int) -> KVLayout:
    # 32 layers x 2 KV heads x 16 tokens x 2 (K, V) x 2 bytes = 4 KiB per unit of head_dim
    return KVLayout(num_layers=32, num_kv_heads=2, head_dim=block_kib // 4,
                    block_size=16, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--blocks", type=int, default=6144)
    parser.add_argument("--block-kib", type=int, default=512)
    parser.add_argument("--lookup", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    layout = layout_of(args.block_kib)
    root = Path(tempfile.mkdtemp(prefix="kvtier-lookup-", dir=args.dir))
    try:
        chains = []
        payload = torch.zeros(layout.block_shape, dtype=layout.dtype)
        chain_len = args.lookup
        with DiskTier(root, layout, 1 << 42, durable=False) as tier:
            for chain in range((args.blocks + chain_len - 1) // chain_len):
                parent = namespace_hash(f"doc-{chain}", layout)
                token_ids = [(chain * 7 + i) % 50_000 for i in range(chain_len * 16)]
                metas = metas_for(parent, hash_blocks(parent, token_ids, 16), token_ids, 16)
                for start in range(0, chain_len, 64):
                    tier.put(metas[start:start + 64], [payload] * len(metas[start:start + 64]))
                chains.append([m.block_hash for m in metas])
        size_gib = (root / "data.mdb").stat().st_size / (1 << 30)
        print(f"{args.blocks} blocks of {args.block_kib} KiB, data.mdb {size_gib:.1f} GiB")
        memory, tree, loads = [], [], []
        for run in range(args.runs):
            hashes = chains[run % len(chains)]
            with DiskTier(root, layout, 1 << 42, durable=False) as tier:
                assert tier.keys_in_memory(wait=120), "the copy did not load"
                cold = drop_page_cache()
                began = time.perf_counter()
                assert all(tier.contains(hashes))
                memory.append(time.perf_counter() - began)
                drop_page_cache()
                with tier._map.txn() as txn:  # the walk `contains` did before the copy
                    began = time.perf_counter()
                    assert all(tier._index.has_many(txn, hashes))
                    tree.append(time.perf_counter() - began)
            drop_page_cache()
            began = time.perf_counter()
            with DiskTier(root, layout, 1 << 42, durable=False) as tier:
                assert tier.keys_in_memory(wait=120)
                loads.append(time.perf_counter() - began)
            print(f"run {run}: page cache {'dropped' if cold else 'NOT dropped (not root)'}; "
                  f"lookup of {len(hashes)} hashes: copy {memory[-1] * 1e3:.2f} ms, "
                  f"LMDB's tree {tree[-1] * 1e3:.1f} ms; cold open until loaded "
                  f"{loads[-1] * 1e3:.0f} ms")
        print(f"median: copy {statistics.median(memory) * 1e3:.2f} ms, tree "
              f"{statistics.median(tree) * 1e3:.1f} ms, cold open + load "
              f"{statistics.median(loads) * 1e3:.0f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
