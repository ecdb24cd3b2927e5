"""Where a short prompt's time goes when its blocks sit on a cold disk that is not read.

A 1K-token prompt (25 ms to compute on an H100) is not worth reading from disk, so the
engine recomputes it; `bench longctx --cold` still measured such prompts 3-4 ms slower than
with tiers off. This probe repeats that case with the disk tier's calls and the scheduler's
admission timed, in four engines over one model:

    off        tiers off, a fresh engine, round two as in the bench
    host       a host tier only, a fresh engine (nothing cached: every block computed)
    disk-warm  host + disk over the directory round one filled, a fresh engine
    disk-cold  the same with the page cache dropped before every request (needs root)

    python3 scripts/short_prompt_overhead_probe.py [--doc-tokens 1024] [--num-docs 6]

Prints each request's TTFT and, for the tiered engines, every timed call that ran while
the request waited for its first token (thread, start after submit, duration).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from kvtier.cli.bench.diskread import drop_page_cache
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model
from kvtier.engine.scheduler import Scheduler

from kvtier.tiers.disk import DiskTier
from kvtier.transfer import TransferEngine

EVENTS: list[tuple[str, str, float, float]] = []


def _timed(owner: type, name: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            EVENTS.append((f"{owner.__name__}.{name}", threading.current_thread().name, start,
                           time.perf_counter() - start))
    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--num-docs", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for owner, name in ((DiskTier, "contains"), (DiskTier, "put"), (DiskTier, "get_many_into"),
                        (DiskTier, "touch"), (DiskTier, "_flush_touches"),
                        (Scheduler, "_lookup"), (Scheduler, "_worth_reading"),
                        (TransferEngine, "poll")):
        if hasattr(owner, name):
            _timed(owner, name)
    loaded = load_model(args.model, torch.device(args.device),
                        "bfloat16" if args.device != "cpu" else "float32")
    rng = np.random.default_rng(0)
    docs = [rng.integers(16, min(30000, loaded.config.vocab_size), args.doc_tokens + 16).tolist()
            for _ in range(args.num_docs)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    blocks = args.doc_tokens // 16 + 4
    gb = (args.num_docs + 2) * blocks * 2 / 1024  # 2 MiB blocks
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        tiers = {"host_cache": True, "host_cache_gb": gb, "disk_cache": True,
                 "disk_cache_gb": gb, "disk_cache_dir": Path(scratch) / "kv"}
        with LLM(loaded, gpu_blocks=blocks, max_num_batched_tokens=8192, **tiers) as llm:
            for doc in docs:  # round one: every block computed and written through
                llm.generate([doc], params)
        configs = [("off", {"host_cache": False, "disk_cache": False}, False),
                   ("host", {"host_cache": True, "host_cache_gb": gb, "disk_cache": False},
                    False),
                   ("disk-warm", tiers, False), ("disk-cold", tiers, True),
                   ("off", {"host_cache": False, "disk_cache": False}, False)]
        for name, options, cold in configs:
            with LLM(loaded, gpu_blocks=blocks, max_num_batched_tokens=8192, **options) as llm:
                ttfts = []
                for i, doc in enumerate(docs):
                    if cold:
                        drop_page_cache()
                    EVENTS.clear()
                    submit = time.perf_counter()
                    out = llm.generate([doc], params)[0]
                    ttft = out.metrics.ttft_s
                    ttfts.append(ttft * 1e3)
                    hits = (out.metrics.cached_tokens_host + out.metrics.cached_tokens_disk) // 16
                    during = [e for e in EVENTS if e[2] - submit < ttft]
                    print(f"{name:9s} doc {i}: TTFT {ttft * 1e3:6.1f} ms, restored {hits} "
                          f"blocks; " + "; ".join(
                              f"{what} [{thread}] +{(start - submit) * 1e3:.1f} "
                              f"{dur * 1e3:.2f}ms" for what, thread, start, dur in during
                              if what != "TransferEngine.poll" or dur > 2e-4), flush=True)
                print(f"{name:9s} TTFT p50 {statistics.median(ttfts):.1f} ms "
                      f"(all {' '.join(f'{t:.1f}' for t in ttfts)})", flush=True)


if __name__ == "__main__":
    main()
