"""`kvtier bench kernels`: the Triton kernels against torch on the same data, side by side.

Shapes are Llama-3-8B's (32 query heads, 8 kv heads, head dim 128, bfloat16) with 16-token
blocks in a cross-layer cache (4 layers, so that 4 x 128K tokens fit; one layer's strided
views are attended, as in the engine). Block tables are a random permutation of the cache's
blocks, as they are after some churn (`contiguous=True`: in order). SDPA runs on contiguous
copies of the same K/V. Each figure is the median of `triton.testing.do_bench` (L2 cleared
between runs), eager unless marked "graph" (replayed from a CUDA graph: no launch cost);
ratios compare numbers measured in the same run.

Decode reads every K/V byte once; its "copy share" is that traffic per second over the
bandwidth of a large device-to-device copy (bytes read plus bytes written), measured in the
same run. Goals (issue 14): paged decode <= 1.1x SDPA in every decode case, eager; paged
prefill <= 1.2x SDPA's flash backend for an 8K prompt and <= 1.1x for a 2K chunk after a
30K prefix; store_kv >= 0.8x the bandwidth of a device copy of the bytes it writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from kvtier.kernels import AttentionConfig, cudnn_backend, paged_attention, store_kv
from kvtier.kernels.cudnn_backend import cudnn_available, routes_to_cudnn
from kvtier.kernels.paged_decode import pick_config

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 32, 8, 128, 16
DTYPE = torch.bfloat16
SEED = 0
SCALE = HEAD_DIM ** -0.5

#: (batch, context) of the decode cases and (chunk, prefix) of the prefill cases (issue 14).
DECODE_CASES = ((32, 8192), (1, 32768), (64, 2048), (4, 131072))
PREFILL_CASES = ((8192, 0), (2048, 30720))
DECODE_GOAL, PREFILL_GOALS = 1.1, {0: 1.2, "prefix": 1.1}

#: Alternative tilings (block_q, tile_n, num_warps, num_stages) timed with --sweep;
#: decode entries keep the launcher's split count, then the split count varies alone.
DECODE_SWEEP = ((4, 64, 4, 3), (4, 128, 4, 2), (4, 32, 4, 2), (4, 64, 8, 2), (4, 128, 8, 2))
DECODE_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_SWEEP = ((32, 64, 8, 3), (32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 4),
                 (16, 128, 4, 3), (32, 64, 4, 3))


def median_ms(fn) -> float:
    """Median ms of `fn` (eager, L2 cleared before every run)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def graph_ms(fn) -> float | None:
    """Median ms of `fn` replayed from a CUDA graph (no launch overhead); None if capture
    fails."""
    import triton.testing

    try:
        fn()
        return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
    except Exception:  # noqa: BLE001 - a backend that cannot be captured is reported as None
        torch.cuda.synchronize()
        return None


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def _sdpa_call(backend, q, k, v, kwargs):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def time_sdpa(q, k, v, **kwargs) -> dict:
    """Median ms of SDPA as dispatched by default and of every backend that accepts the
    call; 'best' is the fastest backend."""
    times = {}
    default_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    for name, backend in _sdpa_backends().items():
        try:
            _sdpa_call(backend, q, k, v, kwargs)
        except RuntimeError:
            continue
        times[name] = median_ms(lambda b=backend: _sdpa_call(b, q, k, v, kwargs))
    assert times, "no SDPA backend accepted the call"
    best = min(times, key=times.get)
    return {"default_ms": default_ms, "ms_by_backend": times, "best_backend": best,
            "best_ms": times[best]}


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes read plus bytes written per second (GB/s) of one large device-to-device copy."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / ms / 1e6


class PagedSetup:
    """One cross-layer cache, block tables in random (or plain) order, and contiguous copies
    of the same K/V."""

    def __init__(self, num_blocks: int, device: torch.device, contiguous: bool = False) -> None:
        generator = torch.Generator(device=device).manual_seed(SEED)
        # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; layer 1 is attended.
        self.cache = torch.empty((num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS,
                                  HEAD_DIM), dtype=DTYPE, device=device)
        self.k_cache, self.v_cache = self.cache[:, 1, 0], self.cache[:, 1, 1]
        self.k_cache.normal_(generator=generator)
        self.v_cache.normal_(generator=generator)
        if contiguous:
            self.order = torch.arange(num_blocks, device=device)
        else:
            self.order = torch.randperm(num_blocks, generator=generator, device=device)
        self.device = device

    def batch(self, seq_lens: Sequence[int], q_lens: Sequence[int]) -> dict:
        """paged_attention's arguments for requests with these lengths (fresh queries)."""
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


def paged_fn(meta: dict, config: AttentionConfig | None):
    """A no-argument call of paged_attention on `meta` writing into one fixed output."""
    out = torch.empty_like(meta["query"])
    return lambda: paged_attention(**meta, softmax_scale=SCALE, out=out, config=config)


def auto_config(meta: dict) -> AttentionConfig:
    """The tiling the launcher picks for `meta`."""
    q = meta["query"]
    return pick_config(q.device, q.dtype, q.shape[0], meta["seq_lens"].shape[0], NUM_KV_HEADS,
                       NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, meta["max_query_len"],
                       meta["max_seq_len"])


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected|| in float32."""
    diff = (out.float() - expected.float()).norm()
    return float(diff / expected.float().norm())


def bench_decode(setup: PagedSetup, batch: int, context: int, copy_gbps: float,
                 configs: Sequence[AttentionConfig] = ()) -> dict:
    """One decode case: paged (eager and graph) against SDPA on contiguous K/V; `configs`
    are extra tilings timed eagerly."""
    meta = setup.batch([context] * batch, [1] * batch)
    k, v = setup.contiguous_kv(meta, context)
    q = meta["query"].view(batch, NUM_HEADS, 1, HEAD_DIM)
    sdpa_kwargs = {"scale": SCALE, "enable_gqa": True}
    paged = median_ms(paged_fn(meta, None))
    sdpa = time_sdpa(q, k, v, **sdpa_kwargs)
    out = paged_attention(**meta, softmax_scale=SCALE)
    best_backend = _sdpa_backends()[sdpa["best_backend"]]
    expected = _sdpa_call(best_backend, q, k, v, sdpa_kwargs)
    kv_bytes = 2 * k.numel() * k.element_size()
    graphs = {"paged_ms": graph_ms(paged_fn(meta, None)),
              "sdpa_default_ms": graph_ms(lambda: F.scaled_dot_product_attention(
                  q, k, v, **sdpa_kwargs)),
              "sdpa_best_ms": graph_ms(lambda: _sdpa_call(best_backend, q, k, v, sdpa_kwargs))}
    if graphs["paged_ms"] and graphs["sdpa_default_ms"] and graphs["sdpa_best_ms"]:
        graphs["ratio_vs_sdpa_default"] = graphs["paged_ms"] / graphs["sdpa_default_ms"]
        graphs["ratio_vs_sdpa_best"] = graphs["paged_ms"] / graphs["sdpa_best_ms"]
        graphs["copy_share"] = kv_bytes / graphs["paged_ms"] / 1e6 / copy_gbps
    result = {"batch": batch, "context": context, "config": str(auto_config(meta)),
              "kv_bytes": kv_bytes, "paged_ms": paged, "sdpa": sdpa,
              "ratio_vs_sdpa_default": paged / sdpa["default_ms"],
              "ratio_vs_sdpa_best": paged / sdpa["best_ms"], "cuda_graph": graphs,
              "paged_kv_gbps": kv_bytes / paged / 1e6,
              "copy_share": kv_bytes / paged / 1e6 / copy_gbps,
              "sdpa_copy_share": kv_bytes / sdpa["default_ms"] / 1e6 / copy_gbps,
              "rel_error": rel_error(out.view_as(expected), expected)}
    if configs:
        result["sweep"] = {str(c): median_ms(paged_fn(meta, c)) for c in configs}
    return result


def bench_prefill(setup: PagedSetup, chunk: int, prefix: int,
                  configs: Sequence[AttentionConfig] = ()) -> dict:
    """One prefill chunk of `chunk` queries after `prefix` cached tokens: paged against
    SDPA (every backend, flash named) on contiguous K/V expanded to the query heads, and
    the cudnn backend where it is available and takes the chunk ("cudnn": ms, ratios,
    error against the Triton kernel)."""
    from torch.nn.attention.bias import causal_lower_right

    seq_len = prefix + chunk
    meta = setup.batch([seq_len], [chunk])
    k, v = setup.contiguous_kv(meta, seq_len)
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)  # [1, heads, seq_len, d]
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    q = meta["query"].transpose(0, 1).unsqueeze(0)  # [1, heads, chunk, d]
    if prefix == 0:
        kwargs = {"is_causal": True, "scale": SCALE}
    else:
        kwargs = {"attn_mask": causal_lower_right(chunk, seq_len), "scale": SCALE}
    paged = median_ms(paged_fn(meta, None))
    sdpa = time_sdpa(q, k, v, **kwargs)
    out = paged_attention(**meta, softmax_scale=SCALE)
    expected = _sdpa_call(_sdpa_backends()[sdpa["best_backend"]], q, k, v, kwargs)
    flops = 4 * NUM_HEADS * HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
    flash_ms = sdpa["ms_by_backend"].get("flash")
    result = {"chunk": chunk, "prefix": prefix, "config": str(auto_config(meta)),
              "paged_ms": paged, "sdpa": sdpa,
              "ratio_vs_sdpa_flash": paged / flash_ms if flash_ms else None,
              "ratio_vs_sdpa_default": paged / sdpa["default_ms"],
              "ratio_vs_sdpa_best": paged / sdpa["best_ms"],
              "paged_tflops": flops / paged / 1e9,
              "sdpa_best_tflops": flops / sdpa["best_ms"] / 1e9,
              "rel_error": rel_error(out, expected[0].transpose(0, 1))}
    if cudnn_available() and routes_to_cudnn(meta["query"], 1, chunk):
        cudnn_out = torch.empty_like(meta["query"])
        cudnn_ms = median_ms(lambda: cudnn_backend.paged_attention(
            **meta, softmax_scale=SCALE, out=cudnn_out))
        result["cudnn"] = {"ms": cudnn_ms, "tflops": flops / cudnn_ms / 1e9,
                           "ratio_vs_sdpa_flash": cudnn_ms / flash_ms if flash_ms else None,
                           "ratio_vs_sdpa_default": cudnn_ms / sdpa["default_ms"],
                           "ratio_vs_triton": cudnn_ms / paged,
                           "rel_error": rel_error(cudnn_out, out)}
    if configs:
        result["sweep"] = {str(c): median_ms(paged_fn(meta, c)) for c in configs}
    return result


def bench_store_kv(num_tokens: int, device: torch.device) -> dict:
    """store_kv of a prefill into scattered blocks against a plain copy of the same bytes."""
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
    store_ms = median_ms(lambda: store_kv(key, value, k_cache, v_cache, slots))
    dst_k, dst_v = torch.empty_like(key), torch.empty_like(value)

    def copy_both() -> None:
        dst_k.copy_(key)
        dst_v.copy_(value)

    copy_ms = median_ms(copy_both)
    written = 2 * key.numel() * key.element_size()
    store_kv(key, value, k_cache, v_cache, slots)
    ok = bool(torch.equal(k_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots], key))
    return {"num_tokens": num_tokens, "bytes_written": written, "store_ms": store_ms,
            "d2d_copy_ms": copy_ms, "store_gbps": written / store_ms / 1e6,
            "d2d_gbps": written / copy_ms / 1e6, "ratio_vs_d2d": copy_ms / store_ms,
            "correct": ok}


def sweep_configs(meta_kind: str, auto: AttentionConfig) -> list[AttentionConfig]:
    """The alternative tilings --sweep times for a decode or prefill case."""
    if meta_kind == "decode":
        configs = [AttentionConfig(bq, tn, auto.num_splits, w, st)
                   for bq, tn, w, st in DECODE_SWEEP]
        configs += [AttentionConfig(auto.block_q, auto.tile_n, n, auto.num_warps,
                                    auto.num_stages) for n in DECODE_SPLITS]
        return configs
    return [AttentionConfig(bq, tn, auto.num_splits, w, st) for bq, tn, w, st in PREFILL_SWEEP]


def run_kernel_bench(decode_cases: Sequence[tuple[int, int]] = DECODE_CASES,
                     prefill_cases: Sequence[tuple[int, int]] = PREFILL_CASES,
                     store_tokens: Sequence[int] = (8192, 32768), contiguous: bool = False,
                     sweep: bool = False) -> dict:
    """Run every kernel benchmark on the current CUDA device; returns a JSON-able dict.

    decode_cases: (batch, context) pairs; prefill_cases: (chunk, prefix) pairs.
    Raises ValueError without CUDA (the kernels are GPU kernels; the CPU path is torch).
    """
    if not torch.cuda.is_available():
        raise ValueError("kvtier bench kernels needs a CUDA device")
    import triton

    device = torch.device("cuda")
    tokens_needed = max([b * c for b, c in decode_cases] + [p + c for c, p in prefill_cases])
    setup = PagedSetup(math.ceil(tokens_needed / BLOCK_SIZE) + 64, device, contiguous)
    copy_gbps = copy_bandwidth_gbps(device)
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                     "triton": triton.__version__, "block_order":
                     "contiguous" if contiguous else "random", "copy_gbps": copy_gbps,
                     "layout": {"num_layers": NUM_LAYERS, "num_heads": NUM_HEADS,
                                "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                                "block_size": BLOCK_SIZE, "dtype": str(DTYPE)}}
    results["decode"] = []
    for batch, context in decode_cases:
        configs = ()
        if sweep:
            configs = sweep_configs("decode", auto_config(setup.batch([context] * batch,
                                                                      [1] * batch)))
        results["decode"].append(bench_decode(setup, batch, context, copy_gbps, configs))
        torch.cuda.empty_cache()
    results["prefill"] = []
    for chunk, prefix in prefill_cases:
        configs = sweep_configs("prefill", auto_config(setup.batch([prefix + chunk], [chunk]))
                                ) if sweep else ()
        results["prefill"].append(bench_prefill(setup, chunk, prefix, configs))
        torch.cuda.empty_cache()
    del setup
    torch.cuda.empty_cache()
    results["store_kv"] = [bench_store_kv(n, device) for n in store_tokens]
    decode, prefill = results["decode"], results["prefill"]
    results["targets"] = {
        f"decode_le_{DECODE_GOAL}x_sdpa_default_eager": all(
            r["ratio_vs_sdpa_default"] <= DECODE_GOAL for r in decode),
        f"decode_le_{DECODE_GOAL}x_sdpa_best_eager": all(
            r["ratio_vs_sdpa_best"] <= DECODE_GOAL for r in decode),
        "prefill_le_goal_x_sdpa_flash": all(
            (r["ratio_vs_sdpa_flash"] or math.inf)
            <= PREFILL_GOALS[0 if r["prefix"] == 0 else "prefix"] for r in prefill),
        "store_kv_ge_0.8x_d2d": all(r["ratio_vs_d2d"] >= 0.8 for r in results["store_kv"]),
    }
    return results
