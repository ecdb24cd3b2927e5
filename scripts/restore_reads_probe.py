"""How fast the disk tier reads while the engine restores, against the same reads alone.

One document is prefilled into a disk tier; a fresh engine then restores it with the page
cache dropped, and every disk read on the I/O threads is timed (the whole
`DiskTier.get_many_into` call, and the preadv inside it), as are the engine's steps and how
late a thread that sleeps 1 ms wakes up (its lateness is mostly the wait for the GIL). The
summary says what rate the reads reached inside the restore, how much of each read call was
the preadv, and what the engine thread was doing meanwhile.

    python3 scripts/restore_reads_probe.py [--doc-tokens 8192,32768] [--model random:llama3-8b]
        [--warm]

With `--warm` the tier's data file is read into the page cache before each restore instead
of dropping it. Every step of the restoring request is listed with the tokens it computed,
the fronts after it, and the bytes whose reads ended during it.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
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


class GpuTimeline:
    """CUDA events around every forward pass and host -> GPU copy submission of an engine,
    against a base event recorded when the request arrives: when the GPU ran each step."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.base: torch.cuda.Event | None = None
        self.base_host = 0.0
        self.forwards: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
        self.copies: list[tuple[float, int]] = []  # (host time, blocks) of each H2D submit
        model, manager = llm.runner.model, llm.manager
        forward, copy = model.forward, manager.load_path.copy_to_gpu

        def timed_forward(*args, **kwargs):
            if self.base is None:
                return forward(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            host = time.perf_counter()
            start.record()
            result = forward(*args, **kwargs)
            end.record()
            self.forwards.append((start, end, host))
            return result

        def timed_copy(load, items):
            self.copies.append((time.perf_counter(), len(items)))
            return copy(load, items)

        model.forward = timed_forward
        manager.load_path.copy_to_gpu = timed_copy

    def start(self) -> None:
        if not torch.cuda.is_available():
            return
        self.forwards.clear()
        self.copies.clear()
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record()
        self.base_host = time.perf_counter()

    def report(self) -> None:
        if self.base is None:
            return
        torch.cuda.synchronize()
        for start, end, host in self.forwards:
            print(f"    forward launched at {(host - self.base_host) * 1e3:7.1f} ms, ran on the "
                  f"GPU {self.base.elapsed_time(start):7.1f} .. {self.base.elapsed_time(end):7.1f}"
                  " ms")
        if self.copies:
            times = [(t - self.base_host) * 1e3 for t, _ in self.copies]
            print(f"    host->GPU submits: {len(self.copies)} of "
                  f"{sum(n for _, n in self.copies)} blocks, from {min(times):.1f} to "
                  f"{max(times):.1f} ms; by 50 ms: "
                  + " ".join(f"{int(t // 50) * 50}:{sum(1 for x in times if t // 50 == x // 50)}"
                             for t in sorted({int(x // 50) * 50 for x in times})))


class Sampler:
    """Samples the engine thread's stack every millisecond (from another thread, so a
    sample waits for the GIL like everyone): where the engine thread's wall time goes."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._target = threading.get_ident()

    def start(self) -> threading.Thread:
        self.counts.clear()
        self._stop.clear()
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self._target)
            names, stack = [], []
            while frame is not None:
                code = frame.f_code
                if "kvtier" in code.co_filename or "/main/" in code.co_filename:
                    stack.append(f"{Path(code.co_filename).stem}.{code.co_name}")
                frame = frame.f_back
            names = stack[:3]
            # Outside the model runner only: where a step's host time goes besides launches.
            key = "(model_runner.execute)" if "model_runner.execute" in stack \
                else " < ".join(names) or "?"
            self.counts[key] = self.counts.get(key, 0) + 1
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()

    def report(self, top: int = 20) -> None:
        total = sum(self.counts.values()) or 1
        print(f"    engine thread, {total} samples:")
        for key, count in sorted(self.counts.items(), key=lambda kv: -kv[1])[:top]:
            print(f"      {count / total:5.1%} {key}")


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


def timed(execute, spent: list[float], tokens: list[int]):
    """`execute`, adding the seconds of each call to `spent[0]` and the tokens it computed
    to `tokens[0]`."""
    def run(scheduled, *args, **kwargs):
        tokens[0] += sum(s.num_new_tokens for s in scheduled)
        start = time.perf_counter()
        try:
            return execute(scheduled, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return run


def read_through(directory: str) -> int:
    """Read every data.mdb under `directory` once (into the page cache); MiB read."""
    total = 0
    for path in Path(directory).rglob("data.mdb"):
        with open(path, "rb", buffering=0) as data:
            while chunk := data.read(64 << 20):
                total += len(chunk)
    return total >> 20


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(rec: Recorder, steps: list, began: float,
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
    long_steps = [(s - began, d, x) for s, d, x, _, _ in steps if d > 0.005]
    print(f"  engine: {len(steps)} steps, {len(long_steps)} over 5 ms: "
          + ", ".join(f"{s * 1e3:.0f}+{d * 1e3:.0f} ms (execute {x * 1e3:.0f})"
                      for s, d, x in long_steps[:12]))
    print(f"  ttft {ttft * 1e3:.1f} ms")
    print_steps(rec, steps, began)


def print_steps(rec: Recorder, steps: list, began: float) -> None:
    """One line per step with something in it: when, how long, the tokens it computed, the
    fronts after it, and the MiB whose read calls ended inside it."""
    for start, duration, execute, tokens, fronts in steps:
        read = sum(b for _, e, b in rec.calls if start <= e < start + duration)
        if tokens or read or duration > 0.002:
            print(f"    step {(start - began) * 1e3:7.1f} +{duration * 1e3:6.1f} ms "
                  f"(execute {execute * 1e3:6.1f}) computed {tokens:5d} fronts {fronts} "
                  f"reads ended {read / 2**20:6.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama3-8b")
    parser.add_argument("--doc-tokens", default="8192,32768")
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--dump-after-ms", type=float, default=0.0,
                        help="dump every thread's stack when the first step of a restore "
                             "runs longer than this")
    parser.add_argument("--warm", action="store_true",
                        help="read the tier into the page cache before each restore")
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
                gpu = GpuTimeline(llm)
                for doc, question in zip(docs, second):
                    if args.warm:
                        print(f"{doc_tokens} tokens, warm: {read_through(disk_dir)} MiB "
                              "read into the page cache")
                    else:
                        print(f"{doc_tokens} tokens, cold: page cache dropped "
                              f"{drop_page_cache()}")
                    rec.clear()
                    probe = rec.probe_gil()
                    steps: list = []
                    execute = llm.runner.execute
                    spent = [0.0]
                    tokens = [0]
                    llm.runner.execute = timed(execute, spent, tokens)
                    gpu.start()
                    sampler = Sampler()
                    sampling = sampler.start()
                    began = time.perf_counter()
                    llm.add_request(doc + question, params)
                    outputs = []
                    while not outputs:
                        spent[0] = 0.0
                        tokens[0] = 0
                        start = time.perf_counter()
                        if args.dump_after_ms and len(steps) == 0:
                            # Where the engine thread is once the first step runs long (a
                            # C-level watchdog: it sees a thread that holds the GIL too).
                            faulthandler.dump_traceback_later(args.dump_after_ms / 1e3)
                        outputs = llm.step()
                        faulthandler.cancel_dump_traceback_later()
                        fronts = [(f.compute_block, f.load_block, f.num_restored)
                                  for f in llm.scheduler.restore_fronts().values()]
                        steps.append((start, time.perf_counter() - start, spent[0],
                                      tokens[0], fronts))
                    llm.runner.execute = execute
                    sampler.stop()
                    sampling.join()
                    rec.stop()
                    probe.join()
                    while llm.has_unfinished():
                        llm.step()
                    metrics = outputs[0].metrics
                    print(f"  restored from disk {metrics.cached_tokens_disk} tokens, "
                          f"computed {metrics.computed_tokens}")
                    summarize(rec, steps, began, metrics.ttft_s)
                    gpu.report()
                    sampler.report()
                    llm.manager.drain()


if __name__ == "__main__":
    main()
