"""Where small scattered swaps lose their time: the host issuing the copies, or the copy
engines running them. On the lent GPU:

    python scripts/swap_issue_probe.py [--total-mib 256] [--block-kib 32,64,128,256,2048]

For each block size, 256 MiB of blocks in random order on both sides (random GPU blocks,
random host slots), each direction timed four ways (both directions at once: the first way)
against one contiguous pinned copy of the same bytes (the ceiling):

  * "as issued": `kernels.swap_blocks(method="dma")`;
  * "side streams": the copies on 4 side streams (8 under 128 KiB), one batched call each
    from the calling thread: swap_blocks' dma path without its planning;
  * "threads": the same descriptors enqueued by 4 Python threads at once, each one batched
    call on its own stream (ctypes gives up the GIL during the call);
  * "one stream": every descriptor in one batched call on one stream;

each timed on an idle GPU from the call to the last byte (what the benchmarks report), and
"pre-issued": enqueued behind a ~50 ms sleep kernel and timed on the GPU from the end of the
sleep to the last byte, the copy engines' own time with the host's issue taken out (with
the host time of the call).

If "pre-issued" reaches the ceiling where "as issued" does not, the host's issue rate
bounds small swaps; if it does not, the copy engines do. Bytes are checked after each.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import torch
from kvtier.kernels import swap_blocks
from kvtier.kernels._memcpy_batch import memcpy_batch
from probe_timing import gpu_ms

REPEATS = 5
SLEEP_CYCLES = 100_000_000  # ~60 ms at ~1.7 GHz


def median_gpu_ms(run, repeats: int = REPEATS) -> float:
    """Median GPU ms of `run()` on the current stream, the GPU idle before each."""
    return statistics.median(gpu_ms(run) for _ in range(repeats))


def pre_issued_ms(run, repeats: int = REPEATS) -> tuple[float, float]:
    """(median GPU ms of `run()` enqueued behind a sleep, from the sleep's end; median host
    ms of the call)."""
    gpu, host = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        began = time.perf_counter()
        run()
        host.append((time.perf_counter() - began) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def addresses(src: torch.Tensor, dst: torch.Tensor, rows: np.ndarray):
    bb = src[0].numel()
    return (np.uint64(dst.data_ptr()) + rows[:, 1].astype(np.uint64) * np.uint64(bb),
            np.uint64(src.data_ptr()) + rows[:, 0].astype(np.uint64) * np.uint64(bb),
            np.full(rows.shape[0], bb, dtype=np.uint64))


def on_side_streams(num: int, issue) -> None:
    """Fork `num` side streams from the current one, `issue(sides)`, and join them back."""
    main = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(main)
    sides = [torch.cuda.Stream() for _ in range(num)]
    for side in sides:
        side.wait_event(ready)
    issue(sides)
    for side in sides:
        done = torch.cuda.Event()
        done.record(side)
        main.wait_event(done)


def by_threads(binding, src, dst, rows, num_threads: int = 4):
    """A run() enqueuing `rows` from `num_threads` threads, one stream and one call each,
    joined back into the current stream."""
    dsts, srcs, sizes = addresses(src, dst, rows)
    parts = np.array_split(np.arange(rows.shape[0]), num_threads)

    def issue(sides) -> None:
        workers = [threading.Thread(target=binding.copy, args=(dsts[p], srcs[p], sizes[p],
                                                               side.cuda_stream))
                   for side, p in zip(sides, parts)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    return lambda: on_side_streams(len(parts), issue)


def four_streams(binding, src, dst, rows):
    """4 side streams (8 under 128 KiB), one batched call each from the calling thread."""
    dsts, srcs, sizes = addresses(src, dst, rows)
    num = 8 if src[0].numel() < (128 << 10) else 4
    parts = np.array_split(np.arange(rows.shape[0]), num)

    def issue(sides) -> None:
        for side, part in zip(sides, parts):
            binding.copy(dsts[part], srcs[part], sizes[part], side.cuda_stream)
    return lambda: on_side_streams(len(parts), issue)


def one_stream(binding, src, dst, rows):
    dsts, srcs, sizes = addresses(src, dst, rows)
    return lambda: binding.copy(dsts, srcs, sizes, torch.cuda.current_stream().cuda_stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--block-kib", default="32,64,128,256,2048")
    args = parser.parse_args()
    binding = memcpy_batch()
    assert binding is not None, "cudaMemcpyBatchAsync is needed"
    total = args.total_mib << 20
    gpu_all = torch.empty(total, dtype=torch.uint8, device="cuda")
    host_all = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    gpu_flat2 = torch.empty(total, dtype=torch.uint8, device="cuda")
    host_flat2 = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.total_mib} MiB per direction", flush=True)
    ceil_d2h = median_gpu_ms(lambda: host_flat2.copy_(gpu_all, non_blocking=True))
    ceil_h2d = median_gpu_ms(lambda: gpu_flat2.copy_(host_all, non_blocking=True))
    side = torch.cuda.Stream()

    def both_ceiling() -> None:
        side.wait_stream(torch.cuda.current_stream())  # the work queued before, not the copy
        host_flat2.copy_(gpu_all, non_blocking=True)
        with torch.cuda.stream(side):
            gpu_flat2.copy_(host_all, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
    ceil_both = median_gpu_ms(both_ceiling)
    gbps = total / 1e6
    print(f"ceiling: d2h {gbps / ceil_d2h:.1f} GB/s, h2d {gbps / ceil_h2d:.1f} GB/s, "
          f"both {2 * gbps / ceil_both:.1f} GB/s", flush=True)
    buffers = (gpu_all, host_all, gpu_flat2, host_flat2)
    for kib in (int(k) for k in args.block_kib.split(",")):
        probe_block_size(kib, buffers, (ceil_d2h, ceil_h2d, ceil_both), binding, side, rng)


def probe_block_size(kib: int, buffers, ceilings, binding, side, rng) -> None:
    """Print one block size's lines (see the module docstring)."""
    gpu_all, host_all, gpu_flat2, host_flat2 = buffers
    ceil_d2h, ceil_h2d, ceil_both = ceilings
    total = gpu_all.numel()
    bb = kib << 10
    n = total // bb
    gpu, host = gpu_all.view(n, bb), host_all.view(n, bb)
    gpu2, host2 = gpu_flat2.view(n, bb), host_flat2.view(n, bb)
    gpu.random_(0, 256)
    host.copy_(torch.randint(0, 256, (n, bb), dtype=torch.uint8))
    rows = np.stack([rng.permutation(n), rng.permutation(n)], axis=1).astype(np.int64)
    mapping = torch.from_numpy(rows)
    cases = {"d2h": (gpu, host2, ceil_d2h), "h2d": (host, gpu2, ceil_h2d)}
    for name, (src, dst, ceiling) in cases.items():
        ways = {
            "as issued": lambda s=src, d=dst: swap_blocks(s, d, mapping, method="dma"),
            "side streams": four_streams(binding, src, dst, rows),
            "threads": by_threads(binding, src, dst, rows),
            "one stream": one_stream(binding, src, dst, rows),
        }
        line = [f"{kib:5d} KiB {name}:"]
        for label, run in ways.items():
            dst.zero_()
            ms = median_gpu_ms(run)
            torch.cuda.synchronize()
            ok = torch.equal(dst[torch.from_numpy(rows[:64, 1])].cpu(),
                             src[torch.from_numpy(rows[:64, 0])].cpu())
            pre_ms, host_ms = pre_issued_ms(run)
            line.append(f"{label} {ceiling / ms:.2f}x, pre-issued {ceiling / pre_ms:.2f}x "
                        f"(host {host_ms:.2f} ms){'' if ok else ' BAD BYTES'};")
        print(f"{line[0]} ({n} blocks) " + " ".join(line[1:]), flush=True)

    def both_dma() -> None:
        side.wait_stream(torch.cuda.current_stream())
        swap_blocks(gpu, host2, mapping, method="dma")
        swap_blocks(host, gpu2, mapping, method="dma", stream=side)
        torch.cuda.current_stream().wait_stream(side)
    both_ms = median_gpu_ms(both_dma)
    if kib == 2048:  # where the host time of one call goes
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.runcall(lambda: swap_blocks(gpu, host2, mapping, method="dma"))
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(12)
    pre_ms, host_ms = pre_issued_ms(both_dma)
    print(f"{kib:5d} KiB both: as issued {ceil_both / both_ms:.2f}x  pre-issued "
          f"{ceil_both / pre_ms:.2f}x (host {host_ms:.2f} ms)", flush=True)

if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):  # batched copies need a non-default stream
        main()
