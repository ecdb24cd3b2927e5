"""`kvtier bench kernels`: the Triton kernels against torch on the same data, side by side.

Shapes are Llama-3-8B's (32 query heads, 8 kv heads, head dim 128, bfloat16) with 16-token
blocks in the cross-layer cache (32 layers; one layer's strided views are attended). Each
figure is the median of `triton.testing.do_bench` (which clears L2 between runs); ratios
compare numbers measured in the same run. Targets: paged decode <= 1.15x torch SDPA over
contiguous KV (reported against SDPA's default dispatch and its fastest backend, eager and
replayed from CUDA graphs), paged prefill <= 1.5x SDPA's flash backend (and the fastest),
store_kv >= 0.8x the bandwidth of a device-to-device copy of the bytes it writes.

    python -m kvtier.cli.bench.kernels [--json out.json] [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from kvtier.kernels import AttentionConfig, paged_attention, store_kv
from kvtier.kernels.paged_decode import pick_config

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 8, 128, 16
DTYPE = torch.bfloat16
SEED = 0

#: Alternative tilings (block_q, tile_n, num_warps, num_stages) timed with --sweep;
#: decode entries keep the launcher's split count, then the split count varies alone.
DECODE_SWEEP = [(4, 64, 4, 3), (4, 128, 4, 2), (4, 32, 4, 2), (4, 64, 8, 2), (4, 128, 8, 2)]
DECODE_SPLITS = (1, 2, 3, 4, 8, 16, 32, 64, 128)
PREFILL_SWEEP = [(32, 64, 8, 4), (32, 128, 8, 3), (32, 64, 4, 3), (16, 64, 4, 3),
                 (32, 32, 4, 3)]


def _median_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def _graph_ms(fn) -> float | None:
    """Median ms of `fn` replayed from a CUDA graph (no launch overhead); None if capture
    fails."""
    import triton.testing

    try:
        fn()
        return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception:  # noqa: BLE001 - a backend that cannot be captured is reported as None
        torch.cuda.synchronize()
        return None


def _best_sdpa(q, k, v, **kwargs) -> dict:
    """Median ms of SDPA as dispatched by default and of every backend that accepts the
    call; 'best' is the fastest backend."""
    from torch.nn.attention import sdpa_kernel

    times = {}
    default_ms = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    for name, backend in _sdpa_backends().items():
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, **kwargs)
                times[name] = _median_ms(lambda b=backend: _sdpa_call(b, q, k, v, kwargs))
        except RuntimeError:
            continue
    assert times, "no SDPA backend accepted the call"
    best = min(times, key=times.get)
    return {"default_ms": default_ms, "ms_by_backend": times, "best_backend": best,
            "best_ms": times[best]}


def _sdpa_call(backend, q, k, v, kwargs):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


class PagedSetup:
    """One cross-layer cache, scattered block tables, and contiguous copies of the same KV."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        generator = torch.Generator(device=device).manual_seed(SEED)
        # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; only layer 0 is filled.
        self.cache = torch.empty((num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS,
                                  HEAD_DIM), dtype=DTYPE, device=device)
        self.k_cache, self.v_cache = self.cache[:, 0, 0], self.cache[:, 0, 1]
        self.k_cache.normal_(generator=generator)
        self.v_cache.normal_(generator=generator)
        self.order = torch.randperm(num_blocks, generator=generator, device=device)
        self.device = device

    def batch(self, seq_lens: list[int], q_lens: list[int]) -> dict:
        """Metadata for requests with these lengths, plus their contiguous [B, kvh, S, d] K/V."""
        blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
        tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32,
                             device=self.device)
        used = 0
        for r, n in enumerate(blocks):
            tables[r, :n] = self.order[used:used + n].to(torch.int32)
            used += n
        assert used <= self.cache.shape[0], "benchmark cache too small"
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        generator = torch.Generator(device=self.device).manual_seed(SEED + 1)
        query = torch.randn((starts[-1], NUM_HEADS, HEAD_DIM), generator=generator,
                            device=self.device, dtype=DTYPE)
        return {"query": query, "k_cache": self.k_cache, "v_cache": self.v_cache,
                    "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=self.device),
                    "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                    "block_tables": tables, "max_query_len": max(q_lens),
                    "max_seq_len": max(seq_lens)}

    def contiguous_kv(self, meta: dict, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_reqs, kv_heads, seq_len, head_dim] copies of every request's K and V."""
        n = math.ceil(seq_len / BLOCK_SIZE)
        ids = meta["block_tables"][:, :n].long()
        k = self.k_cache[ids].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        v = self.v_cache[ids].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        return k, v


def _paged_ms(meta: dict, config: AttentionConfig | None) -> float:
    out = torch.empty_like(meta["query"])
    scale = HEAD_DIM ** -0.5
    return _median_ms(lambda: paged_attention(**meta, softmax_scale=scale, out=out,
                                              config=config))


def _auto_config(meta: dict) -> AttentionConfig:
    q = meta["query"]
    return pick_config(q.device, q.dtype, q.shape[0], meta["seq_lens"].shape[0], NUM_KV_HEADS,
                       NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, meta["max_query_len"],
                       meta["max_seq_len"])


def bench_decode(setup: PagedSetup, batch: int, context: int, sweep: bool) -> dict:
    meta = setup.batch([context] * batch, [1] * batch)
    k, v = setup.contiguous_kv(meta, context)
    q = meta["query"].view(batch, NUM_HEADS, 1, HEAD_DIM)
    config = _auto_config(meta)
    paged = _paged_ms(meta, None)
    sdpa = _best_sdpa(q, k, v, scale=HEAD_DIM ** -0.5, enable_gqa=True)
    out = paged_attention(**meta, softmax_scale=HEAD_DIM ** -0.5)
    expected = _sdpa_call(_sdpa_backends()[sdpa["best_backend"]], q, k, v,
                          {"scale": HEAD_DIM ** -0.5, "enable_gqa": True})
    kv_bytes = 2 * k.numel() * k.element_size()
    graph_out = torch.empty_like(meta["query"])
    best_backend = _sdpa_backends()[sdpa["best_backend"]]
    sdpa_kwargs = {"scale": HEAD_DIM ** -0.5, "enable_gqa": True}
    graphs = {
        "paged_ms": _graph_ms(lambda: paged_attention(**meta, softmax_scale=HEAD_DIM ** -0.5,
                                                      out=graph_out)),
        "sdpa_default_ms": _graph_ms(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                            **sdpa_kwargs)),
        "sdpa_best_ms": _graph_ms(lambda: _sdpa_call(best_backend, q, k, v, sdpa_kwargs)),
    }
    result = {"batch": batch, "context": context, "config": str(config), "paged_ms": paged,
              "sdpa": sdpa, "ratio_vs_sdpa_default": paged / sdpa["default_ms"],
              "ratio_vs_sdpa_best": paged / sdpa["best_ms"], "cuda_graph": graphs,
              "paged_kv_gbps": kv_bytes / paged / 1e6,
              "sdpa_best_kv_gbps": kv_bytes / sdpa["best_ms"] / 1e6,
              "max_abs_diff": float((out.view_as(expected) - expected).abs().max())}
    if graphs["paged_ms"] and graphs["sdpa_default_ms"] and graphs["sdpa_best_ms"]:
        graphs["ratio_vs_sdpa_default"] = graphs["paged_ms"] / graphs["sdpa_default_ms"]
        graphs["ratio_vs_sdpa_best"] = graphs["paged_ms"] / graphs["sdpa_best_ms"]
        graphs["paged_kv_gbps"] = kv_bytes / graphs["paged_ms"] / 1e6
    if sweep:
        configs = [AttentionConfig(bq, tn, config.num_splits, w, st)
                   for bq, tn, w, st in DECODE_SWEEP]
        configs += [AttentionConfig(config.block_q, config.tile_n, n, config.num_warps,
                                    config.num_stages) for n in DECODE_SPLITS]
        result["sweep"] = {str(c): _paged_ms(meta, c) for c in configs}
    return result


def bench_prefill(setup: PagedSetup, chunk: int, prefix: int, sweep: bool) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    seq_len = prefix + chunk
    meta = setup.batch([seq_len], [chunk])
    k, v = setup.contiguous_kv(meta, seq_len)
    # Prefill is compute-bound: SDPA gets K/V already expanded to the query heads.
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    q = meta["query"].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
    if prefix == 0:
        kwargs = {"is_causal": True, "scale": HEAD_DIM ** -0.5}
    else:
        kwargs = {"attn_mask": causal_lower_right(chunk, seq_len), "scale": HEAD_DIM ** -0.5}
    config = _auto_config(meta)
    paged = _paged_ms(meta, None)
    sdpa = _best_sdpa(q, k, v, **kwargs)
    out = paged_attention(**meta, softmax_scale=HEAD_DIM ** -0.5)
    expected = _sdpa_call(_sdpa_backends()[sdpa["best_backend"]], q, k, v, kwargs)
    flops = 4 * NUM_HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
    flash_ms = sdpa["ms_by_backend"].get("flash")
    result = {"chunk": chunk, "prefix": prefix, "config": str(config), "paged_ms": paged,
              "sdpa": sdpa, "ratio_vs_sdpa_flash": paged / flash_ms if flash_ms else None,
              "ratio_vs_sdpa_best": paged / sdpa["best_ms"],
              "paged_tflops": flops / paged / 1e9, "sdpa_tflops": flops / sdpa["best_ms"] / 1e9,
              "max_abs_diff": float((out - expected[0].transpose(0, 1)).abs().max())}
    if sweep:
        configs = [AttentionConfig(bq, tn, 1, w, st) for bq, tn, w, st in PREFILL_SWEEP]
        result["sweep"] = {str(c): _paged_ms(meta, c) for c in configs}
    return result


def bench_store_kv(num_tokens: int, device: torch.device) -> dict:
    generator = torch.Generator(device=device).manual_seed(SEED)
    num_blocks = 2 * num_tokens // BLOCK_SIZE
    cache = torch.empty((num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
                        dtype=DTYPE, device=device)
    k_cache, v_cache = cache[:, 3, 0], cache[:, 3, 1]
    key = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=generator,
                      device=device, dtype=DTYPE)
    value = torch.randn_like(key)
    # A prefill into freshly allocated, scattered blocks: 16 consecutive slots per block.
    blocks = torch.randperm(num_blocks, generator=generator, device=device)[:num_tokens // 16]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()
    store_ms = _median_ms(lambda: store_kv(key, value, k_cache, v_cache, slots))
    dst_k, dst_v = torch.empty_like(key), torch.empty_like(value)

    def copy_both() -> None:
        dst_k.copy_(key)
        dst_v.copy_(value)

    copy_ms = _median_ms(copy_both)
    written = 2 * key.numel() * key.element_size()
    store_kv(key, value, k_cache, v_cache, slots)
    ok = bool(torch.equal(k_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots], key))
    return {"num_tokens": num_tokens, "bytes_written": written, "store_ms": store_ms,
            "d2d_copy_ms": copy_ms, "store_gbps": written / store_ms / 1e6,
            "d2d_gbps": written / copy_ms / 1e6, "ratio_vs_d2d": copy_ms / store_ms,
            "correct": ok}


def run_kernel_bench(batch: int = 32, context: int = 8192,
                     long_contexts: tuple[int, ...] = (32768, 131072), prefill_chunk: int = 4096,
                     prefix: int = 28672, store_tokens: tuple[int, ...] = (8192, 32768),
                     sweep: bool = False) -> dict:
    """Run every kernel benchmark on the current CUDA device; returns a JSON-able dict.

    Raises ValueError without CUDA (the kernels are GPU kernels; the CPU path is torch).
    """
    if not torch.cuda.is_available():
        raise ValueError("kvtier bench kernels needs a CUDA device")
    device = torch.device("cuda")
    tokens_needed = max(batch * context, *long_contexts, prefix + prefill_chunk)
    setup = PagedSetup(math.ceil(tokens_needed / BLOCK_SIZE) + batch, device)
    results: dict = {"device": torch.cuda.get_device_name(device),
                     "torch": torch.__version__, "layout": {
                         "num_layers": NUM_LAYERS, "num_heads": NUM_HEADS,
                         "num_kv_heads": NUM_KV_HEADS,
                         "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": str(DTYPE)}}
    import triton

    results["triton"] = triton.__version__
    results["decode"] = [bench_decode(setup, batch, context, sweep)]
    for long_context in long_contexts:
        results["decode"].append(bench_decode(setup, 1, long_context, sweep))
    results["prefill"] = [bench_prefill(setup, prefill_chunk, 0, sweep),
                          bench_prefill(setup, prefill_chunk, prefix, sweep)]
    del setup
    torch.cuda.empty_cache()
    results["store_kv"] = [bench_store_kv(n, device) for n in store_tokens]
    decode, prefill = results["decode"], results["prefill"]
    results["targets"] = {
        "decode_le_1.15x_sdpa_default": all(r["ratio_vs_sdpa_default"] <= 1.15 for r in decode),
        "decode_le_1.15x_sdpa_best": all(r["ratio_vs_sdpa_best"] <= 1.15 for r in decode),
        "prefill_le_1.5x_sdpa_flash": all((r["ratio_vs_sdpa_flash"] or 9) <= 1.5
                                          for r in prefill),
        "prefill_le_1.5x_sdpa_best": all(r["ratio_vs_sdpa_best"] <= 1.5 for r in prefill),
        "store_kv_ge_0.8x_d2d": all(r["ratio_vs_d2d"] >= 0.8 for r in results["store_kv"]),
    }
    return results


def _print_table(results: dict) -> None:
    print(f"{results['device']}  torch {results['torch']}  triton {results['triton']}")
    for r in results["decode"]:
        g = r["cuda_graph"]
        print(f"decode  batch {r['batch']:>3} ctx {r['context']:>6}: paged {r['paged_ms']:.3f} ms "
              f"({r['paged_kv_gbps']:.0f} GB/s)  sdpa default {r['sdpa']['default_ms']:.3f} ms, "
              f"best[{r['sdpa']['best_backend']}] {r['sdpa']['best_ms']:.3f} ms  ratios "
              f"{r['ratio_vs_sdpa_default']:.2f} / {r['ratio_vs_sdpa_best']:.2f};  graphs: "
              f"paged {g['paged_ms']} sdpa default {g['sdpa_default_ms']} best "
              f"{g['sdpa_best_ms']}")
    for r in results["prefill"]:
        flash = r["ratio_vs_sdpa_flash"]
        print(f"prefill chunk {r['chunk']} prefix {r['prefix']:>6}: paged {r['paged_ms']:.3f} ms "
              f"({r['paged_tflops']:.0f} TFLOP/s)  sdpa best[{r['sdpa']['best_backend']}] "
              f"{r['sdpa']['best_ms']:.3f} ms  ratio vs flash "
              f"{flash if flash is None else round(flash, 2)}, vs best "
              f"{r['ratio_vs_sdpa_best']:.2f}")
    for r in results["store_kv"]:
        print(f"store_kv {r['num_tokens']} tokens: {r['store_gbps']:.0f} GB/s vs d2d "
              f"{r['d2d_gbps']:.0f} GB/s  ratio {r['ratio_vs_d2d']:.2f}")
    print("targets:", results["targets"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--sweep", action="store_true", help="also time alternative tilings")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        results = run_kernel_bench(batch=4, context=2048, long_contexts=(8192,),
                                   prefill_chunk=1024, prefix=3072, store_tokens=(4096,),
                                   sweep=args.sweep)
    else:
        results = run_kernel_bench(batch=args.batch, context=args.context, sweep=args.sweep)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
