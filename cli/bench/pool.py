"""`kvtier bench pool`: block-pool and hashing throughput on a synthetic prefix-sharing trace.

The trace is `num_requests` requests; each starts with one of `num_prefixes` shared documents
of `prefix_len` tokens and ends with its own suffix. Replaying a request is what a scheduler
does with the pool: look up its block hashes, touch the hits, allocate the rest, cache the new
full blocks; at most `max_running` requests hold blocks at once, and the oldest one frees its
blocks (tail-first) when a new one needs room. Hashing is timed apart from the pool, on the
same token lists, for xxh3_128 and sha256. Every figure is the median over `repeats` runs.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np
import torch
import typer
from kvtier.cli.common import print_json, print_table

from kvtier.block_pool import BlockPool
from kvtier.hashing import HASH_ALGORITHMS, BlockHash, hash_blocks, namespace_hash
from kvtier.layout import KVLayout

# A small vocabulary keeps the numbers honest for any real tokenizer (ids < 2**16 or 2**17).
_VOCAB_SIZE = 50_000
# The namespace of the trace's hashes: a Llama-3-8B-shaped layout, as a real engine would use.
_MODEL_ID = "bench/pool"


@dataclass(frozen=True, slots=True)
class PoolBenchConfig:
    """Sizes of the synthetic trace. Raises ValueError when a size is out of range."""

    num_requests: int = 2000
    prefix_len: int = 1024
    num_prefixes: int = 8
    max_suffix_len: int = 512
    block_size: int = 16
    num_blocks: int = 4096
    max_running: int = 32
    repeats: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("num_requests", "num_prefixes", "max_suffix_len", "block_size",
                      "num_blocks", "max_running", "repeats"):
            value = getattr(self, field)
            if value <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {value}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0, got {self.prefix_len}")
        longest = -(-(self.prefix_len + self.max_suffix_len) // self.block_size)
        if longest > self.num_blocks:
            raise ValueError(f"the longest request needs {longest} blocks but the pool has "
                             f"{self.num_blocks}; raise --num-blocks or shorten the requests")


@dataclass(frozen=True, slots=True)
class _Request:
    token_ids: list[int]
    num_blocks: int  # blocks the request occupies, the partial last one included


def _make_trace(config: PoolBenchConfig) -> list[_Request]:
    rng = np.random.default_rng(config.seed)
    prefixes = [rng.integers(0, _VOCAB_SIZE, config.prefix_len).tolist()
                for _ in range(config.num_prefixes)]
    requests = []
    for _ in range(config.num_requests):
        prefix = prefixes[int(rng.integers(config.num_prefixes))]
        suffix_len = int(rng.integers(1, config.max_suffix_len + 1))
        token_ids = prefix + rng.integers(0, _VOCAB_SIZE, suffix_len).tolist()
        requests.append(_Request(token_ids, -(-len(token_ids) // config.block_size)))
    return requests


def _hash_trace(requests: list[_Request], namespace: BlockHash, block_size: int,
                algorithm: str) -> tuple[float, list[list[BlockHash]]]:
    start = time.perf_counter()
    all_hashes = [hash_blocks(namespace, r.token_ids, block_size, algorithm) for r in requests]
    return time.perf_counter() - start, all_hashes


def _replay(requests: list[_Request], all_hashes: list[list[BlockHash]],
            config: PoolBenchConfig) -> dict[str, float]:
    """One pass of the trace through a fresh pool; returns counts and the elapsed seconds."""
    pool = BlockPool(config.num_blocks)
    running: deque[list] = deque()
    num_ops = num_hits = num_queried = num_events = 0
    start = time.perf_counter()
    for request, hashes in zip(requests, all_hashes):
        hits = pool.lookup_prefix(hashes)
        pool.touch(hits)
        num_new = request.num_blocks - len(hits)
        new_blocks = pool.allocate(num_new)
        while new_blocks is None:
            finished = running.popleft()
            pool.free(finished)
            num_ops += len(finished)
            new_blocks = pool.allocate(num_new)
        newly_cached = pool.cache_full_blocks(new_blocks[:len(hashes) - len(hits)],
                                              hashes[len(hits):])
        num_events += len(pool.take_events())
        # A lookup examines the hits and, unless every hash hit, the first miss.
        examined = min(len(hashes), len(hits) + 1)
        num_ops += examined + len(hits) + num_new + len(newly_cached)
        num_hits += len(hits)
        num_queried += len(hashes)
        running.append(hits + new_blocks)
        if len(running) > config.max_running:
            finished = running.popleft()
            pool.free(finished)
            num_ops += len(finished)
    while running:
        finished = running.popleft()
        pool.free(finished)
        num_ops += len(finished)
    elapsed = time.perf_counter() - start
    pool.check_invariants()
    assert pool.num_free_blocks == config.num_blocks, "blocks leaked by the replay"
    return {"seconds": elapsed, "block_ops": num_ops, "hit_blocks": num_hits,
            "queried_blocks": num_queried, "evictions": num_events}


def run_pool_bench(num_requests: int = 2000, prefix_len: int = 1024, num_prefixes: int = 8,
                   max_suffix_len: int = 512, block_size: int = 16, num_blocks: int = 4096,
                   max_running: int = 32, repeats: int = 5, seed: int = 0) -> dict:
    """Replay the synthetic trace; return a JSON-ready dict of medians over `repeats` runs.

    `pool.block_ops_per_s` counts every block that allocate / free / touch / cache_full_blocks
    / lookup_prefix handled; `hashing.<algorithm>.tokens_per_s` is hashing throughput on the
    same token lists. Raises ValueError for out-of-range sizes.
    """
    config = PoolBenchConfig(num_requests, prefix_len, num_prefixes, max_suffix_len,
                             block_size, num_blocks, max_running, repeats, seed)
    requests = _make_trace(config)
    num_tokens = sum(len(r.token_ids) for r in requests)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=block_size,
                      dtype=torch.bfloat16)
    hashing: dict[str, dict] = {}
    hashes_for_pool: list[list[BlockHash]] = []
    for algorithm in HASH_ALGORITHMS:
        namespace = namespace_hash(_MODEL_ID, layout, algorithm)
        seconds = []
        for _ in range(repeats):
            elapsed, all_hashes = _hash_trace(requests, namespace, block_size, algorithm)
            seconds.append(elapsed)
        if not hashes_for_pool:
            hashes_for_pool = all_hashes
        median = statistics.median(seconds)
        hashing[algorithm] = {"tokens_per_s": num_tokens / median, "median_s": median,
                              "seconds": seconds}
    runs = [_replay(requests, hashes_for_pool, config) for _ in range(repeats)]
    # Every run replays the same trace, so the counts agree and only the time varies.
    counts = runs[0]
    median = statistics.median(r["seconds"] for r in runs)
    return {
        "config": asdict(config),
        "num_tokens": num_tokens,
        "pool": {
            "block_ops_per_s": counts["block_ops"] / median,
            "block_ops": counts["block_ops"],
            "median_s": median,
            "seconds": [r["seconds"] for r in runs],
            "hit_rate": counts["hit_blocks"] / max(counts["queried_blocks"], 1),
            "evictions": counts["evictions"],
        },
        "hashing": hashing,
    }


def pool(
    num_requests: int = typer.Option(2000, help="Requests in the synthetic trace."),
    prefix_len: int = typer.Option(1024, help="Tokens of each shared prefix."),
    num_prefixes: int = typer.Option(8, help="Distinct shared prefixes."),
    max_suffix_len: int = typer.Option(512, help="Longest per-request suffix, in tokens."),
    block_size: int = typer.Option(16, help="Tokens per block."),
    num_blocks: int = typer.Option(4096, help="Blocks in the pool."),
    max_running: int = typer.Option(32, help="Requests holding blocks at once."),
    repeats: int = typer.Option(5, help="Runs; figures are medians."),
    seed: int = typer.Option(0, help="Seed of the synthetic trace."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Block-pool operations per second and hashing tokens per second."""
    result = run_pool_bench(num_requests, prefix_len, num_prefixes, max_suffix_len,
                            block_size, num_blocks, max_running, repeats, seed)
    if json_output:
        print_json(result)
        return
    pool_result = result["pool"]
    rows = [
        ("block ops / s", f"{pool_result['block_ops_per_s']:,.0f}"),
        ("block ops per run", f"{pool_result['block_ops']:,}"),
        ("pool hit rate", f"{pool_result['hit_rate']:.1%}"),
        ("evictions per run", f"{pool_result['evictions']:,}"),
    ]
    for algorithm, figures in result["hashing"].items():
        rows.append((f"{algorithm} tokens / s", f"{figures['tokens_per_s']:,.0f}"))
    rows.append(("tokens per run", f"{result['num_tokens']:,}"))
    print_table(f"bench pool (median of {repeats})", ("metric", "value"), rows)
