"""Where a long prefill's GPU time goes: one engine prefill of a fresh prompt under
torch.profiler, kernels grouped into matmuls, paged attention, store_kv and the rest.

    python scripts/prefill_profile.py [--tokens 32768] [--step-tokens 8192]

The prompt runs once untimed (after the engine's warm-up), then a fresh prompt of the same
length runs profiled. Prints the wall time to first token, the GPU time per group and the
top kernels by total time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model
from torch.profiler import ProfilerActivity, profile

GROUPS = (("attention", ("paged_attention", "_attn", "attention")),
          ("store_kv", ("store_kv",)),
          ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "matmul")))


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(key in lowered for key in keys):
            return group
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    loaded = load_model(args.model, torch.device("cuda"), "bfloat16")
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(16, vocab, (args.tokens,), generator=gen).tolist()
               for _ in range(2)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with LLM(loaded, host_cache=False, disk_cache=False,
             max_num_batched_tokens=args.step_tokens, max_model_len=args.tokens + 64,
             gpu_blocks=args.tokens // 16 + 64) as llm:
        start = time.perf_counter()
        llm.generate([prompts[0]], params)
        torch.cuda.synchronize()
        print(f"unprofiled prompt: {time.perf_counter() - start:.3f} s")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate([prompts[1]], params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = event.device_time_total if hasattr(event, "device_time_total") \
            else event.cuda_time_total
        totals[group_of(event.name)] += micros
        kernels[event.name][0] += micros
        kernels[event.name][1] += 1
    busy = sum(totals.values())
    print(f"profiled prompt: {wall:.3f} s wall, {busy / 1e6:.3f} s of GPU kernels")
    for group, micros in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {group:10s} {micros / 1e3:9.1f} ms  {micros / busy:6.1%}")
    print("top kernels (ms, calls):")
    for name, (micros, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {micros / 1e3:9.1f} {calls:6d}  {name[:110]}")


if __name__ == "__main__":
    main()
