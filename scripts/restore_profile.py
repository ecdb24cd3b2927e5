"""Where the engine thread's time goes in a cold disk restore: per step, the time in
`Scheduler.schedule` and in the model runner, the tokens computed and the fronts; then a
profile of the engine thread over the restoring request.

    python3 scripts/restore_profile.py [--doc-tokens 32768] [--model random:llama3-8b]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch
from kvtier.cli.bench.diskread import drop_page_cache
from kvtier.cli.bench.longctx import LongctxConfig, _engine_options, make_documents
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model


def timed(fn, log, name):
    def wrapper(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        log[name] = log.get(name, 0.0) + time.perf_counter() - start
        return result
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", type=int, default=32768)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--warm", action="store_true", help="keep the page cache")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    # Tiers sized for two documents (as `bench longctx` sizes them for its documents).
    config = LongctxConfig(model=args.model, device=device, dtype=dtype, num_docs=2,
                           doc_tokens=args.doc_tokens, max_batched_tokens=args.max_batched_tokens,
                           max_tokens=2)
    loaded = load_model(args.model, torch.device(device), dtype)
    layout = loaded.config.kv_layout(16, next(loaded.model.parameters()).dtype)
    docs, first, second = make_documents(config, loaded.config.vocab_size)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as disk_dir:
        options = _engine_options("disk", config, layout, Path(disk_dir))
        with LLM(loaded, **options) as llm:
            out = llm.generate([docs[0] + first[0]], params)
            print("round 1 ttft", round(out[0].metrics.ttft_s, 3))
        with LLM(loaded, **options) as llm:
            log: dict[str, float] = {}
            llm.scheduler.schedule = timed(llm.scheduler.schedule, log, "schedule")
            llm.runner.execute = timed(llm.runner.execute, log, "execute")
            stats = llm.stats()
            print("disk", stats.disk,
                  "gpu blocks", stats.pool.num_blocks, "free", stats.pool.num_free)
            print("page cache dropped:", False if args.warm else drop_page_cache())
            profile = cProfile.Profile()
            started = time.perf_counter()
            llm.add_request(docs[0] + second[0], params)
            profile.enable()
            done = False
            while not done:
                log.clear()
                step_start = time.perf_counter()
                outputs = llm.step()
                fronts = [(f.compute_block, f.load_block, f.num_restored, f.num_computed)
                          for f in llm.scheduler.restore_fronts().values()]
                print(f"t={time.perf_counter() - started:7.3f}s step "
                      f"{(time.perf_counter() - step_start) * 1e3:8.1f} ms: schedule "
                      f"{log.get('schedule', 0) * 1e3:7.1f} execute "
                      f"{log.get('execute', 0) * 1e3:7.1f}"
                      f" fronts {fronts}")
                done = bool(outputs)
            profile.disable()
            print("ttft", round(outputs[0].metrics.ttft_s, 3), "cached disk tokens",
                  outputs[0].metrics.cached_tokens_disk)
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
