"""Host cost of the paged_attention launcher, and prefill through cuDNN on gathered K/V.

    python scripts/attention_launch_probe.py --out DIR [--stages host,prefill]

host: Python time per launcher call (the GPU kept busy so the queue never blocks), for the
prepared path and the full path (call_key disabled), and its pieces; eager do_bench and
CUDA-graph times of the decode cases against SDPA.
prefill: one layer of a 32K-token prompt in 8,192-token chunks (Llama-3-8B shapes): the
Triton prefill per chunk against gathering the request's K/V into contiguous scratch and
calling SDPA (cuDNN where it accepts the call), and the pieces of that path.
Writes DIR/launch_probe.json; prints a short table last.
"""

# ruff: noqa: B023 - every closure runs within its own loop iteration
from __future__ import annotations

import argparse
import importlib
import json
import math
import time
from pathlib import Path

import probe_timing
import torch
import torch.nn.functional as F
from kvtier.cli.bench import kernels as kb
from kvtier.kernels import reference
from kvtier.kernels._compiled_launch import CompiledLaunch
from kvtier.kernels.paged_attention import _attention_args, _paged_attention_kernel
from kvtier.kernels.paged_attention import paged_attention as launcher

pa_module = importlib.import_module("kvtier.kernels.paged_attention")
HYBRID_COUNTS: dict = {}
HYBRID = importlib.import_module("prefill_sdpa_probe").make_hybrid(launcher, HYBRID_COUNTS)
TABLE = probe_timing.Notes()
note = TABLE
RESULTS: dict = {}



def host_us(fn, calls: int = 200) -> float:
    return probe_timing.host_us(fn, calls, busy_cycles=100_000_000)


def py_us(fn, calls: int = 5000) -> float:
    """Python time of a host-only function."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def loop_event_us(fn, calls: int = 2000) -> float:
    """Per-call time of `calls` back-to-back calls by CUDA events (host- or GPU-bound)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


class FullPath:
    """paged_attention with the prepared path switched off (call_key answers None)."""

    def __enter__(self):
        self.saved = pa_module.call_key
        pa_module.call_key = lambda *args: None
        return self

    def __exit__(self, *exc):
        pa_module.call_key = self.saved


def stage_host(setup: kb.PagedSetup) -> None:
    out_rows = {}
    for batch, context in ((1, 32768), (1, 1024), (32, 8192), (64, 2048), (4, 131072)):
        meta = setup.batch([context] * batch, [1] * batch)
        out = torch.empty_like(meta["query"])
        call = lambda: launcher(**meta, softmax_scale=kb.SCALE, out=out)  # noqa: E731
        call_none = lambda: launcher(**meta, softmax_scale=kb.SCALE)  # noqa: E731
        row = {"prepared_host_us": host_us(call), "prepared_out_none_host_us": host_us(call_none)}
        with FullPath():
            row["full_host_us"] = host_us(call)
            row["full_do_bench_ms"] = kb.median_ms(call)
            row["full_loop_us"] = loop_event_us(call, 500)
        row["prepared_do_bench_ms"] = kb.median_ms(call)
        row["prepared_loop_us"] = loop_event_us(call, 500)
        row["graph_ms"] = kb.graph_ms(call)
        k, v = setup.contiguous_kv(meta, context)
        q = meta["query"].view(batch, kb.NUM_HEADS, 1, kb.HEAD_DIM)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=kb.SCALE,  # noqa: E731
                                                      enable_gqa=True)
        row["sdpa_do_bench_ms"] = kb.median_ms(sdpa)
        row["sdpa_host_us"] = host_us(sdpa)
        row["sdpa_graph_ms"] = kb.graph_ms(sdpa)
        expected = sdpa().view_as(out)
        row["rel_error"] = kb.rel_error(call(), expected)
        row["config"] = str(kb.auto_config(meta))
        out_rows[f"{batch}x{context}"] = row
        note(f"decode {batch}x{context}: host us prepared {row['prepared_host_us']:.1f} "
             f"(out=None {row['prepared_out_none_host_us']:.1f}) full {row['full_host_us']:.1f} "
             f"sdpa {row['sdpa_host_us']:.1f} | do_bench ms prepared "
             f"{row['prepared_do_bench_ms']:.4f} full {row['full_do_bench_ms']:.4f} sdpa "
             f"{row['sdpa_do_bench_ms']:.4f} ratio "
             f"{row['prepared_do_bench_ms'] / row['sdpa_do_bench_ms']:.2f} "
             f"| graph {row['graph_ms']} sdpa {row['sdpa_graph_ms']} | loop us prepared "
             f"{row['prepared_loop_us']:.1f} full {row['full_loop_us']:.1f} "
             f"| err {row['rel_error']:.1e}")
        if (batch, context) == (1, 32768):
            pieces(meta, out)
    RESULTS["host"] = out_rows


def pieces(meta: dict, out: torch.Tensor) -> None:
    """Python time of the launcher's pieces for one call geometry."""
    from kvtier.kernels._attention_checks import looks_valid
    from kvtier.kernels._attention_launch import call_key
    from kvtier.kernels.paged_decode import pick_config, split_scratch

    q, k, v = meta["query"], meta["k_cache"], meta["v_cache"]
    qsl, sl, bt = meta["query_start_loc"], meta["seq_lens"], meta["block_tables"]
    config = kb.auto_config(meta)
    part_out, part_lse = split_scratch(config.num_splits, *q.shape, device=q.device)
    args = _attention_args(q, k, v, out, part_out, part_lse, qsl, sl, bt, 0.1, config)
    grid = (q.shape[0] // config.block_q + sl.shape[0], k.shape[2], config.num_splits)
    compiled = _paged_attention_kernel[grid](*args, num_warps=config.num_warps,
                                             num_stages=config.num_stages)
    handle = CompiledLaunch.of(compiled, grid)
    stream = torch.cuda.current_stream().cuda_stream
    row = {
        "call_key": py_us(lambda: call_key(q, k, v, qsl, sl, bt, out)),
        "looks_valid": py_us(lambda: looks_valid(q, k, v, qsl, sl, bt, out)),
        "pick_config": py_us(lambda: pick_config(q.device, q.dtype, q.shape[0], sl.shape[0], 8,
                                                 4, 128, 1, meta["max_seq_len"])),
        "split_scratch": py_us(lambda: split_scratch(config.num_splits, *q.shape,
                                                     device=q.device)),
        "empty_like": py_us(lambda: torch.empty_like(q)),
        "attention_args": py_us(lambda: _attention_args(q, k, v, out, part_out, part_lse, qsl,
                                                        sl, bt, 0.1, config)),
        "jit_launch": host_us(lambda: _paged_attention_kernel[grid](
            *args, num_warps=config.num_warps, num_stages=config.num_stages)),
        "handle_launch": host_us(lambda: handle(stream, args)) if handle else None,
    }
    RESULTS["pieces_1x32768_us"] = row
    note("pieces 1x32K (us): " + ", ".join(
        f"{name} {value:.1f}" if value is not None else f"{name} -" for name, value in row.items()))


def gather_kv(k_cache, v_cache, block_table, seq_len, group, k_out, v_out) -> None:
    """K/V of one request, [1, heads, seq_len, d] (query heads: each kv head repeated)."""
    n = math.ceil(seq_len / kb.BLOCK_SIZE)
    ids = block_table[:n].long()
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    for cache, dst in ((k_cache, k_out), (v_cache, v_out)):
        src = cache[ids].view(n * kb.BLOCK_SIZE, kv_heads, 1, d)[:seq_len]  # [S, kv, 1, d]
        dst.view(seq_len, kv_heads, group, d).copy_(src.expand(seq_len, kv_heads, group, d))


def stage_prefill(setup: kb.PagedSetup) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    prompt, chunk = 32768, 8192
    group = kb.NUM_HEADS // kb.NUM_KV_HEADS
    device = setup.device
    # Scratch for the whole prompt: [S, heads, d] (SDPA sees [1, heads, S, d] views).
    k_scratch = torch.empty(prompt, kb.NUM_HEADS, kb.HEAD_DIM, dtype=kb.DTYPE, device=device)
    v_scratch = torch.empty_like(k_scratch)
    rows = []
    totals: dict[str, float] = {}
    for prefix in range(0, prompt, chunk):
        seq_len = prefix + chunk
        meta = setup.batch([seq_len], [chunk])
        table = meta["block_tables"][0]
        q = meta["query"].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d] strided view
        k = k_scratch[:seq_len].transpose(0, 1).unsqueeze(0)
        v = v_scratch[:seq_len].transpose(0, 1).unsqueeze(0)
        row: dict = {"prefix": prefix, "chunk": chunk}
        row["paged_ms"] = kb.median_ms(kb.paged_fn(meta, None))
        gather = lambda: gather_kv(meta["k_cache"], meta["v_cache"], table,  # noqa: E731
                                   seq_len, group, k_scratch[:seq_len], v_scratch[:seq_len])
        row["gather_ms"] = kb.median_ms(gather)
        gather()
        expected = launcher(**meta, softmax_scale=kb.SCALE)  # [chunk, heads, d]
        mask = causal_lower_right(chunk, seq_len) if prefix else None
        variants = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
                    "flash": SDPBackend.FLASH_ATTENTION}
        for name, backend in variants.items():
            kwargs = {"scale": kb.SCALE}
            if prefix:
                kwargs["attn_mask"] = mask
            else:
                kwargs["is_causal"] = True

            def sdpa(backend=backend, kwargs=kwargs):
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, **kwargs)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, **kwargs)
            try:
                got = sdpa()
            except RuntimeError as error:
                row[f"{name}_error"] = str(error).splitlines()[0][:120]
                continue
            row[f"{name}_ms"] = kb.median_ms(sdpa)
            row[f"{name}_rel_error"] = kb.rel_error(got[0].transpose(0, 1), expected)
        if prefix:
            # cuDNN with is_causal on a chunk after a prefix: which diagonal does it use?
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    got = F.scaled_dot_product_attention(q, k, v, scale=kb.SCALE, is_causal=True)
                row["cudnn_is_causal_rel_error"] = kb.rel_error(got[0].transpose(0, 1), expected)
            except RuntimeError as error:
                row["cudnn_is_causal_error"] = str(error).splitlines()[0][:120]
            split = split_prefix_sdpa(q, k, v, prefix, chunk)
            if split is not None:
                fn, out = split
                row["cudnn_split_ms"] = kb.median_ms(fn)
                row["cudnn_split_rel_error"] = kb.rel_error(out()[0].transpose(0, 1), expected)
        hybrid_out = torch.empty_like(meta["query"])
        hybrid_fn = lambda: HYBRID(**meta, softmax_scale=kb.SCALE, out=hybrid_out)  # noqa: E731
        row["hybrid_ms"] = kb.median_ms(hybrid_fn)
        row["hybrid_rel_error"] = kb.rel_error(hybrid_fn(), expected)
        if prefix == 0:
            ref_out = reference_chunk(meta)
            row["paged_vs_fp32_ref"] = kb.rel_error(expected, ref_out)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                got = F.scaled_dot_product_attention(q, k, v, scale=kb.SCALE, is_causal=True)
            row["cudnn_vs_fp32_ref"] = kb.rel_error(got[0].transpose(0, 1), ref_out)
        rows.append(row)
        for name in ("paged_ms", "gather_ms", "default_ms", "cudnn_ms", "flash_ms",
                     "cudnn_split_ms", "hybrid_ms"):
            value = row.get(name)
            if value is None and name == "cudnn_split_ms":
                value = row.get("cudnn_ms")  # the first chunk has no prefix: plain causal
            if value is not None:
                totals[name] = totals.get(name, 0.0) + value
        note("prefill " + json.dumps({key: (round(val, 4) if isinstance(val, float) else val)
                                      for key, val in row.items()}))
        torch.cuda.empty_cache()
    RESULTS["prefill"] = {"rows": rows, "totals_ms_per_layer": totals,
                          "hybrid_chunks": HYBRID_COUNTS}
    note("prefill 32K in 8K chunks, one layer, totals ms: "
         + ", ".join(f"{name} {value:.3f}" for name, value in totals.items())
         + f"; hybrid chunks {HYBRID_COUNTS}")


def reference_chunk(meta: dict) -> torch.Tensor:
    """The float32 reference of a chunk (on the GPU, through kernels.reference)."""
    return reference.paged_attention(meta["query"], meta["k_cache"], meta["v_cache"],
                                     meta["query_start_loc"], meta["seq_lens"],
                                     meta["block_tables"], meta["max_query_len"],
                                     meta["max_seq_len"], kb.SCALE)


def split_prefix_sdpa(q, k, v, prefix: int, chunk: int):
    """(timed fn, output fn) of the chunk as cuDNN over the prefix (no mask) plus cuDNN over
    the chunk (causal), merged by their log-sum-exps; None if cuDNN refuses."""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention

    def run():
        o1, lse1 = op(q, k[:, :, :prefix], v[:, :, :prefix], None, True, 0.0, False, False,
                      scale=kb.SCALE)[:2]
        o2, lse2 = op(q, k[:, :, prefix:], v[:, :, prefix:], None, True, 0.0, True, False,
                      scale=kb.SCALE)[:2]
        lse1, lse2 = lse1.view(1, q.shape[1], chunk, 1), lse2.view(1, q.shape[1], chunk, 1)
        top = torch.maximum(lse1, lse2)
        w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
        return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)

    try:
        run()
    except (RuntimeError, TypeError) as error:
        RESULTS.setdefault("cudnn_split_errors", []).append(str(error).splitlines()[0][:160])
        return None
    return run, run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--stages", default="host,prefill")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    stages = options.stages.split(",")
    device = torch.device("cuda")
    RESULTS["device"] = torch.cuda.get_device_name(device)
    setup = kb.PagedSetup(math.ceil(4 * 131072 / kb.BLOCK_SIZE) + 64, device)
    if "host" in stages:
        stage_host(setup)
    if "prefill" in stages:
        stage_prefill(setup)
    (options.out / "launch_probe.json").write_text(json.dumps(RESULTS, indent=1))
    print("==== summary")
    print("\n".join(TABLE))


if __name__ == "__main__":
    main()
