"""The CUDA runtime's host cost per copy in one cudaMemcpyBatchAsync call, by the call's
attributes, the copies' order and the batch size. On the lent GPU:

    python scripts/memcpy_issue_cost_probe.py [--block-kib 32] [--total-mib 256]

Every call is enqueued behind a ~50 ms sleeping kernel, so the copy engines are not running
while the host issues (and once with them running); the figure is the call's host time per
copy, median of 5. Bytes are checked after each variant.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import torch
from kvtier.kernels._memcpy_batch import _MemcpyAttributes, _MemLocation, memcpy_batch

SLEEP_CYCLES = 100_000_000
ORDER_STREAM, ORDER_DURING_CALL, ORDER_ANY = 1, 2, 3
LOC_DEVICE, LOC_HOST = 1, 2


def driver_batch(attrs: _MemcpyAttributes):
    """The driver's cuMemcpyBatchAsync (the runtime call's own entry point below it), as a
    `copy(dsts, srcs, sizes, stream)` like the runtime binding's; None without it."""
    library = ctypes.CDLL("libcuda.so.1")
    function = getattr(library, "cuMemcpyBatchAsync_v2", None)
    with_fail_index = function is None
    if function is None:
        function = getattr(library, "cuMemcpyBatchAsync", None)
    if function is None:
        return None
    function.restype = ctypes.c_int

    def copy(dsts, srcs, sizes, stream: int) -> None:
        d, s, z = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        index = ctypes.c_size_t(0)
        args = [ctypes.c_void_p(d.ctypes.data), ctypes.c_void_p(s.ctypes.data),
                ctypes.c_void_p(z.ctypes.data), ctypes.c_size_t(len(z)), ctypes.byref(attrs),
                ctypes.byref(index), ctypes.c_size_t(1)]
        if with_fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        args.append(ctypes.c_void_p(stream))
        status = function(*args)
        if status != 0:
            raise OSError(f"cuMemcpyBatchAsync failed with CUDA error {status}")
    return copy


def per_copy_us(call, num_copies: int, busy: bool = True) -> float:
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(SLEEP_CYCLES)
        began = time.perf_counter()
        call()
        times.append((time.perf_counter() - began) * 1e6 / num_copies)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--total-mib", type=int, default=256)
    args = parser.parse_args()
    binding = memcpy_batch()
    assert binding is not None
    bb = args.block_kib << 10
    n = (args.total_mib << 20) // bb
    gpu = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device="cuda")
    host = torch.zeros((n, bb), dtype=torch.uint8, pin_memory=True)
    rng = np.random.default_rng(0)
    src_ids, dst_ids = rng.permutation(n), rng.permutation(n)
    srcs = (gpu.data_ptr() + src_ids.astype(np.uint64) * bb).astype(np.uint64)
    dsts = (host.data_ptr() + dst_ids.astype(np.uint64) * bb).astype(np.uint64)
    sizes = np.full(n, bb, dtype=np.uint64)
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}, {n} copies of {args.block_kib} KiB, GPU -> host, "
          f"runtime {binding.runtime_version}", flush=True)
    default_attrs = binding._attrs

    def with_attrs(order: int, flags: int, hints: bool = False):
        attrs = _MemcpyAttributes(src_access_order=order, flags=flags)
        if hints:
            attrs.src_loc_hint = _MemLocation(LOC_DEVICE, torch.cuda.current_device())
            attrs.dst_loc_hint = _MemLocation(LOC_HOST, 0)

        def call() -> None:
            binding._attrs = attrs
            try:
                binding.copy(dsts, srcs, sizes, stream)
            finally:
                binding._attrs = default_attrs
        return call

    order = np.argsort(dst_ids)
    variants = {
        "as kvtier calls it (stream order, prefer overlap)": with_attrs(ORDER_STREAM, 1),
        "flags 0": with_attrs(ORDER_STREAM, 0),
        "source read during the call": with_attrs(ORDER_DURING_CALL, 1),
        "source read any time": with_attrs(ORDER_ANY, 1),
        "location hints": with_attrs(ORDER_STREAM, 1, hints=True),
        "sorted by host address": lambda: binding.copy(dsts[order], srcs[order], sizes[order],
                                                       stream),
        "64 calls of n/64": lambda: [binding.copy(d, s, z, stream) for d, s, z in zip(
            np.array_split(dsts, 64), np.array_split(srcs, 64), np.array_split(sizes, 64))],
    }
    driver_copy = driver_batch(default_attrs)
    if driver_copy is not None:
        variants["driver API call (cuMemcpyBatchAsync)"] = (
            lambda: driver_copy(dsts, srcs, sizes, stream))
        variants["runtime call again"] = variants[
            "as kvtier calls it (stream order, prefer overlap)"]
    for label, call in variants.items():
        host.zero_()
        try:
            us = per_copy_us(call, n)
        except OSError as exc:
            print(f"  {label}: rejected ({exc})", flush=True)
            continue
        ok = torch.equal(host[torch.from_numpy(dst_ids[:64])],
                         gpu[torch.from_numpy(src_ids[:64])].cpu())
        print(f"  {label}: {us:.3f} us per copy{'' if ok else ' BAD BYTES'}", flush=True)
    idle = per_copy_us(variants["as kvtier calls it (stream order, prefer overlap)"], n,
                       busy=False)
    print(f"  as kvtier calls it, on an idle GPU (copies start as the call returns): "
          f"{idle:.3f} us per copy", flush=True)

    # The second half issued while the first half's copies run on the engines.
    torch.cuda.synchronize()
    half = n // 2
    binding.copy(dsts[:half], srcs[:half], sizes[:half], stream)
    began = time.perf_counter()
    binding.copy(dsts[half:], srcs[half:], sizes[half:], stream)
    running = (time.perf_counter() - began) * 1e6 / (n - half)
    torch.cuda.synchronize()
    print(f"  a call issued while earlier copies run: {running:.3f} us per copy", flush=True)
    bus_us = bb / 53e3
    print(f"  the bus moves one copy in ~{bus_us:.2f} us at 53 GB/s", flush=True)


if __name__ == "__main__":
    with torch.cuda.stream(torch.cuda.Stream()):
        main()
