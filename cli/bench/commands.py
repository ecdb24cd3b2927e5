"""Typer commands for the benchmarks whose modules expose only a `run_*_bench` function.

Each command turns its options into the bench's arguments, shows progress on stderr, and
prints the result as JSON (`--json`) or as a rich table. cli/main.py attaches them to the
`bench` group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from kvtier.cli.bench.diskread import run_diskread_bench
from kvtier.cli.bench.kernels import run_kernel_bench
from kvtier.cli.bench.longctx import (
    STRATEGIES,
    LongctxConfig,
    run_longctx_bench,
    run_longctx_sweep,
)
from kvtier.cli.bench.serve import MODES as SERVE_MODES
from kvtier.cli.bench.serve import ServeConfig, run_serve_bench
from kvtier.cli.bench.swap import run_swap_bench
from kvtier.cli.common import print_json, print_table
from kvtier.cli.plot import plot_longctx
from rich.console import Console

_JSON_HELP = "Print the result as one JSON object instead of a table."


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f}"


def _parse_names(text: str, known: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{option} takes a comma-separated list of {', '.join(known)}; "
                         f"got {text!r}")
    return names


def _parse_ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{option} takes comma-separated positive integers, got {text!r}")
    return values


def _with_status(message: str, run):
    """Run `run(update)` under a spinner on stderr; `update(text)` changes its line."""
    console = Console(stderr=True)
    with console.status(message) as status:
        return run(lambda text: status.update(text))


def _print_longctx(result: dict[str, Any]) -> None:
    config = result["config"]
    strategies = result["strategies"]
    print_table(f"bench longctx: {config['num_docs']} documents x {config['doc_tokens']} tokens, "
                f"{result['model_id']} on {result['device']} ({result['dtype']}), GPU budget "
                f"{result['gpu_blocks']} blocks; round-two time to first token (ms)",
                ("strategy", "p50", "p90", "p99", "speedup", "round 1 p50"),
                [(name, _ms(f["ttft_s"]["p50"]), _ms(f["ttft_s"]["p90"]),
                  _ms(f["ttft_s"]["p99"]), f"{f['speedup_vs_recompute']:.2f}x",
                  _ms(f["ttft_round1_s"]["p50"])) for name, f in strategies.items()])
    print_table("Where round-two prompt tokens came from, and transfers over both rounds",
                ("strategy", "GPU", "host", "disk", "computed", "MiB moved", "swap steps",
                 "max MiB/step"),
                [(name, f["tokens"]["gpu"], f["tokens"]["host"], f["tokens"]["disk"],
                  f["tokens"]["computed"], _mib(sum(f["bytes_moved"].values())),
                  f"{f['num_swap_steps']} of {f['num_steps']}", _mib(f["max_bytes_per_step"]))
                 for name, f in strategies.items()])
    headline = result["headline"]
    for name in ("host", "disk"):
        key = f"speedup_{name}_vs_recompute"
        if key in headline:
            goal = (f"; goal {headline['host_speedup_goal']:.0f}x for 32K tokens on a GPU"
                    if name == "host" else "")
            typer.echo(f"{name} restore vs recompute, {headline['prompt_tokens']}-token prompt: "
                       f"{headline[key]:.2f}x sooner first token (p50{goal})")
    verdict = "identical" if result["outputs_identical"] else "DIFFERENT"
    typer.echo(f"generated tokens across strategies: {verdict}")
    _print_disk_read(result)


def _print_disk_read(result: dict[str, Any]) -> None:
    disk = result.get("disk_read")
    if disk is None:
        return
    raw = disk["raw"]
    colds = {name: f.get("cold") for name, f in result["strategies"].items() if name == "disk"}
    cold_note = {True: "page cache dropped before each disk restore",
                 False: "page cache NOT dropped (not permitted: run as root)",
                 None: "warm page cache (no --cold)"}[colds.get("disk")]
    typer.echo(f"disk restores: {cold_note}")

    def gbs(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    threaded = next((v for k, v in raw.items() if k.startswith("buffered_")
                     and k.endswith("threads_gb_s")), None)
    typer.echo(f"disk tier cold read {disk['tier']['gb_s']:.2f} GB/s "
               f"({disk['tier']['threads']} threads, cold={disk['tier']['cold']}); raw "
               f"sequential read of {raw['bytes'] / 2**30:.2f} GiB: buffered "
               f"{gbs(raw.get('buffered_gb_s'))}, O_DIRECT {gbs(raw.get('direct_gb_s'))}, "
               f"threaded {gbs(threaded)} GB/s "
               f"(cold={raw['cold']}); tier / best raw = {disk['tier_vs_best_raw']:.2f}")


def _print_longctx_sweep(sweep: dict[str, Any]) -> None:
    rows = []
    for run in sweep["runs"]:
        strategies = run["strategies"]
        for name, f in strategies.items():
            meet = f["meeting_blocks"]
            restored = sum(m["host"] + m["disk"] for m in meet) / len(meet)
            computed = sum(m["computed"] for m in meet) / len(meet)
            rows.append((run["prompt_tokens"], name, _ms(f["ttft_s"]["p50"]),
                         f"{f['ttft_s']['p50'] / strategies['recompute']['ttft_s']['p50']:.3f}",
                         f"{computed:.0f} / {restored:.0f}",
                         "" if name != "disk" or run["disk_read"] is None else
                         f"{run['disk_read']['tier']['gb_s']:.2f} / "
                         f"{run['disk_read']['raw']['best_gb_s']:.2f}"))
    print_table("bench longctx sweep: round-two TTFT p50 per document length",
                ("prompt tokens", "strategy", "TTFT p50 ms", "x recompute",
                 "blocks computed / restored", "disk tier / raw GB/s"), rows)
    for run in sweep["runs"]:
        verdict = "identical" if run["outputs_identical"] else "DIFFERENT"
        typer.echo(f"{run['prompt_tokens']} tokens: generated tokens {verdict}")
        _print_disk_read(run)


def longctx(
    model: str = typer.Option("smollm2-135m", help="Model: an alias, a Hugging Face "
                              "directory, a .gguf file, or random:<name> (e.g. "
                              "random:llama3-8b)."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on CUDA), "
                              "float32, bfloat16 or float16."),
    num_docs: int = typer.Option(4, help="Documents (the GPU budget holds one request)."),
    doc_tokens: str = typer.Option("1024", help="Tokens per document; several "
                                   "comma-separated values run a sweep on one loaded model."),
    question_tokens: int = typer.Option(16, help="Tokens per question after a document."),
    max_tokens: int = typer.Option(4, help="Tokens generated per request."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    gpu_blocks: int | None = typer.Option(None, help="GPU block budget (default: one "
                                          "request's blocks plus two)."),
    max_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step "
                                           "(prefill chunk size)."),
    strategies: str = typer.Option(",".join(STRATEGIES), help="Comma-separated strategies "
                                   "to compare; recompute is the baseline and required."),
    disk_dir: Path | None = typer.Option(None, help="Where the disk strategy keeps its "
                                         "temporary tier (default: the system temporary "
                                         "directory); it is removed afterwards."),
    seed: int = typer.Option(0, help="Seed of the documents' token ids."),
    cold: bool = typer.Option(False, "--cold", help="Drop the page cache before each disk "
                              "restore (needs root; the result says when it was not "
                              "permitted)."),
    plot: Path | None = typer.Option(None, "--plot", help="Draw the swap timeline and the "
                                     "TTFT comparison to this PNG file (needs matplotlib)."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """TTFT of long prompts whose KV is recomputed vs restored from the host or disk tier."""
    lengths = _parse_ints(doc_tokens, "--doc-tokens")
    config = LongctxConfig(model=model, device=device, dtype=dtype, num_docs=num_docs,
                           doc_tokens=lengths[0], question_tokens=question_tokens,
                           max_tokens=max_tokens, block_size=block_size, gpu_blocks=gpu_blocks,
                           max_batched_tokens=max_batched_tokens,
                           strategies=_parse_names(strategies, STRATEGIES, "--strategies"),
                           disk_dir=str(disk_dir) if disk_dir else None, seed=seed,
                           cold=cold)
    if len(lengths) > 1:
        sweep = _with_status("bench longctx", lambda update: run_longctx_sweep(
            config, lengths, update))
        if plot is not None:
            sweep["plot"] = str(plot_longctx(sweep["runs"][-1], plot))
        if json_output:
            print_json(sweep)
        else:
            _print_longctx_sweep(sweep)
        return
    result = _with_status("bench longctx", lambda update: run_longctx_bench(config, update))
    if plot is not None:
        result["plot"] = str(plot_longctx(result, plot))
    if json_output:
        print_json(result)
        return
    _print_longctx(result)
    if plot is not None:
        typer.echo(f"plot written to {result['plot']}")


def _print_serve(result: dict[str, Any]) -> None:
    config = result["config"]
    modes, ratios = result["modes"], result["ratios_vs_baseline"]
    rows = []
    for name, m in modes.items():
        ttft, tpot = m["ttft_s"], m["tpot_s"]
        rows.append((name, f"{m['throughput_tok_s']:,.1f}", f"{ratios[name]['throughput']:.2f}x",
                     _ms(ttft["p50"]), _ms(ttft["p90"]), _ms(ttft["p99"]),
                     *((_ms(tpot["p50"]), _ms(tpot["p90"]), _ms(tpot["p99"])) if tpot
                       else ("-", "-", "-"))))
    print_table(f"bench serve: {config['num_conversations']} conversations x "
                f"{config['num_rounds']} rounds, {result['model_id']} on {result['device']} "
                f"({result['dtype']}), GPU budget {result['gpu_blocks']} of "
                f"a {result['working_set_blocks']}-block working set; TTFT and TPOT in ms",
                ("mode", "tok/s", f"vs {result['baseline']}", "TTFT p50", "p90", "p99",
                 "TPOT p50", "p90", "p99"), rows)
    print_table("Where prompt tokens came from",
                ("mode", "GPU", "host", "disk", "computed", "preemptions", "MiB moved"),
                [(name, m["tokens"]["gpu"], m["tokens"]["host"], m["tokens"]["disk"],
                  m["tokens"]["computed"], m["num_preemptions"],
                  _mib(sum(m["bytes_moved"].values()))) for name, m in modes.items()])
    verdict = "identical" if result["outputs_identical"] else "DIFFERENT"
    typer.echo(f"conversations across modes: {verdict}")
    comparison = result.get("hf_comparison")
    if comparison:
        print_table("engine (tiers off) vs transformers generate(): tokens/s",
                    ("batch", "prefill engine", "prefill HF", "ratio", "decode engine",
                     "decode HF", "ratio", "same tokens"),
                    [(key.removeprefix("batch_"), f"{c['engine_prefill_tok_s']:,.0f}",
                      f"{c['hf_prefill_tok_s']:,.0f}", f"{c['prefill_ratio']:.2f}x",
                      f"{c['engine_decode_tok_s']:,.1f}", f"{c['hf_decode_tok_s']:,.1f}",
                      f"{c['decode_ratio']:.2f}x", "yes" if c["same_tokens"] else "no")
                     for key, c in comparison.items()])


def serve(
    model: str = typer.Option("smollm2-135m", help="Model: an alias, a Hugging Face "
                              "directory, a .gguf file, or random:<name>."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16."),
    num_conversations: int = typer.Option(8, help="Concurrent conversations (clients)."),
    num_rounds: int = typer.Option(3, help="Requests per conversation."),
    system_tokens: int = typer.Option(256, help="Tokens of the system prompt all share."),
    user_tokens: int = typer.Option(32, help="Tokens of each new question."),
    max_tokens: int = typer.Option(16, help="Tokens of each answer."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    gpu_blocks: int | None = typer.Option(None, help="GPU block budget (default: a third of "
                                          "what all conversations need)."),
    max_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step."),
    modes: str = typer.Option(",".join(SERVE_MODES), help="Comma-separated tier modes; the "
                              "first is the baseline of the ratios."),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also compare prefill and "
                                    "decode tokens/s with transformers' generate()."),
    hf_batch: int = typer.Option(8, help="Batch size N of the transformers comparison."),
    hf_prompt_tokens: int = typer.Option(128, help="Prompt tokens in the comparison."),
    hf_new_tokens: int = typer.Option(32, help="Generated tokens in the comparison."),
    repeats: int = typer.Option(3, help="Timed runs of the comparison; figures are medians."),
    seed: int = typer.Option(0, help="Seed of the token ids."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Throughput, TTFT and TPOT of multi-round conversations with tiers off, host, host+disk."""
    config = ServeConfig(model=model, device=device, dtype=dtype,
                         num_conversations=num_conversations, num_rounds=num_rounds,
                         system_tokens=system_tokens, user_tokens=user_tokens,
                         max_tokens=max_tokens, block_size=block_size, gpu_blocks=gpu_blocks,
                         max_batched_tokens=max_batched_tokens,
                         modes=_parse_names(modes, SERVE_MODES, "--modes"),
                         compare_hf=compare_hf, hf_batch=hf_batch,
                         hf_prompt_tokens=hf_prompt_tokens, hf_new_tokens=hf_new_tokens,
                         repeats=repeats, seed=seed)
    result = _with_status("bench serve", lambda update: run_serve_bench(config, update))
    if json_output:
        print_json(result)
    else:
        _print_serve(result)


def _print_kernels(result: dict[str, Any]) -> None:
    print_table(f"paged decode vs torch SDPA on {result['device']} (ms)",
                ("batch", "context", "paged", "GB/s", "SDPA default", "SDPA best", "ratio",
                 "ratio best"),
                [(r["batch"], r["context"], f"{r['paged_ms']:.3f}", f"{r['paged_kv_gbps']:,.0f}",
                  f"{r['sdpa']['default_ms']:.3f}",
                  f"{r['sdpa']['best_ms']:.3f} ({r['sdpa']['best_backend']})",
                  f"{r['ratio_vs_sdpa_default']:.2f}", f"{r['ratio_vs_sdpa_best']:.2f}")
                 for r in result["decode"]])
    print_table("paged prefill vs torch SDPA (ms)",
                ("chunk", "prefix", "paged", "TFLOP/s", "SDPA best", "ratio flash", "ratio best"),
                [(r["chunk"], r["prefix"], f"{r['paged_ms']:.3f}", f"{r['paged_tflops']:,.0f}",
                  f"{r['sdpa']['best_ms']:.3f} ({r['sdpa']['best_backend']})",
                  "-" if r["ratio_vs_sdpa_flash"] is None else f"{r['ratio_vs_sdpa_flash']:.2f}",
                  f"{r['ratio_vs_sdpa_best']:.2f}") for r in result["prefill"]])
    print_table("store_kv vs a device-to-device copy",
                ("tokens", "store GB/s", "copy GB/s", "ratio", "correct"),
                [(r["num_tokens"], f"{r['store_gbps']:,.0f}", f"{r['d2d_gbps']:,.0f}",
                  f"{r['ratio_vs_d2d']:.2f}", r["correct"]) for r in result["store_kv"]])
    print_table("targets", ("target", "met"), list(result["targets"].items()))


def kernels(
    batch: int = typer.Option(32, help="Decode batch size."),
    context: int = typer.Option(8192, help="Context tokens per sequence in the batched decode."),
    long_contexts: str = typer.Option("32768,131072", help="Comma-separated contexts of the "
                                      "batch-1 decodes."),
    prefill_chunk: int = typer.Option(4096, help="Query tokens of the prefill chunk."),
    prefix: int = typer.Option(28672, help="Cached tokens before the second prefill chunk."),
    store_tokens: str = typer.Option("8192,32768", help="Comma-separated token counts of "
                                     "the store_kv runs."),
    sweep: bool = typer.Option(False, "--sweep", help="Also time alternative tilings."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Triton paged attention and store_kv against torch SDPA and device copies (CUDA)."""
    result = _with_status("bench kernels", lambda update: run_kernel_bench(
        batch=batch, context=context, long_contexts=_parse_ints(long_contexts, "--long-contexts"),
        prefill_chunk=prefill_chunk, prefix=prefix,
        store_tokens=_parse_ints(store_tokens, "--store-tokens"), sweep=sweep))
    if json_output:
        print_json(result)
    else:
        _print_kernels(result)


def _print_swap(result: dict[str, Any]) -> None:
    ceiling = result["ceiling"]
    rows = [("pinned copy (ceiling)", f"{ceiling['d2h_gbps']:.1f}", f"{ceiling['h2d_gbps']:.1f}",
             f"{ceiling['bidir_gbps']:.1f}", "-", "-")]
    for method, r in result["methods"].items():
        rows.append((method, f"{r['d2h_gbps']:.1f} ({r['d2h_vs_ceiling']:.2f}x)",
                     f"{r['h2d_gbps']:.1f} ({r['h2d_vs_ceiling']:.2f}x)",
                     f"{r['bidir_gbps']:.1f} ({r['bidir_vs_ceiling']:.2f}x)",
                     f"{r['matmul_slowdown']:.2f}x", r["correct"]))
    print_table(f"swap_blocks on {result['device']}: {result['num_blocks']} blocks of "
                f"{result['block_bytes'] / 2**20:.1f} MiB per direction (GB/s)",
                ("method", "GPU->host", "host->GPU", "both", "matmul slowdown", "correct"), rows)


def swap(
    num_blocks: int = typer.Option(512, help="Blocks copied per direction."),
    repeats: int = typer.Option(9, help="Timed repeats; figures are medians."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """GPU <-> pinned host block copies per method vs one contiguous copy (CUDA)."""
    result = _with_status("bench swap", lambda update: run_swap_bench(num_blocks=num_blocks,
                                                                       repeats=repeats))
    if json_output:
        print_json(result)
    else:
        _print_swap(result)


def diskread(
    gib: float = typer.Option(2.0, help="GiB of 2 MiB blocks written to a fresh disk tier."),
    directory: Path = typer.Option(Path("."), "--dir", help="Where the tier and the raw "
                                   "file go (the disk under test); removed afterwards."),
    threads: str = typer.Option("1,4,8", help="Comma-separated thread counts to try."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Cold reads of 2 MiB disk-tier values: the ways of reading them, the tier's own
    path, and the disk's raw sequential read bandwidth (drop the page cache: needs root)."""
    counts = _parse_ints(threads, "--threads")
    result = _with_status("bench diskread", lambda update: run_diskread_bench(
        directory, gib, counts, update))
    if json_output:
        print_json(result)
        return
    rows = [(k.removesuffix("_gb_s"), "n/a" if v is None else f"{v:.2f}")
            for part in ("methods", "tier", "raw") for k, v in result[part].items()
            if k.endswith("_gb_s")]
    print_table(f"bench diskread: {result['methods']['values']} values, "
                f"{result['methods']['bytes'] / 2**30:.2f} GiB, cold={result['methods']['cold']}",
                ("read", "GB/s"), rows)
