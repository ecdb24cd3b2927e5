# ruff: noqa: B023  (closures are called inside the iteration that defines them)
"""Probe of candidate swap strategies on a GPU (the measurements behind swap_blocks' choice).

    python scripts/swap_probe.py OUT_DIR

Scattered (random on both sides) block copies GPU <-> pinned host per block size, each
strategy against one contiguous pinned copy of the same bytes, plus host issue time and the
slowdown of a matmul loop. Prints a table and writes probe.json.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time

import numpy as np
import torch
from kvtier.kernels._memcpy_batch import memcpy_batch
from kvtier.kernels.copy_blocks import launch_block_copy

TOTAL = 512 << 20
SIZES = [32 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20]
REPEATS = 5


def timed(work, repeats=REPEATS):
    """work: list of (stream, fn). Median ms from a common start to all streams done."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record(main)
        ends = []
        for stream, fn in work:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
        torch.cuda.synchronize()
        times.append(max(start.elapsed_time(e) for e in ends))
    return statistics.median(times[1:])


def batch_copy(binding, dsts, srcs, sizes, stream, flags=1):
    n = len(sizes)
    binding._attrs.flags = flags
    da = dsts.astype(np.uint64)
    sa = srcs.astype(np.uint64)
    za = sizes.astype(np.uint64)
    args = [ctypes.c_void_p(da.ctypes.data), ctypes.c_void_p(sa.ctypes.data),
            ctypes.c_void_p(za.ctypes.data), ctypes.c_size_t(n), ctypes.byref(binding._attrs),
            ctypes.byref(ctypes.c_size_t(0)), ctypes.c_size_t(1)]
    if binding._with_fail_index:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    args.append(ctypes.c_void_p(stream.cuda_stream))
    status = binding._fn(*args)
    assert status == 0, status


def main(out_dir: str) -> None:
    torch.cuda.init()
    binding = memcpy_batch()
    print("binding", binding and binding.runtime_version, torch.cuda.get_device_name())
    dev = torch.device("cuda")
    gpu = torch.empty(2 * TOTAL, dtype=torch.uint8, device=dev)
    gpu.view(torch.int32).random_()
    host = torch.empty(2 * TOTAL, dtype=torch.uint8, pin_memory=True)
    host.view(torch.int32).random_()
    staging = torch.empty(TOTAL, dtype=torch.uint8, device=dev)
    out_s, in_s = torch.cuda.Stream(), torch.cuda.Stream()
    extra = [torch.cuda.Stream() for _ in range(8)]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    results = {"device": torch.cuda.get_device_name(), "rows": []}

    def mm_time(work, rounds):
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            gate = torch.cuda.Event()
            gate.record()
            for stream, _ in work:
                stream.wait_event(gate)
            for _ in range(rounds):
                for stream, fn in work:
                    with torch.cuda.stream(stream):
                        fn()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                torch.matmul(a, b, out=c)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times[1:])

    mm_alone = mm_time([], 0)
    results["mm_alone_ms"] = mm_alone
    print(f"matmul alone {mm_alone:.2f} ms")

    for bs in SIZES:
        n = TOTAL // bs
        g = gpu.view(2 * n, bs)
        h = host.view(2 * n, bs)
        rng = np.random.default_rng(0)
        gperm, hperm = rng.permutation(2 * n), rng.permutation(2 * n)
        d2h = np.stack([gperm[:n], hperm[:n]], 1)  # (gpu, host)
        h2d = np.stack([hperm[n:], gperm[n:]], 1)  # (host, gpu)
        gb, hb = g.data_ptr(), h.data_ptr()

        def dma(rows, src_base, dst_base, stream, k=1, flags=1):
            srcs = src_base + rows[:, 0].astype(np.uint64) * bs
            dsts = dst_base + rows[:, 1].astype(np.uint64) * bs
            sizes = np.full(len(rows), bs, dtype=np.uint64)
            if k == 1:
                batch_copy(binding, dsts, srcs, sizes, stream, flags)
                return
            ev = torch.cuda.Event()
            ev.record(stream)
            parts = np.array_split(np.arange(len(rows)), k)
            for i, p in enumerate(parts):
                st = extra[i if stream is out_s else 4 + i]
                st.wait_event(ev)
                batch_copy(binding, dsts[p], srcs[p], sizes[p], st, flags)
                e2 = torch.cuda.Event()
                e2.record(st)
                stream.wait_event(e2)

        d2h_t = torch.from_numpy(d2h.copy())
        h2d_t = torch.from_numpy(h2d.copy())
        d2h_dev, h2d_dev = d2h_t.to(dev), h2d_t.to(dev)

        def uva(src, dst, rows_dev, p, warps=4):
            launch_block_copy(src, dst, rows_dev, max_programs=p)

        row = {"block_bytes": bs, "num_blocks": n}
        ceil_d2h = lambda: host[:TOTAL].copy_(gpu[:TOTAL], non_blocking=True)  # noqa: E731
        ceil_h2d = lambda: gpu[TOTAL:].copy_(host[TOTAL:], non_blocking=True)  # noqa: E731
        row["ceil"] = (timed([(out_s, ceil_d2h)]), timed([(in_s, ceil_h2d)]),
                       timed([(out_s, ceil_d2h), (in_s, ceil_h2d)]))
        cands = {
            "dma1": (lambda: dma(d2h, gb, hb, out_s), lambda: dma(h2d, hb, gb, in_s)),
            "dma1f0": (lambda: dma(d2h, gb, hb, out_s, flags=0),
                       lambda: dma(h2d, hb, gb, in_s, flags=0)),
            "dma2": (lambda: dma(d2h, gb, hb, out_s, 2), lambda: dma(h2d, hb, gb, in_s, 2)),
            "dma4": (lambda: dma(d2h, gb, hb, out_s, 4), lambda: dma(h2d, hb, gb, in_s, 4)),
            "uva8": (lambda: uva(g, h, d2h_dev, 8), lambda: uva(h, g, h2d_dev, 8)),
            "uva16": (lambda: uva(g, h, d2h_dev, 16), lambda: uva(h, g, h2d_dev, 16)),
            "uva32": (lambda: uva(g, h, d2h_dev, 32), lambda: uva(h, g, h2d_dev, 32)),
            "uva132": (lambda: uva(g, h, d2h_dev, 132), lambda: uva(h, g, h2d_dev, 132)),
        }
        # staged with a contiguous host side: device gather then one DMA (and the reverse).
        st = staging[:TOTAL].view(n, bs)
        gsel = torch.from_numpy(d2h[:, 0].copy()).to(dev)
        isel = torch.from_numpy(h2d[:, 1].copy()).to(dev)

        def staged_out():
            torch.index_select(g, 0, gsel, out=st)
            host[:TOTAL].copy_(staging[:TOTAL], non_blocking=True)

        def staged_in():
            staging[:TOTAL].copy_(host[TOTAL:], non_blocking=True)
            g.index_copy_(0, isel, st)
        cands["stagedC"] = (staged_out, staged_in)
        for name, (fo, fi) in cands.items():
            if name == "stagedC":
                r = (timed([(out_s, fo)]), timed([(in_s, fi)]), None)
            else:
                r = (timed([(out_s, fo)]), timed([(in_s, fi)]),
                     timed([(out_s, fo), (in_s, fi)]))
            row[name] = r
            torch.cuda.synchronize()
            if name != "stagedC":
                ok = torch.equal(h[d2h[:, 1]], g[d2h[:, 0]].cpu()) and torch.equal(
                    g[h2d[:, 1]].cpu(), h[h2d[:, 0]])
                row[name + "_ok"] = bool(ok)
        # host issue time of 1000 blocks (or n) per candidate
        m = min(1000, n)
        for name in ("dma1", "dma4"):
            k = 1 if name == "dma1" else 4
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dma(d2h[:m], gb, hb, out_s, k)
            row[name + "_issue_ms_1000"] = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
        # per-copy copy_ loop issue time
        t0 = time.perf_counter()
        with torch.cuda.stream(out_s):
            for gi, hi in d2h[:m].tolist():
                h[hi].copy_(g[gi], non_blocking=True)
        row["copy_loop_issue_ms_1000"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        if bs in (256 << 10, 2 << 20):
            for name in ("dma1", "dma2", "dma4", "uva8", "uva16", "uva132"):
                fo, fi = cands[name]
                both = row[name][2]
                rounds = int(mm_alone / both) + 2
                row["mm_" + name] = mm_time([(out_s, fo), (in_s, fi)], rounds) / mm_alone
        c0 = row["ceil"]
        line = f"{bs >> 10:>5}K ceil {TOTAL / c0[0] / 1e6:5.1f} {TOTAL / c0[1] / 1e6:5.1f} " \
               f"{2 * TOTAL / c0[2] / 1e6:5.1f} |"
        for name in cands:
            r = row[name]
            both = f"{c0[2] / r[2]:.2f}" if r[2] else "-"
            line += f" {name} {c0[0] / r[0]:.2f}/{c0[1] / r[1]:.2f}/{both}"
        print(line)
        print("   issue(ms/1000):", {k: round(v, 3) for k, v in row.items() if "issue" in k},
              "mm:", {k: round(v, 3) for k, v in row.items() if k.startswith("mm_")},
              "ok:", all(v for k, v in row.items() if k.endswith("_ok")))
        results["rows"].append(row)
        with open(f"{out_dir}/probe.json", "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
