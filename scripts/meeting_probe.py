"""What the compute front decides at each step of a cold disk restore: per step, the
balanced claim (`Restore.balanced_tokens`), what `Restore.claim` allowed, the load rate
the claim was sized with, the tokens the tiers may still deliver and the groups in flight.

    python3 scripts/meeting_probe.py [--model random:llama3-1b] [--doc-tokens 32768]
        [--num-docs 4] [--switch-interval-ms 5] [--profile]

Round one fills a disk tier; round two asks each document again on a fresh engine over it,
with the page cache dropped before each request (as `bench longctx --cold`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from kvtier.cli.bench.diskread import drop_page_cache
from kvtier.cli.bench.longctx import LongctxConfig, _engine_options, make_documents
from kvtier.engine import LLM, SamplingParams
from kvtier.engine import restore as restore_module
from kvtier.engine.loader import load_model

LOG: list[str] = []
TIMES: dict[str, float] = {}


def _time(owner: type, name: str) -> None:
    """Add the wall time of every `owner.name` call on the engine thread to TIMES."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return original(*args, **kwargs)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            key = f"{owner.__name__}.{name}"
            TIMES[key] = TIMES.get(key, 0.0) + time.perf_counter() - start
    setattr(owner, name, timed)


GPU_SPANS: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []


def _time_execute_on_gpu() -> None:
    """Record CUDA events around each `ModelRunner.execute` (GPU_SPANS): how long the
    compute stream took from the step's first launch to its last, idle gaps included."""
    from kvtier.engine.model_runner import ModelRunner

    original = ModelRunner.execute

    def timed(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return original(self, *args, **kwargs)
        finally:
            end.record()
            GPU_SPANS.append((start, end))
    ModelRunner.execute = timed


def _time_engine() -> None:
    from kvtier.engine.model_runner import ModelRunner
    from kvtier.engine.scheduler import Scheduler

    from kvtier.load_path import LoadPath
    from kvtier.manager import TierManager
    from kvtier.transfer import TransferEngine

    for owner, names in ((Scheduler, ("schedule", "update", "_finish_loads", "_chunk",
                                      "_lookup")),
                         (ModelRunner, ("execute",)),
                         (TierManager, ("poll", "complete_load_blocks", "cancel_load",
                                        "prepare_load", "submit_stores")),
                         (LoadPath, ("feed", "copy_landed_reads")),
                         (TransferEngine, ("wait", "_reap_cuda", "submit")),
                         (restore_module.Restore, ("collect", "issue"))):
        for name in names:
            _time(owner, name)


def _wrap_restore() -> None:
    cls = restore_module.Restore
    balanced, claim = cls.balanced_tokens, cls.claim

    def logged_balanced(self, compute_block, num_tokens, prefill):
        result = balanced(self, compute_block, num_tokens, prefill)
        rate = self._load_rate() or 0.0
        pending = self._pending_tokens(compute_block)
        LOG.append(f"    front {compute_block:5d} asked {num_tokens:5d} balanced {result:5d} "
                   f"L {rate:9.0f} tok/s R {pending:6d} in flight {len(self._in_flight):3d} "
                   f"landed {self._num_completed:3d}")
        return result

    def logged_claim(self, start_token, num_tokens):
        result = claim(self, start_token, num_tokens)
        LOG.append(f"    claim from {start_token:6d}: {num_tokens:5d} asked, {result:5d} allowed")
        return result

    cls.balanced_tokens, cls.claim = logged_balanced, logged_claim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama3-1b")
    parser.add_argument("--doc-tokens", type=int, default=32768)
    parser.add_argument("--num-docs", type=int, default=4)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="set the GIL switch interval after the round-two engine starts "
                             "(its transfer engine sets 0.5 ms)")
    parser.add_argument("--profile", action="store_true",
                        help="run the first round-two request under torch.profiler and print "
                             "its top CUDA kernels and CPU ops")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device != "cpu" else "float32"
    _wrap_restore()
    _time_engine()
    if args.device != "cpu":
        _time_execute_on_gpu()
    config = LongctxConfig(model=args.model, device=args.device, dtype=dtype,
                           num_docs=args.num_docs, doc_tokens=args.doc_tokens,
                           max_batched_tokens=8192, max_tokens=2)
    loaded = load_model(args.model, torch.device(args.device), dtype)
    layout = loaded.config.kv_layout(16, next(loaded.model.parameters()).dtype)
    docs, first, second = make_documents(config, loaded.config.vocab_size)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as disk_dir:
        options = _engine_options("disk", config, layout, Path(disk_dir))
        with LLM(loaded, **options) as llm:
            recompute = [llm.generate([d + q], params)[0].metrics.ttft_s
                         for d, q in zip(docs, first)]
        print("round 1 (computed) TTFT ms", [round(t * 1e3, 1) for t in recompute])
        with LLM(loaded, **options) as llm:
            if args.switch_interval_ms is not None:
                sys.setswitchinterval(args.switch_interval_ms / 1e3)
            for i, (d, q) in enumerate(zip(docs, second)):
                drop_page_cache()
                LOG.clear()
                GPU_SPANS.clear()
                profiler = None
                if args.profile and i == 0:
                    from torch.profiler import ProfilerActivity, profile
                    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    profiler.__enter__()
                started = time.perf_counter()
                llm.add_request(d + q, params)
                while True:
                    TIMES.clear()
                    step_start = time.perf_counter()
                    outputs = llm.step()
                    fronts = [(f.compute_block, f.load_block, f.num_restored)
                              for f in llm.scheduler.restore_fronts().values()]
                    LOG.append(f"  t={(time.perf_counter() - started) * 1e3:7.1f} ms step "
                               f"{(time.perf_counter() - step_start) * 1e3:6.1f} ms fronts "
                               f"{fronts} " + " ".join(
                                   f"{k.split('.')[-1]}={v * 1e3:.1f}"
                                   for k, v in TIMES.items() if v > 1e-3))
                    if outputs:
                        break
                if profiler is not None:
                    if args.device != "cpu":
                        torch.cuda.synchronize()
                    profiler.__exit__(None, None, None)
                    averages = profiler.key_averages()
                    print(averages.table(sort_by="cuda_time_total", row_limit=15), flush=True)
                    print(averages.table(sort_by="self_cpu_time_total", row_limit=15),
                          flush=True)
                if GPU_SPANS:
                    torch.cuda.synchronize()
                    print("execute on the GPU, ms per step:", " ".join(
                        f"{start.elapsed_time(end):.1f}" for start, end in GPU_SPANS))
                metrics = outputs[0].metrics
                print(f"document {i}: TTFT {metrics.ttft_s * 1e3:.1f} ms, disk blocks "
                      f"{metrics.cached_tokens_disk // 16}; rates {llm.scheduler.tier_rates}")
                compact = [line for j, line in enumerate(LOG)
                           if not (line.startswith("  t=") and j + 1 < len(LOG)
                                   and LOG[j + 1].startswith("  t=") and j > 0
                                   and LOG[j - 1].startswith("  t="))]
                print("\n".join(compact[:80]), flush=True)


if __name__ == "__main__":
    main()
