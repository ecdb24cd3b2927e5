"""`kvtier bench swap`: block swaps GPU <-> pinned host against the copy-engine ceiling.

Blocks are Llama-3-8B's cross-layer blocks (32 layers, 8 kv heads, head dim 128, 16 tokens,
bfloat16: 2 MiB each). For every method ("triton", "dma", and "dma" without the batched
memcpy call) the same run measures:

* each direction on scattered blocks vs the ceiling, one contiguous pinned copy of the same
  bytes (target >= 0.95x);
* both directions at once (one stream each) vs the two-stream bidirectional ceiling
  (target >= 0.9x);
* how much a matmul-heavy workload on the compute stream slows down while the method swaps
  both ways at full rate.

Times are medians of CUDA-event measurements over `repeats` runs.

    python -m kvtier.cli.bench.swap [--json out.json] [--blocks 512] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from kvtier.kernels import swap_blocks
from kvtier.kernels._memcpy_batch import memcpy_batch
from kvtier.kernels.swap_blocks import _swap_dma

BLOCK_SHAPE = (32, 2, 16, 8, 128)
DTYPE = torch.bfloat16
SEED = 0
METHODS = ("triton", "dma", "dma_per_run")


def _swap(method: str, src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor,
          stream: torch.cuda.Stream) -> None:
    if method == "dma_per_run":
        # The DMA path with one copy_ per run instead of one batched runtime call.
        with torch.cuda.stream(stream):
            _swap_dma(src, dst, mapping.tolist(), use_batch=False)
    else:
        swap_blocks(src, dst, mapping, method=method, stream=stream)


def _time_streams(work: dict[torch.cuda.Stream, Callable[[], None]], repeats: int) -> float:
    """Median ms from a common start until every stream finished its work."""
    times = []
    main = torch.cuda.current_stream()
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record(main)
        ends = []
        for stream, fn in work.items():
            stream.wait_event(start)
            fn()
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
        torch.cuda.synchronize()
        times.append(max(start.elapsed_time(end) for end in ends))
    return statistics.median(times[1:])  # the first run warms up


def _mappings(num_blocks: int, num_gpu: int, num_host: int) -> dict[str, torch.Tensor]:
    """Scattered (src, dst) rows for each direction, on disjoint GPU blocks."""
    generator = torch.Generator().manual_seed(SEED)
    gpu_ids = torch.randperm(num_gpu, generator=generator)
    host_ids = torch.randperm(num_host, generator=generator)
    out_gpu, in_gpu = gpu_ids[:num_blocks], gpu_ids[num_blocks:2 * num_blocks]
    out_host, in_host = host_ids[:num_blocks], host_ids[num_blocks:2 * num_blocks]
    return {"d2h": torch.stack([out_gpu, out_host], 1), "h2d": torch.stack([in_host, in_gpu], 1)}


def run_swap_bench(num_blocks: int = 512, repeats: int = 9, matmul_size: int = 8192,
                   matmul_count: int = 40) -> dict:
    """Measure every swap method against the pinned-copy ceilings; returns a JSON-able dict.

    Raises ValueError without CUDA.
    """
    if not torch.cuda.is_available():
        raise ValueError("kvtier bench swap needs a CUDA device")
    device = torch.device("cuda")
    num_slots = 2 * num_blocks
    gpu = torch.empty((num_slots, *BLOCK_SHAPE), dtype=DTYPE, device=device)
    gpu.view(torch.int16).random_(generator=torch.Generator(device=device).manual_seed(SEED))
    host = torch.empty((num_slots, *BLOCK_SHAPE), dtype=DTYPE, pin_memory=True)
    block_bytes = gpu[0].numel() * gpu.element_size()
    total = num_blocks * block_bytes
    maps = _mappings(num_blocks, num_slots, num_slots)
    out_stream, in_stream = torch.cuda.Stream(), torch.cuda.Stream()
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                     "block_bytes": block_bytes, "num_blocks": num_blocks,
                     "bytes_per_direction": total,
                     "memcpy_batch_runtime": getattr(memcpy_batch(), "runtime_version", None)}

    # Ceilings: one contiguous pinned copy of the same bytes.
    gpu_flat, host_flat = gpu.view(-1)[:total // 2], host.view(-1)[:total // 2]
    gpu_flat2, host_flat2 = gpu.view(-1)[-(total // 2):], host.view(-1)[-(total // 2):]

    def d2h_ceiling() -> None:
        with torch.cuda.stream(out_stream):
            host_flat.copy_(gpu_flat, non_blocking=True)

    def h2d_ceiling() -> None:
        with torch.cuda.stream(in_stream):
            gpu_flat2.copy_(host_flat2, non_blocking=True)

    ceiling = {"d2h_ms": _time_streams({out_stream: d2h_ceiling}, repeats),
               "h2d_ms": _time_streams({in_stream: h2d_ceiling}, repeats),
               "bidir_ms": _time_streams({out_stream: d2h_ceiling, in_stream: h2d_ceiling},
                                         repeats)}
    ceiling["d2h_gbps"] = total / ceiling["d2h_ms"] / 1e6
    ceiling["h2d_gbps"] = total / ceiling["h2d_ms"] / 1e6
    ceiling["bidir_gbps"] = 2 * total / ceiling["bidir_ms"] / 1e6
    results["ceiling"] = ceiling

    def d2h(method: str):
        return lambda: _swap(method, gpu, host, maps["d2h"], out_stream)

    def h2d(method: str):
        return lambda: _swap(method, host, gpu, maps["h2d"], in_stream)

    matmul = MatmulWorkload(matmul_size, matmul_count, device)
    results["matmul_alone_ms"] = matmul.alone_ms(repeats)
    methods = {}
    for method in METHODS:
        row = {"d2h_ms": _time_streams({out_stream: d2h(method)}, repeats),
               "h2d_ms": _time_streams({in_stream: h2d(method)}, repeats),
               "bidir_ms": _time_streams({out_stream: d2h(method), in_stream: h2d(method)},
                                         repeats)}
        row["d2h_gbps"] = total / row["d2h_ms"] / 1e6
        row["h2d_gbps"] = total / row["h2d_ms"] / 1e6
        row["bidir_gbps"] = 2 * total / row["bidir_ms"] / 1e6
        row["d2h_vs_ceiling"] = ceiling["d2h_ms"] / row["d2h_ms"]
        row["h2d_vs_ceiling"] = ceiling["h2d_ms"] / row["h2d_ms"]
        row["bidir_vs_ceiling"] = ceiling["bidir_ms"] / row["bidir_ms"]
        rounds = int(results["matmul_alone_ms"] / row["bidir_ms"]) + 2
        row["matmul_with_swap_ms"] = matmul.with_background(
            {out_stream: d2h(method), in_stream: h2d(method)}, rounds, repeats)
        row["matmul_slowdown"] = row["matmul_with_swap_ms"] / results["matmul_alone_ms"]
        torch.cuda.synchronize()
        row["correct"] = _check_copies(gpu, host, maps)
        methods[method] = row
    results["methods"] = methods
    results["targets"] = {
        m: {"each_direction_ge_0.95x": min(r["d2h_vs_ceiling"], r["h2d_vs_ceiling"]) >= 0.95,
            "bidirectional_ge_0.9x": r["bidir_vs_ceiling"] >= 0.9}
        for m, r in methods.items()}
    return results


def _check_copies(gpu: torch.Tensor, host: torch.Tensor, maps: dict) -> bool:
    """Bitwise (random bits include NaN patterns, so compare as integers)."""
    gpu_bits, host_bits = gpu.view(torch.int16), host.view(torch.int16)
    d2h, h2d = maps["d2h"], maps["h2d"]
    return bool(torch.equal(host_bits[d2h[:, 1]], gpu_bits[d2h[:, 0]].cpu())
                and torch.equal(gpu_bits[h2d[:, 1]].cpu(), host_bits[h2d[:, 0]]))


class MatmulWorkload:
    """`count` bf16 matmuls of `size`^3 on the compute stream, timed with events."""

    def __init__(self, size: int, count: int, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(SEED)
        self.a = torch.randn((size, size), generator=generator, device=device, dtype=DTYPE)
        self.b = torch.randn((size, size), generator=generator, device=device, dtype=DTYPE)
        self.c = torch.empty_like(self.a)
        self.count = count

    def _run(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.count):
            torch.matmul(self.a, self.b, out=self.c)
        end.record()
        return start, end

    def alone_ms(self, repeats: int) -> float:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start, end = self._run()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])

    def with_background(self, work: dict[torch.cuda.Stream, Callable[[], None]], rounds: int,
                        repeats: int) -> float:
        """Matmul time while `work` (stream -> enqueue fn) repeats `rounds` times."""
        times = []
        main = torch.cuda.current_stream()
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            gate = torch.cuda.Event()
            gate.record(main)
            for stream in work:
                stream.wait_event(gate)
            for _ in range(rounds):
                for fn in work.values():
                    fn()
            start, end = self._run()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times[1:])


def _print_table(results: dict) -> None:
    c = results["ceiling"]
    print(f"{results['device']}  blocks {results['num_blocks']} x "
          f"{results['block_bytes'] / 2**20:.1f} MiB  batch memcpy runtime "
          f"{results['memcpy_batch_runtime']}")
    print(f"ceiling: d2h {c['d2h_gbps']:.1f} GB/s  h2d {c['h2d_gbps']:.1f} GB/s  "
          f"bidir {c['bidir_gbps']:.1f} GB/s;  matmul alone {results['matmul_alone_ms']:.1f} ms")
    for method, r in results["methods"].items():
        print(f"{method:>12}: d2h {r['d2h_gbps']:.1f} ({r['d2h_vs_ceiling']:.2f}x)  "
              f"h2d {r['h2d_gbps']:.1f} ({r['h2d_vs_ceiling']:.2f}x)  bidir "
              f"{r['bidir_gbps']:.1f} ({r['bidir_vs_ceiling']:.2f}x)  matmul slowdown "
              f"{r['matmul_slowdown']:.2f}x  correct {r['correct']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per direction")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    results = run_swap_bench(num_blocks=args.blocks, repeats=args.repeats)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
