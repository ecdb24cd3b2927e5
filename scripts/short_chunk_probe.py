"""How long a few new tokens take after a long cached prefix: the last step of every restore.

A document is prefilled once (tiers off, so its blocks stay on the GPU); then questions of
`--chunks` tokens are asked about it, each one engine step over the cached prefix. Prints
each step's wall time, its GPU time (CUDA events around the forward pass), and a kernel
summary from torch.profiler for one of them.

    python3 scripts/short_chunk_probe.py [--doc-tokens 32768] [--chunks 16,80,512]
        [--max-row-key-reads N,M]

`--max-row-key-reads` runs the questions once per value of
`engine.cuda_graphs.MAX_ROW_KEY_READS` (0: every chunk eager; large: every chunk that fits
a bucket as graph rows), to time the two paths side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from kvtier.engine import LLM, SamplingParams, cuda_graphs
from kvtier.engine.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", type=int, default=32768)
    parser.add_argument("--chunks", default="16,80,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-row-key-reads", default=str(cuda_graphs.MAX_ROW_KEY_READS))
    args = parser.parse_args()
    device = torch.device("cuda")
    loaded = load_model(args.model, device, "bfloat16")
    rng = np.random.default_rng(0)
    vocab = min(30000, loaded.config.vocab_size)
    doc = rng.integers(16, vocab, args.doc_tokens).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with LLM(loaded, gpu_blocks=args.doc_tokens // 16 + 256, max_num_batched_tokens=8192,
             host_cache=False, disk_cache=False) as llm:
        llm.generate([doc + [17]], params)
        forward = llm.runner.model.forward
        spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

        def timed(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(*a, **k)
            end.record()
            spans.append((start, end))
            return out

        llm.runner.model.forward = timed
        for chunk, limit in [(int(c), int(m)) for m in args.max_row_key_reads.split(",")
                             for c in args.chunks.split(",")]:
            cuda_graphs.MAX_ROW_KEY_READS = limit
            replays = llm.runner.graphs.num_replays if llm.runner.graphs else 0
            walls, gpus = [], []
            for _ in range(args.repeats):
                question = rng.integers(16, vocab, chunk).tolist()
                spans.clear()
                started = time.perf_counter()
                out = llm.generate([doc + question], params)[0]
                walls.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                gpus.append(sum(s.elapsed_time(e) for s, e in spans))
                assert out.metrics.cached_tokens_gpu >= args.doc_tokens - 16
            replays = (llm.runner.graphs.num_replays if llm.runner.graphs else 0) - replays
            print(f"{chunk:5d} new tokens after {args.doc_tokens} (row key reads <= {limit}):"
                  f" wall ms p50 {statistics.median(walls) * 1e3:6.1f} p90 "
                  f"{np.percentile(walls, 90) * 1e3:6.1f}, eager forward GPU ms p50 "
                  f"{statistics.median(gpus):6.1f} ({len(spans)} eager forwards, {replays} "
                  "graph replays)", flush=True)
        llm.runner.model.forward = forward
        question = rng.integers(16, vocab, 16).tolist()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate([doc + question], params)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


if __name__ == "__main__":
    main()
