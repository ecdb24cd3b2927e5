"""Attention sweep for the lent GPU: every table case of issue 14, several tilings each,
checked against SDPA, plus the engine's 32K-token TTFT against transformers' forward.

    python scripts/gpu_attention.py --out DIR [--stages decode,prefill,e2e]

Writes DIR/attention_sweep.json and prints a short table last. Timings are medians of
triton.testing.do_bench (eager, L2 cleared) unless marked graph.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import probe_timing
import torch
from kvtier.cli.bench import kernels as kb
from kvtier.kernels import AttentionConfig

TABLE = probe_timing.Notes()
note = TABLE



def host_us(fn, calls: int = 50) -> float:
    return probe_timing.host_us(fn, calls, busy_cycles=50_000_000)


def decode_variants(auto: AttentionConfig) -> dict[str, AttentionConfig]:
    s = auto.num_splits
    variants = {
        "auto": auto,
        "tile128 w4 s2": AttentionConfig(auto.block_q, 128, s, 4, 2),
        "tile64 w4 s3": AttentionConfig(auto.block_q, 64, s, 4, 3),
        "tile64 w2 s2": AttentionConfig(auto.block_q, 64, s, 2, 2),
        "tile32 w4 s3": AttentionConfig(auto.block_q, 32, s, 4, 3),
    }
    for factor in (0.5, 2):
        n = max(1, int(s * factor))
        variants[f"splits {n}"] = AttentionConfig(auto.block_q, auto.tile_n, n,
                                                  auto.num_warps, auto.num_stages)
    return variants


#: (block_q, tile_n, num_warps, num_stages) of the prefill tilings tried.
PREFILL_TILINGS = ((32, 128, 8, 3), (32, 128, 8, 2), (32, 64, 8, 4), (32, 64, 8, 2),
                   (64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 3), (16, 64, 4, 3),
                   (16, 128, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2))


def prefill_variants(auto: AttentionConfig) -> dict[str, AttentionConfig]:
    s = auto.num_splits
    variants = {"auto": auto}
    for bq, tn, w, st in PREFILL_TILINGS:
        variants[f"q{bq} t{tn} w{w} s{st}"] = AttentionConfig(bq, tn, s, w, st)
    if s > 1:
        for n in (1, 2 * s):
            variants[f"splits {n}"] = AttentionConfig(auto.block_q, auto.tile_n, n,
                                                      auto.num_warps, auto.num_stages)
    return variants


def time_variants(meta: dict, variants: dict[str, AttentionConfig], expected: torch.Tensor,
                  view) -> dict[str, dict]:
    rows = {}
    for name, config in variants.items():
        fn = kb.paged_fn(meta, config)
        try:
            out = kb.paged_attention(**meta, softmax_scale=kb.SCALE, config=config)
            err = kb.rel_error(view(out), expected)
            ms = kb.median_ms(fn)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported
            rows[name] = {"config": str(config), "error": repr(exc)[:300]}
            print(f"  {name}: FAILED {exc!r}"[:300], flush=True)
            continue
        rows[name] = {"config": str(config), "ms": ms, "rel_error": err}
        print(f"  {name:22s} {ms:.4f} ms  err {err:.1e}  {config}", flush=True)
    return rows


def run_decode(setup: kb.PagedSetup, copy_gbps: float) -> list[dict]:
    results = []
    for batch, context in kb.DECODE_CASES:
        results.append(decode_case(setup, batch, context, copy_gbps))
        torch.cuda.empty_cache()
    return results


def decode_case(setup: kb.PagedSetup, batch: int, context: int, copy_gbps: float) -> dict:
    import torch.nn.functional as F

    meta = setup.batch([context] * batch, [1] * batch)
    k, v = setup.contiguous_kv(meta, context)
    q = meta["query"].view(batch, kb.NUM_HEADS, 1, kb.HEAD_DIM)
    kwargs = {"scale": kb.SCALE, "enable_gqa": True}
    sdpa = kb.time_sdpa(q, k, v, **kwargs)
    sdpa_graph = kb.graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    auto = kb.auto_config(meta)
    print(f"decode batch {batch} ctx {context}: sdpa {sdpa}", flush=True)
    rows = time_variants(meta, decode_variants(auto), expected,
                         lambda out: out.view_as(expected))
    kv_bytes = 2 * k.numel() * k.element_size()
    paged_graph = kb.graph_ms(kb.paged_fn(meta, None))
    host = host_us(kb.paged_fn(meta, None))
    sdpa_host = host_us(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    best_name = min((n for n in rows if "ms" in rows[n]), key=lambda n: rows[n]["ms"])
    auto_ms = rows["auto"]["ms"]
    note(f"decode b{batch:<3} ctx{context:>6}: auto {auto_ms:.4f} ms "
         f"({auto_ms / sdpa['default_ms']:.2f}x sdpa {sdpa['default_ms']:.4f}, "
         f"best sdpa[{sdpa['best_backend']}] {sdpa['best_ms']:.4f}) share "
         f"{kv_bytes / auto_ms / 1e6 / copy_gbps:.2f}; graph {paged_graph} vs {sdpa_graph}; "
         f"host {host:.0f}us vs {sdpa_host:.0f}us; best variant {best_name} "
         f"{rows[best_name]['ms']:.4f} ({rows[best_name]['config']})")
    return {"batch": batch, "context": context, "sdpa": sdpa, "sdpa_graph_ms": sdpa_graph,
            "paged_graph_ms": paged_graph, "host_us": host, "sdpa_host_us": sdpa_host,
            "variants": rows, "kv_bytes": kv_bytes, "best": best_name}


def run_prefill(setup: kb.PagedSetup) -> list[dict]:
    from torch.nn.attention.bias import causal_lower_right

    results = []
    for chunk, prefix in kb.PREFILL_CASES:
        seq_len = prefix + chunk
        meta = setup.batch([seq_len], [chunk])
        k, v = setup.contiguous_kv(meta, seq_len)
        k = k.repeat_interleave(kb.NUM_HEADS // kb.NUM_KV_HEADS, dim=1)
        v = v.repeat_interleave(kb.NUM_HEADS // kb.NUM_KV_HEADS, dim=1)
        q = meta["query"].transpose(0, 1).unsqueeze(0)
        kwargs = ({"is_causal": True, "scale": kb.SCALE} if prefix == 0 else
                  {"attn_mask": causal_lower_right(chunk, seq_len), "scale": kb.SCALE})
        sdpa = kb.time_sdpa(q, k, v, **kwargs)
        expected = kb._sdpa_call(kb._sdpa_backends()["flash"], q, k, v, kwargs)[0]
        expected = expected.transpose(0, 1)
        auto = kb.auto_config(meta)
        print(f"prefill chunk {chunk} prefix {prefix}: sdpa {sdpa}", flush=True)
        rows = time_variants(meta, prefill_variants(auto), expected, lambda out: out)
        flops = 4 * kb.NUM_HEADS * kb.HEAD_DIM * chunk * (prefix + (chunk + 1) / 2)
        best_name = min((n for n in rows if "ms" in rows[n]), key=lambda n: rows[n]["ms"])
        flash = sdpa["ms_by_backend"].get("flash")
        results.append({"chunk": chunk, "prefix": prefix, "sdpa": sdpa, "variants": rows,
                        "best": best_name, "flops": flops})
        auto_ms = rows["auto"]["ms"]
        note(f"prefill {chunk}+{prefix}: auto {auto_ms:.3f} ms ({flops / auto_ms / 1e9:.0f} "
             f"TFLOP/s) vs flash {flash} ({auto_ms / flash:.2f}x), default "
             f"{sdpa['default_ms']:.3f}; best variant {best_name} {rows[best_name]['ms']:.3f} "
             f"({rows[best_name]['ms'] / flash:.2f}x flash)")
        del k, v
        torch.cuda.empty_cache()
    return results


def patch_prefill_tiling(tiling: AttentionConfig) -> None:
    """Make the launcher use `tiling` (keeping its own split count) for prefill batches."""
    import dataclasses

    module = sys.modules["kvtier.kernels.paged_attention"]
    original = module.pick_config

    def pick(*args, **kwargs):
        config = original(*args, **kwargs)
        if config.block_q == 4 or args[1] == torch.float32:  # decode-shaped or float32
            return config
        return dataclasses.replace(tiling, num_splits=config.num_splits)

    module.pick_config = pick


def run_e2e(prompt_tokens: int, max_batched: int) -> dict:
    """Engine TTFT of fresh random prompts against transformers' forward on the same
    weights, plus a kernel-time breakdown of one engine prefill."""
    import numpy as np
    from kvtier.cli.bench.serve import hf_twin
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.loader import load_model

    start = time.perf_counter()
    loaded = load_model("random:llama3-8b", torch.device("cuda"), "bfloat16")
    print(f"loaded in {time.perf_counter() - start:.1f}s", flush=True)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, vocab, prompt_tokens).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    blocks = 3 * (prompt_tokens // 16 + 4)
    result: dict = {}
    start = time.perf_counter()
    with LLM(loaded, gpu_blocks=blocks, max_num_batched_tokens=max_batched, host_cache=False,
             disk_cache=False, cuda_graphs=False, max_num_seqs=8) as llm:
        result["engine_start_s"] = time.perf_counter() - start
        report = llm.warmup_report
        note(f"engine start {result['engine_start_s']:.1f}s, warm-up "
             f"{report.seconds if report else None}")
        ttfts = []
        for prompt in prompts[:4]:
            out = llm.generate([prompt], params)[0]
            ttfts.append(out.metrics.ttft_s)
        result["engine_ttft_s"] = ttfts
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompts[4]], params)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
        result["profile"] = table
        print(table, flush=True)
    torch.cuda.empty_cache()
    hf = hf_twin(loaded)
    times = []
    with torch.inference_mode():
        for prompt in prompts[:3]:
            ids = torch.tensor([prompt], device="cuda")
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    result["hf_forward_s"] = times
    steady = sorted(ttfts[1:])[len(ttfts[1:]) // 2]
    hf_steady = sorted(times[1:])[0]
    note(f"e2e {prompt_tokens} tokens (chunks of {max_batched}): engine TTFT {ttfts} "
         f"(steady {steady:.3f}s), HF forward {times} -> ratio {steady / hf_steady:.2f}")
    return result


def run_first_requests(prompt_tokens: int, max_batched: int) -> dict:
    """A fresh engine with warm-up (random:llama3-8b): the warm-up report, TTFT of the first
    long prompt against later prompts of the same length, and the TTFTs of the first
    requests of a serve workload against its steady-state median."""
    import numpy as np
    from kvtier.cli.bench.serve import ServeConfig, _run_mode
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.loader import load_model

    start = time.perf_counter()
    loaded = load_model("random:llama3-8b", torch.device("cuda"), "bfloat16")
    rng = np.random.default_rng(1)
    vocab = loaded.config.vocab_size
    prompts = [rng.integers(16, vocab, prompt_tokens).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    result: dict = {"load_s": time.perf_counter() - start}
    start = time.perf_counter()
    with LLM(loaded, gpu_blocks=3 * (prompt_tokens // 16 + 4),
             max_num_batched_tokens=max_batched, host_cache=False, disk_cache=False,
             max_num_seqs=64) as llm:
        result["engine_start_s"] = time.perf_counter() - start
        report = llm.warmup_report
        result["warmup"] = {"seconds": report.seconds, "graph_seconds": report.graph_seconds,
                            "steps": report.steps, "cache": report.triton_cache_dir}
        ttfts = [llm.generate([p], params)[0].metrics.ttft_s for p in prompts]
        result["long_prompt_ttft_s"] = ttfts
        later = float(np.median(ttfts[1:]))
        note(f"start {result['engine_start_s']:.1f}s (warm-up {report.seconds:.1f}s, graphs "
             f"{report.graph_seconds:.1f}s, cache {report.triton_cache_dir}); first "
             f"{prompt_tokens}-token TTFT {ttfts[0]:.3f}s vs later {later:.3f}s "
             f"= {ttfts[0] / later:.2f}x")
    del llm
    torch.cuda.empty_cache()
    config = ServeConfig(model="random:llama3-8b", device="cuda", num_conversations=16,
                         num_rounds=4, system_tokens=512, user_tokens=512, max_tokens=16,
                         seed=3)
    system = rng.integers(16, vocab, config.system_tokens).tolist()
    questions = [[rng.integers(16, vocab, config.user_tokens).tolist()
                  for _ in range(config.num_rounds)] for _ in range(config.num_conversations)]
    with LLM(loaded, gpu_blocks=config.num_gpu_blocks, block_size=16,
             max_num_seqs=config.num_conversations, max_num_batched_tokens=2048,
             host_cache=True, host_cache_gb=8, disk_cache=False) as llm:
        served = _run_mode(llm, config, system, questions)
    series = served["ttft_by_arrival_s"]
    steady = float(np.median(series[20:])) if len(series) > 20 else float(np.median(series))
    worst = max(series[:20])
    result["serve"] = {"ttft_by_arrival_s": series, "steady_median_s": steady,
                       "first20_max_s": worst}
    note(f"serve: first 20 TTFTs max {worst:.3f}s, steady median {steady:.3f}s "
         f"({worst / steady:.2f}x); first 20: {[round(t, 3) for t in series[:20]]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--stages", default="decode,prefill,e2e")
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--max-batched", type=int, default=8192)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import flash_attn  # noqa: F401

        report["flash_attn"] = flash_attn.__version__
    except ImportError as exc:
        report["flash_attn"] = f"not importable: {exc}"
    note(f"{report['device']} torch {torch.__version__} flash_attn: {report['flash_attn']}")
    device = torch.device("cuda")
    if "decode" in stages or "prefill" in stages:
        copy_gbps = kb.copy_bandwidth_gbps(device)
        note(f"device copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
        tokens = max([b * c for b, c in kb.DECODE_CASES]
                     + [c + p for c, p in kb.PREFILL_CASES])
        setup = kb.PagedSetup(tokens // kb.BLOCK_SIZE + 64, device)
        if "decode" in stages:
            report["decode"] = run_decode(setup, copy_gbps)
        if "prefill" in stages:
            report["prefill"] = run_prefill(setup)
        del setup
        torch.cuda.empty_cache()
    (out / "attention_sweep.json").write_text(json.dumps(report, indent=1, default=str))
    if "e2e" in stages:
        try:
            if "prefill" in report:
                case = report["prefill"][-1]
                name = case["best"]
                if name != "auto" and not name.startswith("splits"):
                    bq, tn, w, st = (int(part[1:]) for part in name.split())
                    note(f"e2e with prefill tiling {name}")
                    patch_prefill_tiling(AttentionConfig(bq, tn, 1, w, st))
            report["e2e"] = run_e2e(args.prompt_tokens, args.max_batched)
        except Exception as exc:  # noqa: BLE001 - keep the kernel table when e2e fails
            import traceback

            traceback.print_exc()
            note(f"e2e failed: {exc!r}")
    if "firstreq" in stages:
        report["firstreq"] = run_first_requests(args.prompt_tokens, args.max_batched)
    (out / "attention_sweep.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n==== summary", file=sys.stdout)
    print("\n".join(TABLE), flush=True)


if __name__ == "__main__":
    main()
