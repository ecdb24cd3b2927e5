"""What running with tiers costs a prompt that no tier holds: TTFT of fresh prompts (never
seen, so every block is computed) on an engine with tiers off, then on one with a host and a
disk tier (the disk not read: nothing is on it), one engine after the other, same model.

    python3 scripts/tiers_overhead_probe.py [--doc-tokens 1024,8192] [--repeats 6]
        [--configs off,host_disk,host,host_disk_5ms,off]

Configurations, run in the order given: `off` (tiers off), `host` (a host tier only),
`host_disk`, and `host_disk_5ms` (the same with the GIL switch interval put back to
Python's 5 ms after the engine started: the transfer engine shortens it process-wide for
its I/O threads). Prints each one's TTFTs (ms) in order, so a first-request effect shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import numpy as np
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--configs", default="off,host_disk")
    args = parser.parse_args()
    loaded = load_model(args.model, torch.device("cuda"), "bfloat16")
    vocab = min(30000, loaded.config.vocab_size)
    lengths = [int(n) for n in args.doc_tokens.split(",")]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    blocks = max(lengths) // 16 * (args.repeats + 2) + 64
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        disk = {"disk_cache": True, "disk_cache_gb": 16.0}
        host = {"host_cache": True, "host_cache_gb": 8.0}
        configs = {"off": {"host_cache": False, "disk_cache": False},
                   "host": {**host, "disk_cache": False},
                   "host_disk": {**host, **disk}, "host_disk_5ms": {**host, **disk}}
        for index, name in enumerate(args.configs.split(",")):
            options = dict(configs[name])
            if options["disk_cache"]:  # an empty disk tier each time: nothing is found there
                options["disk_cache_dir"] = f"{scratch}/kv-{index}"
            rng = np.random.default_rng(0)  # the same prompts for every configuration
            with LLM(loaded, gpu_blocks=blocks, max_num_batched_tokens=8192,
                     **options) as llm:
                if name == "host_disk_5ms":
                    sys.setswitchinterval(0.005)
                for length in lengths:
                    ttfts = []
                    interval = sys.getswitchinterval() * 1e3
                    for _ in range(args.repeats):
                        prompt = rng.integers(16, vocab, length + 16).tolist()
                        out = llm.generate([prompt], params)[0]
                        assert out.metrics.cached_tokens_gpu == 0, "the prompts must be fresh"
                        ttfts.append(out.metrics.ttft_s * 1e3)
                    print(f"{name:13s} {length:6d} tokens: TTFT ms p50 "
                          f"{statistics.median(ttfts):7.1f} (switch {interval:.1f} ms)  all "
                          f"{' '.join(f'{t:.1f}' for t in ttfts)}", flush=True)


if __name__ == "__main__":
    main()
