"""Where a swap_blocks call's host time goes, and what two issuing threads give both ways.

    python scripts/swap_host_breakdown.py [--total-mib 256] [--block-kib 32,64,256,2048]

For each block size, 256 MiB of blocks in random order on both sides, GPU -> host:

  * the host time of each part of one `swap_blocks(method="dma")` call on an idle GPU
    (argument checks, the pinned-memory check alone, planning, addresses, the batched
    runtime calls, the rest), timed by wrapping the module's own functions;
  * the call's GPU time against one contiguous copy of the same bytes;
  * both directions at once issued the way the benchmarks do (one thread, two calls on two
    streams) against two threads issuing one direction each, joined back before timing ends;
    both against two plain contiguous copies on two streams.

Medians of 7 calls; bytes checked.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import threading
import time
from collections import defaultdict

import numpy as np
import torch
from kvtier.kernels import _memcpy_batch
from kvtier.kernels.swap_blocks import swap_blocks
from probe_timing import gpu_ms, swap_buffers

REPEATS = 7
swap_module = importlib.import_module("kvtier.kernels.swap_blocks")
PARTS = defaultdict(list)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name].append((time.perf_counter() - began) * 1e3)
    return wrapper


def instrument() -> None:
    """Wrap the parts of swap_blocks' dma path (module globals, so its calls go through)."""
    for name in ("_check_swap_args", "coalesce", "_addresses", "_one_batch", "_swap_dma",
                 "_fork", "_join", "choose_method"):
        setattr(swap_module, name, timed(name, getattr(swap_module, name)))
    cls = _memcpy_batch.MemcpyBatch
    cls.copy = timed("runtime batched call", cls.copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-kib", default="32,64,256,2048")
    args = parser.parse_args()
    total = args.total_mib << 20
    gpu_all, host_all, gpu_out, host_out = swap_buffers(total)
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    pinned_ms = []
    for _ in range(100):
        began = time.perf_counter()
        host_out.is_pinned()
        pinned_ms.append((time.perf_counter() - began) * 1e3)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; is_pinned() "
          f"{statistics.median(pinned_ms) * 1e3:.1f} us", flush=True)

    def both_plain() -> None:
        side.wait_stream(main_stream)
        host_out.copy_(gpu_all, non_blocking=True)
        with torch.cuda.stream(side):
            gpu_out.copy_(host_all, non_blocking=True)
        main_stream.wait_stream(side)
    ceil_both = statistics.median(gpu_ms(both_plain) for _ in range(REPEATS))
    ceil_d2h = statistics.median(
        gpu_ms(lambda: host_out.copy_(gpu_all, non_blocking=True)) for _ in range(REPEATS))
    instrument()
    rng = np.random.default_rng(0)
    for kib in (int(k) for k in args.block_kib.split(",")):
        probe_block_size(kib, (gpu_all, host_all, gpu_out, host_out), (ceil_d2h, ceil_both),
                         side, rng)


def probe_block_size(kib: int, buffers, ceilings, side, rng) -> None:
    """Print one block size's two lines (see the module docstring)."""
    gpu_all, host_all, gpu_out, host_out = buffers
    ceil_d2h, ceil_both = ceilings
    main_stream = torch.cuda.current_stream()
    total = gpu_all.numel()
    bb = kib << 10
    n = total // bb
    gpu, host = gpu_all.view(n, bb), host_all.view(n, bb)
    gpu2, host2 = gpu_out.view(n, bb), host_out.view(n, bb)
    mapping = torch.from_numpy(np.stack([rng.permutation(n), rng.permutation(n)], 1))
    PARTS.clear()
    calls, ratios = [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
            enable_timing=True)
        start.record()
        began = time.perf_counter()
        swap_blocks(gpu, host2, mapping, method="dma")
        calls.append((time.perf_counter() - began) * 1e3)
        end.record()
        end.synchronize()
        ratios.append(ceil_d2h / start.elapsed_time(end))
    parts = ", ".join(f"{name} {statistics.median(ms):.3f}"
                      for name, ms in sorted(PARTS.items()))
    print(f"{kib:5d} KiB d2h ({n} blocks): {statistics.median(ratios):.2f}x of one "
          f"contiguous copy; call {statistics.median(calls):.3f} ms host, of which "
          f"(ms per call part, medians) {parts}", flush=True)
    ok = torch.equal(host2[mapping[:64, 1]], gpu[mapping[:64, 0]].cpu())

    def one_thread() -> None:
        side.wait_stream(main_stream)
        swap_blocks(gpu, host2, mapping, method="dma")
        swap_blocks(host, gpu2, mapping, method="dma", stream=side)
        main_stream.wait_stream(side)

    other = torch.cuda.Stream()

    def two_threads() -> None:
        side.wait_stream(main_stream)
        other.wait_stream(main_stream)
        workers = [threading.Thread(target=swap_blocks, args=(gpu, host2, mapping),
                                    kwargs={"method": "dma", "stream": other}),
                   threading.Thread(target=swap_blocks, args=(host, gpu2, mapping),
                                    kwargs={"method": "dma", "stream": side})]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        main_stream.wait_stream(side)
        main_stream.wait_stream(other)
    one = statistics.median(gpu_ms(one_thread) for _ in range(REPEATS))
    gpu2.zero_()
    two = statistics.median(gpu_ms(two_threads) for _ in range(REPEATS))
    torch.cuda.synchronize()
    ok = ok and torch.equal(gpu2[mapping[:64, 1]].cpu(), host[mapping[:64, 0]])
    print(f"{kib:5d} KiB both ways: one thread {ceil_both / one:.2f}x, two threads "
          f"{ceil_both / two:.2f}x of two plain copies"
          f"{'' if ok else ' BAD BYTES'}", flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # batched copies need a non-default stream
        main()
