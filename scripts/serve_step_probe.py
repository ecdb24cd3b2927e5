"""Where `kvtier bench serve`'s time goes, per mode: the engine's steps split by what they
ran (a prefill chunk, decode tokens only, or nothing while loads land), with their wall
time and tokens, so that the throughput a tier can win is bounded by measurement.

    python3 scripts/serve_step_probe.py --model random:llama3-8b --device cuda \
        --dtype bfloat16 --modes off,host_third,host_disk

Runs one timed run per mode of the same workload as `bench serve` (16 conversations,
3 rounds, 512 + 512 tokens by default) and prints, per mode: elapsed, steps and seconds
per kind, prefill tokens computed, and the share of the elapsed time in decode-only steps
(what no tier can shorten), and on CUDA each kind's `execute` spans on the GPU (events
read after the run, so nothing waits for them).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from kvtier.cli.bench import serve
from kvtier.engine.llm import LLM
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.scheduler import Scheduler

CURRENT: dict[str, str | None] = {"mode": None, "timed": None}
STEPS: dict[str, list[tuple[str, float, int, int]]] = defaultdict(list)
LAST_PLAN: list = []
#: CUDA events around each timed step's `ModelRunner.execute`: its span on the GPU (from the
#: step's first kernel to its last, waits on copies and launch gaps included).
SPANS: list = []


def _instrument() -> None:
    tier_options = serve._tier_options

    def noting_mode(mode, *args, **kwargs):
        CURRENT["mode"] = mode
        return tier_options(mode, *args, **kwargs)
    serve._tier_options = noting_mode

    run_mode = serve._run_mode

    def timing(*args, **kwargs):
        CURRENT["timed"] = CURRENT["mode"]
        STEPS[CURRENT["mode"]].clear()  # only the last (with runs=1, the only) timed run
        try:
            return run_mode(*args, **kwargs)
        finally:
            CURRENT["timed"] = None
    serve._run_mode = timing

    schedule = Scheduler.schedule

    def remembering(self):
        plan = schedule(self)
        LAST_PLAN[:] = [plan]
        return plan
    Scheduler.schedule = remembering

    execute = ModelRunner.execute

    def spanned(self, *args, **kwargs):
        if not torch.cuda.is_available():
            return execute(self, *args, **kwargs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            return execute(self, *args, **kwargs)
        finally:
            end.record()
            SPANS[:] = [(begin, end)]
    ModelRunner.execute = spanned

    run_step = LLM._run_step

    def timed(self):
        start = time.perf_counter()
        SPANS.clear()
        result = run_step(self)
        seconds = time.perf_counter() - start
        plan = LAST_PLAN[0] if LAST_PLAN else None
        scheduled = plan.scheduled if plan is not None else []
        prefill = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
        decode = sum(1 for s in scheduled if s.num_new_tokens == 1)
        kind = "prefill" if prefill else "decode" if decode else "empty"
        if CURRENT["timed"] is not None:
            span = SPANS[0] if SPANS else None  # read once the run is over: no sync here
            STEPS[CURRENT["timed"]].append((kind, seconds, prefill, decode, span))
        return result
    LLM._run_step = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="off,host_third,host_disk")
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--num-rounds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=512)
    args = parser.parse_args()
    _instrument()
    config = serve.ServeConfig(model=args.model, device=args.device, dtype=args.dtype,
                               num_conversations=args.num_conversations,
                               num_rounds=args.num_rounds, system_tokens=args.system_tokens,
                               user_tokens=args.user_tokens,
                               modes=tuple(args.modes.split(",")), runs=1)
    result = serve.run_serve_bench(config)
    for mode in config.modes:
        steps = STEPS[mode]
        elapsed = result["modes"][mode]["elapsed_s"]
        line = [f"{mode}: elapsed {elapsed:.3f} s, {len(steps)} steps"]
        for kind in ("prefill", "decode", "empty"):
            chosen = [s for s in steps if s[0] == kind]
            seconds = sum(s[1] for s in chosen)
            gpu_s = sum(s[4][0].elapsed_time(s[4][1]) / 1e3 for s in chosen if s[4])
            line.append(f"{kind} {len(chosen)} steps {seconds:.3f} s "
                        f"({seconds / elapsed:.0%}; execute on the GPU {gpu_s:.3f} s)")
        tokens = sum(s[2] for s in steps)
        decode_rows = sum(s[3] for s in steps)
        line.append(f"prefill tokens {tokens}, decode rows {decode_rows}, "
                    f"throughput {result['modes'][mode]['throughput_tok_s']:.1f} tok/s")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
