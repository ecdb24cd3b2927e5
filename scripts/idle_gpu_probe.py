"""Does a pause before a request make the request slower, and does dropping the page cache?

`bench longctx --cold` drops the page cache (a `sync` and a write to drop_caches, which
takes a while) right before each disk restore, while the recompute baseline runs its
requests back to back. This probe times the same short prompts (fresh token ids each, so
nothing is cached) with the tiers off: back to back, after sleeping, and after dropping the
page cache, and a fixed matmul loop after the same pauses, so the GPU's own slowdown after
idling is seen apart from the engine's.

    python3 scripts/idle_gpu_probe.py [--tokens 1024] [--repeats 5] [--pause 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from kvtier.cli.bench.diskread import drop_page_cache
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model


def matmul_ms(device: torch.device) -> float:
    """Milliseconds of 10 bf16 4096^3 matmuls, timed by CUDA events."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pause", type=float, default=1.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    loaded = load_model(args.model, device, "bfloat16")
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    pauses = {"back to back": lambda: None,
              f"after {args.pause:g} s asleep": lambda: time.sleep(args.pause),
              "after dropping the page cache": drop_page_cache}
    with LLM(loaded, gpu_blocks=4 * args.tokens // 16 + 64, max_num_batched_tokens=8192,
             host_cache=False, disk_cache=False) as llm:
        for _ in range(3):  # warm the shapes of this prompt length
            llm.generate([rng.integers(16, 30000, args.tokens).tolist()], params)
        for name, pause in pauses.items():
            ttfts, mms = [], []
            for _ in range(args.repeats):
                prompt = rng.integers(16, 30000, args.tokens).tolist()
                pause()
                ttfts.append(llm.generate([prompt], params)[0].metrics.ttft_s * 1e3)
            for _ in range(args.repeats):
                pause()
                mms.append(matmul_ms(device))
            print(f"{name:32s} TTFT ms p50 {statistics.median(ttfts):6.1f} "
                  f"[{' '.join(f'{t:.1f}' for t in ttfts)}]  matmuls ms p50 "
                  f"{statistics.median(mms):5.2f} [{' '.join(f'{m:.2f}' for m in mms)}]",
                  flush=True)


if __name__ == "__main__":
    main()
