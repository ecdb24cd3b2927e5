"""Builders shared by the DiskTier tests: two layouts (one with blocks big enough for LMDB's
overflow pages), seeded chained blocks, record sizes, byte-exact reads, and a runner that
calls functions in forked child processes.
"""

from __future__ import annotations

import multiprocessing
import traceback

import torch

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_header, metas_for

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float16)
# 32 KiB blocks: LMDB stores them on overflow pages, like real blocks.
LARGE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
BIG_BUDGET = 1 << 30


def make_blocks(layout: KVLayout, seed: int, num_blocks: int
                ) -> tuple[list[BlockMeta], list[torch.Tensor]]:
    """`num_blocks` chained blocks of one sequence with seeded random K/V, `[*block_shape]`."""
    parent = namespace_hash(f"model-{seed}", layout)
    token_ids = [(seed * 7919 + 31 * i) % 50_000 for i in range(num_blocks * layout.block_size)]
    hashes = hash_blocks(parent, token_ids, layout.block_size)
    metas = metas_for(parent, hashes, token_ids, layout.block_size)
    generator = torch.Generator().manual_seed(seed)
    payloads = [torch.randn(layout.block_shape, generator=generator).to(layout.dtype)
                for _ in metas]
    return metas, payloads


def record_size(layout: KVLayout, meta: BlockMeta) -> int:
    return len(encode_header(meta, layout, layout.bytes_per_block, 0)) + layout.bytes_per_block


def read_back(tier: DiskTier, meta: BlockMeta) -> torch.Tensor | None:
    dest = torch.empty(tier.layout.block_shape, dtype=tier.layout.dtype)
    return dest if tier.get_into(meta, dest) else None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()


def run_in_children(*calls) -> list:
    """Run each `(function, *args)` in its own forked process, all at once; their results.

    Forking (not spawning) keeps a child's start cheap: it does not import torch again. Each
    child opens its own LMDB environment; none is open in this process while they run.
    """
    context = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for function, *args in calls:
        receiver, sender = context.Pipe(duplex=False)
        proc = context.Process(target=_child_main, args=(sender, function, args))
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    results = []
    for receiver, proc in zip(pipes, procs):
        assert receiver.poll(120), "a child process did not answer within 120 s"
        ok, value = receiver.recv()
        proc.join(30)
        assert ok, f"child failed:\n{value}"
        assert proc.exitcode == 0
        results.append(value)
    return results


def _child_main(sender, function, args) -> None:
    try:
        sender.send((True, function(*args)))
    except BaseException:
        sender.send((False, traceback.format_exc()))
    finally:
        sender.close()
