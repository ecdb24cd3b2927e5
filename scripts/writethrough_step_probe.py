"""What the host tier's write-through costs decode steps, small and large models.

Every block that fills during decode is copied to the host tier (a swap of a few blocks).
This probe runs the same decode-heavy batch on an engine with tiers off, on one with a host
tier (no disk; the GPU budget holds everything, so nothing is restored), and on one with a
host tier whose copies start every step (`kvtier.stores.STORE_BATCH_BLOCKS` set to 1, as
before batching), in turn, and compares wall time per decode step.

    python3 scripts/writethrough_step_probe.py [--models llama3-1b,llama3-8b]
        [--batch 16] [--prompt-tokens 64] [--max-tokens 512] [--pairs 3] [--lockstep]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model

from kvtier import stores


def _sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    steps = 0
    for prompt in prompts:
        llm.add_request(prompt, params)
    _sync(llm)
    start = time.perf_counter()
    while llm.has_unfinished():
        llm.step()
        steps += 1
    _sync(llm)
    return time.perf_counter() - start, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-1b,llama3-8b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lockstep", action="store_true",
                        help="prompts of one length: every request fills a block on the "
                             "same steps (the default staggers them by one token each)")
    args = parser.parse_args()
    batch_blocks = stores.STORE_BATCH_BLOCKS
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for name in args.models.split(","):
        loaded = load_model(f"random:{name}", torch.device(args.device),
                            "bfloat16" if args.device != "cpu" else "float32")
        rng = np.random.default_rng(0)
        vocab = min(30000, loaded.config.vocab_size)
        blocks = args.batch * ((args.prompt_tokens + args.batch + args.max_tokens) // 16 + 2) + 16
        modes = ("off", "host", "host-every-step")
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.pairs):
            for mode in modes:
                stores.STORE_BATCH_BLOCKS = 1 if mode == "host-every-step" else batch_blocks
                tiers = {"host_cache": mode != "off", "host_cache_gb": 4.0, "disk_cache": False}
                with LLM(loaded, gpu_blocks=blocks, max_num_seqs=args.batch, **tiers) as llm:
                    # Fresh (nothing cached), and of staggered lengths: the requests fill
                    # their blocks on different steps, as they do in serving.
                    prompts = [rng.integers(16, vocab, args.prompt_tokens
                                            + (0 if args.lockstep else i)).tolist()
                               for i in range(args.batch)]
                    seconds, steps = _run(llm, prompts, params)
                    moved = llm.stats().transfers
                    copies = sum(s.num_jobs for s in moved.values())
                results[mode].append(seconds / steps * 1e3)
                print(f"{name} {mode:15s}: {steps} steps, {seconds / steps * 1e3:.3f} ms per "
                      f"step, {copies} swap jobs", flush=True)
        medians = {mode: statistics.median(times) for mode, times in results.items()}
        print(f"{name}: ms per step, median of {args.pairs}: " + ", ".join(
            f"{mode} {ms:.3f} ({ms / medians['off']:.3f}x)" for mode, ms in medians.items()),
            flush=True)
        del loaded
        stores.STORE_BATCH_BLOCKS = batch_blocks
        if args.device != "cpu":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
