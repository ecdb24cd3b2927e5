"""`kvtier bench swap`: block swaps GPU <-> pinned host against the plain pinned copy.

For every block size of the sweep (32 KiB ... 8 MiB by default) and every method of
`kernels.swap_blocks` the same run measures, against one contiguous pinned copy of the same
bytes (the ceiling; two of them on two streams for both directions at once):

* each direction, and both at once (one stream each), on scattered blocks (random GPU
  blocks and random host slots; `host_run_blocks` > 1 keeps host slots in runs, as a slab
  handing out slots in order gives) or contiguous ones;
* the host time to issue one call (the whole swap, and a 1,000-block swap);
* at the `matmul_block_bytes` sizes, how much a loop of bf16 matmuls on the compute stream
  slows down while the method swaps both ways at full rate on side streams;
* the write-through pattern: a few blocks GPU -> host submitted to the transfer engine after
  every "decode step" (a few matmuls), step time with and without.

Every swap's bytes are checked bitwise. Times are medians of CUDA-event measurements.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from kvtier.kernels import SWAP_METHODS, swap_blocks
from kvtier.kernels._memcpy_batch import memcpy_batch

from kvtier.stats import Direction
from kvtier.transfer import SwapJob, TransferEngine

DEFAULT_BLOCK_BYTES = tuple(1 << s for s in range(15, 24))  # 32 KiB ... 8 MiB
METHODS = SWAP_METHODS
SEED = 0
_DTYPE = torch.bfloat16
_ISSUE_BLOCKS = 1000

Work = dict[torch.cuda.Stream, Callable[[], None]]


def _time_streams(work: Work, repeats: int) -> float:
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


def _host_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median host milliseconds one call of `fn` takes to return (the GPU drained between)."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def layout_rows(num_blocks: int, scattered: bool, host_run_blocks: int,
                seed: int = SEED) -> dict[str, np.ndarray]:
    """[num_blocks, 2] (src, dst) rows per direction over 2 * num_blocks GPU blocks and host
    slots: "d2h" (gpu, host) and "h2d" (host, gpu), on disjoint blocks and slots."""
    if not scattered:
        first, second = np.arange(num_blocks), np.arange(num_blocks, 2 * num_blocks)
        return {"d2h": np.stack([first, first], 1), "h2d": np.stack([second, second], 1)}
    rng = np.random.default_rng(seed)
    gpu_ids = rng.permutation(2 * num_blocks)
    run = max(1, min(host_run_blocks, num_blocks))
    num_runs = -(-2 * num_blocks // run)
    host_ids = (rng.permutation(num_runs)[:, None] * run + np.arange(run)).reshape(-1)
    host_ids = host_ids[host_ids < 2 * num_blocks]
    return {"d2h": np.stack([gpu_ids[:num_blocks], host_ids[:num_blocks]], 1),
            "h2d": np.stack([host_ids[num_blocks:], gpu_ids[num_blocks:]], 1)}


class MatmulLoop:
    """`count` bf16 matmuls of `size`^3 on the current stream."""

    def __init__(self, size: int, count: int, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(SEED)
        self.a = torch.randn((size, size), generator=generator, device=device, dtype=_DTYPE)
        self.b = torch.randn((size, size), generator=generator, device=device, dtype=_DTYPE)
        self.c = torch.empty_like(self.a)
        self.count = count

    def run(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.b, out=self.c)

    def timed_ms(self, background: Work | None = None, rounds: int = 0) -> float:
        """Event-timed ms of one loop, with `background` enqueued `rounds` times first."""
        torch.cuda.synchronize()
        gate = torch.cuda.Event()
        gate.record()
        for stream in background or {}:
            stream.wait_event(gate)
        for _ in range(rounds):
            for fn in (background or {}).values():
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def slowdown(self, background: Work, rounds: int, repeats: int) -> float:
        """Median over repeats of (time with background) / (time alone), measured in pairs."""
        self.timed_ms()
        ratios = [self.timed_ms(background, rounds) / self.timed_ms() for _ in range(repeats)]
        return statistics.median(ratios)


def _swap(method: str, src: torch.Tensor, dst: torch.Tensor, mapping: torch.Tensor,
          stream: torch.cuda.Stream) -> Callable[[], None]:
    return lambda: swap_blocks(src, dst, mapping, method=method, stream=stream)


def _verify(gpu: torch.Tensor, host: torch.Tensor, rows: dict[str, np.ndarray]) -> bool:
    """Bitwise, as integers (random bits include NaN patterns)."""
    torch.cuda.synchronize()
    gpu_bits, host_bits = gpu.view(torch.int16), host.view(torch.int16)
    d2h, h2d = (torch.from_numpy(rows[k]) for k in ("d2h", "h2d"))
    return bool(torch.equal(host_bits[d2h[:, 1]], gpu_bits[d2h[:, 0]].cpu())
                and torch.equal(gpu_bits[h2d[:, 1]].cpu(), host_bits[h2d[:, 0]]))


def _fill(gpu: torch.Tensor, host: torch.Tensor, seed: int) -> None:
    """Fresh random bits in both, so a copy that did not happen cannot pass (drawn on the
    GPU: a CPU generator would take seconds per GiB)."""
    generator = torch.Generator(gpu.device).manual_seed(seed)
    gpu.view(torch.int16).random_(generator=generator)
    host.copy_(gpu)
    gpu.view(torch.int16).random_(generator=generator)


def _sweep_one(block_bytes: int, gpu_all: torch.Tensor, host_all: torch.Tensor,
               streams: tuple[torch.cuda.Stream, torch.cuda.Stream], methods: Sequence[str],
               scattered: bool, host_run_blocks: int, repeats: int,
               matmul: MatmulLoop | None, matmul_alone_ms: float) -> dict:
    out_stream, in_stream = streams
    total = gpu_all.numel() * gpu_all.element_size() // 2
    num_blocks = total // block_bytes
    gpu = gpu_all.view(2 * num_blocks, block_bytes // 2)  # [2n, elements per block]
    host = host_all.view(2 * num_blocks, block_bytes // 2)
    rows = layout_rows(num_blocks, scattered, host_run_blocks)
    maps = {k: torch.from_numpy(v.copy()) for k, v in rows.items()}
    half = num_blocks * block_bytes // 2
    gpu_flat, host_flat = gpu_all.view(-1), host_all.view(-1)

    def d2h_ceiling() -> None:
        with torch.cuda.stream(out_stream):
            host_flat[:half].copy_(gpu_flat[:half], non_blocking=True)

    def h2d_ceiling() -> None:
        with torch.cuda.stream(in_stream):
            gpu_flat[half:].copy_(host_flat[half:], non_blocking=True)

    ceiling_work = {"d2h": {out_stream: d2h_ceiling}, "h2d": {in_stream: h2d_ceiling},
                    "both": {out_stream: d2h_ceiling, in_stream: h2d_ceiling}}
    ceilings: list[dict[str, float]] = []
    result: dict = {"block_bytes": block_bytes, "num_blocks": num_blocks, "methods": {}}
    for index, method in enumerate(methods):
        # The ceiling is timed next to each method: the bus's rate drifts during a run.
        ceiling = {f"{k}_ms": _time_streams(w, repeats) for k, w in ceiling_work.items()}
        ceilings.append(ceiling)
        _fill(gpu, host, SEED + 10 * index + block_bytes)
        d2h = _swap(method, gpu, host, maps["d2h"], out_stream)
        h2d = _swap(method, host, gpu, maps["h2d"], in_stream)
        row = {"d2h_ms": _time_streams({out_stream: d2h}, repeats),
               "h2d_ms": _time_streams({in_stream: h2d}, repeats),
               "both_ms": _time_streams({out_stream: d2h, in_stream: h2d}, repeats)}
        row["correct"] = _verify(gpu, host, rows)
        row["ceiling"] = ceiling
        for key in ("d2h", "h2d", "both"):
            row[f"{key}_vs_ceiling"] = ceiling[f"{key}_ms"] / row[f"{key}_ms"]
        row["issue_ms"] = _host_ms(d2h, repeats)
        few = torch.from_numpy(rows["d2h"][:_ISSUE_BLOCKS].copy())
        row["issue_blocks"] = int(few.shape[0])
        row["issue_ms_1000"] = _host_ms(_swap(method, gpu, host, few, out_stream), repeats)
        if matmul is not None:
            rounds = int(matmul_alone_ms / row["both_ms"]) + 2
            row["matmul_slowdown"] = matmul.slowdown({out_stream: d2h, in_stream: h2d},
                                                     rounds, max(3, repeats // 2))
        result["methods"][method] = row
    ceiling = {key: statistics.median(c[key] for c in ceilings) for key in ceilings[0]}
    for key in ("d2h", "h2d"):
        ceiling[f"{key}_gbps"] = total / ceiling[f"{key}_ms"] / 1e6
    ceiling["both_gbps"] = 2 * total / ceiling["both_ms"] / 1e6
    result["ceiling"] = ceiling
    return result


def _write_through(device: torch.device, method: str, block_bytes: int, num_blocks: int,
                   steps: int, repeats: int) -> dict:
    """Decode-step time with and without a `num_blocks` GPU -> host swap per step."""
    step_work = MatmulLoop(4096, 8, device)
    elements = block_bytes // 2
    gpu = torch.randn((64 * num_blocks, elements), device=device).to(_DTYPE)
    host = torch.zeros((64 * num_blocks, elements), dtype=_DTYPE, pin_memory=True)
    rng = np.random.default_rng(SEED)
    mappings = [torch.from_numpy(np.stack([rng.choice(gpu.shape[0], num_blocks, False),
                                           rng.choice(host.shape[0], num_blocks, False)], 1))
                for _ in range(steps)]
    engine = TransferEngine(device, swap_method=method)
    submit_s: list[float] = []

    def run(with_swaps: bool) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for mapping in mappings:
            step_work.run()
            if with_swaps:
                t0 = time.perf_counter()
                engine.submit(SwapJob(Direction.GPU_TO_HOST, gpu, host, mapping))
                submit_s.append(time.perf_counter() - t0)
            engine.get_finished()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3 / steps

    try:
        run(True)
        alone, with_swaps = [], []
        for _ in range(repeats):
            alone.append(run(False))
            with_swaps.append(run(True))
        engine.wait_all()
        last = mappings[-1]
        correct = bool(torch.equal(host[last[:, 1]].view(torch.int16),
                                   gpu[last[:, 0]].cpu().view(torch.int16)))
    finally:
        engine.close()
    return {"method": method, "block_bytes": block_bytes, "blocks_per_step": num_blocks,
            "step_ms": statistics.median(alone), "step_with_swaps_ms":
            statistics.median(with_swaps),
            "slowdown": statistics.median(w / a for w, a in zip(with_swaps, alone)),
            "submit_us_p50": statistics.median(submit_s) * 1e6, "correct": correct}


def run_swap_bench(block_bytes: Sequence[int] = DEFAULT_BLOCK_BYTES, total_mib: int = 512,
                   scattered: bool = True, host_run_blocks: int = 1,
                   methods: Sequence[str] = METHODS, repeats: int = 5,
                   matmul_size: int = 8192, matmul_count: int = 20,
                   matmul_block_bytes: Sequence[int] = (256 << 10, 2 << 20),
                   write_through_blocks: int = 4, write_through_steps: int = 50,
                   progress: Callable[[str], None] = lambda _: None) -> dict:
    """Measure every method at every block size against the pinned ceiling (see the module
    docstring); returns a JSON-able dict. Raises ValueError without CUDA or for block sizes
    that are not even numbers of bytes or exceed `total_mib`."""
    if not torch.cuda.is_available():
        raise ValueError("kvtier bench swap needs a CUDA device")
    total = total_mib << 20
    bad = [b for b in block_bytes if b % 2 or b > total or b <= 0]
    if bad or not block_bytes:
        raise ValueError(f"--block-bytes must be even sizes of at most --total-mib "
                         f"({total_mib} MiB), got {list(block_bytes)}")
    device = torch.device("cuda")
    gpu_all = torch.empty(total, dtype=_DTYPE, device=device)  # 2 * total bytes
    host_all = torch.empty(total, dtype=_DTYPE, pin_memory=True)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    matmul = MatmulLoop(matmul_size, matmul_count, device)
    matmul.timed_ms()
    matmul_alone_ms = statistics.median(matmul.timed_ms() for _ in range(repeats))
    result: dict = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "memcpy_batch_runtime": getattr(memcpy_batch(), "runtime_version", None),
        "bytes_per_direction": total, "scattered": scattered,
        "host_run_blocks": host_run_blocks if scattered else None,
        "matmul": {"size": matmul_size, "count": matmul_count, "alone_ms": matmul_alone_ms},
        "sizes": [], "write_through": []}
    for size in block_bytes:
        progress(f"bench swap: {size >> 10} KiB blocks")
        with_matmul = matmul if size in matmul_block_bytes else None
        # Elements (2 bytes) of 2 * (total // size) whole blocks: both directions' halves.
        usable = total // size * size
        result["sizes"].append(_sweep_one(
            size, gpu_all.view(-1)[:usable], host_all.view(-1)[:usable], streams, methods,
            scattered, host_run_blocks, repeats, with_matmul, matmul_alone_ms))
    del gpu_all, host_all
    for size in matmul_block_bytes:
        progress(f"bench swap: write-through, {size >> 10} KiB blocks")
        result["write_through"].append(_write_through(
            device, "auto", size, write_through_blocks, write_through_steps, repeats))
    result["all_correct"] = all(r["correct"] for s in result["sizes"]
                                for r in s["methods"].values()) and all(
        w["correct"] for w in result["write_through"])
    return result
