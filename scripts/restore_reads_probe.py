"""How fast the disk tier reads while the engine restores, against the same reads alone.

One document is prefilled into a disk tier; a fresh engine then restores it with the page
cache dropped, and every disk read on the I/O threads is timed (the whole
`DiskTier.get_many_into` call, and the preadv inside it), as are the engine's steps and how
late a thread that sleeps 1 ms wakes up (its lateness is mostly the wait for the GIL). The
summary says what rate the reads reached inside the restore, how much of each read call was
the preadv, and what the engine thread was doing meanwhile.

    python3 scripts/restore_reads_probe.py [--doc-tokens 8192,32768] [--model random:llama3-8b]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch
from kvtier.cli.bench.diskread import drop_page_cache
from kvtier.cli.bench.longctx import LongctxConfig, _engine_options, make_documents
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import load_model

from kvtier.tiers import disk_read
from kvtier.tiers.disk import DiskTier


class Recorder:
    """(start, end, bytes) of each read call and preadv; the GIL probe's lateness."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.preads: list[tuple[float, float, int]] = []
        self.lateness: list[tuple[float, float]] = []
        self._stop = threading.Event()

    def install(self) -> None:
        original_get = DiskTier.get_many_into
        original_pread = disk_read.pread_values

        def get_many_into(tier, metas, dests):
            start = time.perf_counter()
            result = original_get(tier, metas, dests)
            self.calls.append((start, time.perf_counter(),
                               len(metas) * tier.layout.bytes_per_block))
            return result

        def pread_values(fd, spots, page_size, buffers):
            start = time.perf_counter()
            result = original_pread(fd, spots, page_size, buffers)
            self.preads.append((start, time.perf_counter(), sum(s.size for s in spots)))
            return result

        DiskTier.get_many_into = get_many_into
        disk_read.pread_values = pread_values

    def probe_gil(self) -> threading.Thread:
        def run() -> None:
            while not self._stop.is_set():
                start = time.perf_counter()
                time.sleep(0.001)
                self.lateness.append((start, time.perf_counter() - start - 0.001))
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def clear(self) -> None:
        self._stop.clear()
        self.calls.clear()
        self.preads.clear()
        self.lateness.clear()


def timed(execute, spent: list[float]):
    """`execute`, adding the seconds of each call to `spent[0]`."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(rec: Recorder, steps: list[tuple[float, float, float]], began: float,
              ttft: float) -> None:
    if not rec.calls:
        print("  no disk reads")
        return
    first = min(s for s, _, _ in rec.calls)
    last = max(e for _, e, _ in rec.calls)
    total = sum(b for _, _, b in rec.calls)
    call_s = [e - s for s, e, _ in rec.calls]
    pread_s = [e - s for s, e, _ in rec.preads]
    pread_bytes = sum(b for _, _, b in rec.preads)
    print(f"  reads: {len(rec.calls)} calls, {total / 2**20:.0f} MiB from "
          f"{(first - began) * 1e3:.1f} to {(last - began) * 1e3:.1f} ms after the request: "
          f"{total / (last - first) / 1e9:.2f} GB/s over that window")
    print(f"  per call ms p50 {pct(call_s, .5) * 1e3:.1f} p90 {pct(call_s, .9) * 1e3:.1f} "
          f"max {max(call_s) * 1e3:.1f}; preadv p50 {pct(pread_s, .5) * 1e3:.1f} "
          f"p90 {pct(pread_s, .9) * 1e3:.1f}; preadv share of call time "
          f"{sum(pread_s) / max(sum(call_s), 1e-9):.2f}; preadv GB/s each "
          f"{pread_bytes / max(sum(pread_s), 1e-9) / 1e9:.2f}")
    # Concurrency: how many read calls were under way, on average, over the window.
    busy = sum(call_s) / (last - first)
    print(f"  read calls in flight on average {busy:.2f}")
    during = [lat for t, lat in rec.lateness if first <= t <= last]
    print(f"  1 ms sleeper late by p50 {pct(during, .5) * 1e3:.2f} p90 {pct(during, .9) * 1e3:.2f}"
          f" p99 {pct(during, .99) * 1e3:.2f} ms during the reads ({len(during)} samples)")
    long_steps = [(s - began, d, x) for s, d, x in steps if d > 0.005]
    print(f"  engine: {len(steps)} steps, {len(long_steps)} over 5 ms: "
          + ", ".join(f"{s * 1e3:.0f}+{d * 1e3:.0f} ms (execute {x * 1e3:.0f})"
                      for s, d, x in long_steps[:12]))
    print(f"  ttft {ttft * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", default="8192,32768")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    loaded = load_model(args.model, torch.device(device), dtype)
    layout = loaded.config.kv_layout(16, next(loaded.model.parameters()).dtype)
    rec = Recorder()
    rec.install()
    for doc_tokens in [int(t) for t in args.doc_tokens.split(",")]:
        config = LongctxConfig(model=args.model, device=device, dtype=dtype, num_docs=2,
                               doc_tokens=doc_tokens,
                               max_batched_tokens=args.max_batched_tokens, max_tokens=2)
        docs, first, second = make_documents(config, loaded.config.vocab_size)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        with tempfile.TemporaryDirectory(dir=args.dir) as disk_dir:
            options = _engine_options("disk", config, layout, Path(disk_dir))
            with LLM(loaded, **options) as llm:
                llm.generate([d + q for d, q in zip(docs, first)], params)
            with LLM(loaded, **options) as llm:
                for doc, question in zip(docs, second):
                    print(f"{doc_tokens} tokens, cold: page cache dropped "
                          f"{drop_page_cache()}")
                    rec.clear()
                    probe = rec.probe_gil()
                    steps: list[tuple[float, float, float]] = []
                    execute = llm.runner.execute
                    spent = [0.0]
                    llm.runner.execute = timed(execute, spent)
                    began = time.perf_counter()
                    llm.add_request(doc + question, params)
                    outputs = []
                    while not outputs:
                        spent[0] = 0.0
                        start = time.perf_counter()
                        outputs = llm.step()
                        steps.append((start, time.perf_counter() - start, spent[0]))
                    llm.runner.execute = execute
                    rec.stop()
                    probe.join()
                    while llm.has_unfinished():
                        llm.step()
                    metrics = outputs[0].metrics
                    print(f"  restored from disk {metrics.cached_tokens_disk} tokens, "
                          f"computed {metrics.computed_tokens}")
                    summarize(rec, steps, began, metrics.ttft_s)
                    llm.manager.drain()


if __name__ == "__main__":
    main()
