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
from kvtier.cli.bench.serve import EXTRA_MODES as EXTRA_SERVE_MODES
from kvtier.cli.bench.serve import MODES as SERVE_MODES
from kvtier.cli.bench.serve import ServeConfig, run_serve_bench
from kvtier.cli.bench.swap import DEFAULT_BLOCK_BYTES, run_swap_bench
from kvtier.cli.common import print_json, print_table
from kvtier.cli.plot import plot_longctx
from kvtier.kernels import SWAP_METHODS
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
    hf = result.get("transformers")
    if hf is not None:
        typer.echo(f"transformers' forward pass, same prompts and weights: TTFT p50 "
                   f"{_ms(hf['ttft_s']['p50'])} ms; engine recompute / transformers = "
                   f"{hf['engine_recompute_vs_hf']:.2f}x")
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
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also time transformers' "
                                    "own forward pass over the round-two prompts (same "
                                    "weights)."),
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
                           compare_hf=compare_hf,
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
    if config["runs"] > 1:
        print_table(f"Every run (each mode above is its median run of {config['runs']})",
                    ("mode", "tok/s per run", "TTFT p99 per run (ms)"),
                    [(name, " / ".join(f"{r['throughput_tok_s']:,.1f}" for r in m["runs"]),
                      " / ".join(_ms(r["ttft_p99_s"]) for r in m["runs"]))
                     for name, m in modes.items()])
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
                              "first is the baseline of the ratios. Also host_third: the "
                              "host tier of host_disk without the disk."),
    compare_hf: bool = typer.Option(False, "--compare-hf", help="Also compare prefill and "
                                    "decode tokens/s with transformers' generate()."),
    hf_batch: int = typer.Option(8, help="Batch size N of the transformers comparison."),
    hf_prompt_tokens: int = typer.Option(128, help="Prompt tokens in the comparison."),
    hf_new_tokens: int = typer.Option(32, help="Generated tokens in the comparison."),
    repeats: int = typer.Option(3, help="Timed runs of the comparison; figures are medians."),
    runs: int = typer.Option(1, help="Runs of every mode, in turn; each mode reports its "
                             "median-throughput run (and every run's throughput)."),
    seed: int = typer.Option(0, help="Seed of the token ids."),
    url: str | None = typer.Option(None, "--url", help="Drive the workload over HTTP at a "
                                   "running `kvtier serve` (e.g. http://127.0.0.1:8000); the "
                                   "engine options are then the server's."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="KVTIER_API_KEY",
                                       help="API key of the server at --url."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote_cache: str | None = typer.Option(
        None, "--remote-cache", help="Give the tiered modes a remote tier on this Redis URL "
        "(a fresh key prefix per engine)."),
) -> None:
    """Throughput, TTFT and TPOT of multi-round conversations with tiers off, host, host+disk
    (or, with --url, against a running server)."""
    if url is not None:
        from kvtier.cli.bench.serve_http import print_remote, run_remote_serve_bench

        config = ServeConfig(num_conversations=num_conversations, num_rounds=num_rounds,
                             system_tokens=system_tokens, user_tokens=user_tokens,
                             max_tokens=max_tokens, seed=seed)
        result = _with_status("bench serve", lambda update: run_remote_serve_bench(
            url, config, api_key, progress=update))
        if json_output:
            print_json(result)
        else:
            print_remote(result)
        return
    config = ServeConfig(model=model, device=device, dtype=dtype,
                         num_conversations=num_conversations, num_rounds=num_rounds,
                         system_tokens=system_tokens, user_tokens=user_tokens,
                         max_tokens=max_tokens, block_size=block_size, gpu_blocks=gpu_blocks,
                         max_batched_tokens=max_batched_tokens,
                         modes=_parse_names(modes, SERVE_MODES + EXTRA_SERVE_MODES, "--modes"),
                         compare_hf=compare_hf, hf_batch=hf_batch,
                         hf_prompt_tokens=hf_prompt_tokens, hf_new_tokens=hf_new_tokens,
                         repeats=repeats, runs=runs, seed=seed, remote_cache=remote_cache)
    result = _with_status("bench serve", lambda update: run_serve_bench(config, update))
    if json_output:
        print_json(result)
    else:
        _print_serve(result)


def _print_kernels(result: dict[str, Any]) -> None:
    order = result["block_order"]
    print_table(f"paged decode vs torch SDPA on {result['device']}, blocks in {order} order "
                f"(ms; copy bandwidth {result['copy_gbps']:,.0f} GB/s read + write)",
                ("batch", "context", "paged", "SDPA", "paged/SDPA", "SDPA best",
                 "paged/best", "copy share", "graph paged/SDPA"),
                [(r["batch"], r["context"], f"{r['paged_ms']:.3f}",
                  f"{r['sdpa']['default_ms']:.3f}", f"{r['ratio_vs_sdpa_default']:.2f}",
                  f"{r['sdpa']['best_ms']:.3f} ({r['sdpa']['best_backend']})",
                  f"{r['ratio_vs_sdpa_best']:.2f}", f"{r['copy_share']:.2f}",
                  "-" if "ratio_vs_sdpa_default" not in r["cuda_graph"]
                  else f"{r['cuda_graph']['ratio_vs_sdpa_default']:.2f}")
                 for r in result["decode"]])
    print_table("paged prefill vs torch SDPA (ms)",
                ("chunk", "prefix", "paged", "TFLOP/s", "SDPA flash", "paged/flash", "SDPA",
                 "paged/SDPA"),
                [(r["chunk"], r["prefix"], f"{r['paged_ms']:.3f}", f"{r['paged_tflops']:,.0f}",
                  f"{r['sdpa']['ms_by_backend'].get('flash', float('nan')):.3f}",
                  "-" if r["ratio_vs_sdpa_flash"] is None else f"{r['ratio_vs_sdpa_flash']:.2f}",
                  f"{r['sdpa']['default_ms']:.3f}", f"{r['ratio_vs_sdpa_default']:.2f}")
                 for r in result["prefill"]])
    print_table("store_kv vs a device-to-device copy",
                ("tokens", "store GB/s", "copy GB/s", "ratio", "correct"),
                [(r["num_tokens"], f"{r['store_gbps']:,.0f}", f"{r['d2d_gbps']:,.0f}",
                  f"{r['ratio_vs_d2d']:.2f}", r["correct"]) for r in result["store_kv"]])
    print_table("targets", ("target", "met"), list(result["targets"].items()))


def _parse_pairs(text: str, separator: str, option: str) -> tuple[tuple[int, int], ...]:
    """"32x8192,1x32768" -> ((32, 8192), (1, 32768)); ValueError naming the option."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, second = part.partition(separator)
        try:
            pair = (int(first), int(second))
        except ValueError:
            raise ValueError(f"{option} takes comma-separated A{separator}B integer pairs, "
                             f"got {text!r}") from None
        if pair[0] <= 0 or pair[1] < 0:
            raise ValueError(f"{option}: {part!r} must be positive (a prefix may be 0)")
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{option} needs at least one A{separator}B pair, got {text!r}")
    return tuple(pairs)


def kernels(
    decode_cases: str = typer.Option("32x8192,1x32768,64x2048,4x131072",
                                     help="Decode cases, comma-separated BATCHxCONTEXT."),
    prefill_cases: str = typer.Option("8192+0,2048+30720",
                                      help="Prefill cases, comma-separated CHUNK+PREFIX."),
    store_tokens: str = typer.Option("8192,32768", help="Comma-separated token counts of "
                                     "the store_kv runs."),
    contiguous: bool = typer.Option(False, "--contiguous", help="Block tables in order "
                                    "instead of a random permutation."),
    sweep: bool = typer.Option(False, "--sweep", help="Also time alternative tilings."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Triton paged attention and store_kv against torch SDPA and device copies (CUDA)."""
    decode = _parse_pairs(decode_cases, "x", "--decode-cases")
    prefill = tuple((chunk, prefix) for chunk, prefix
                    in _parse_pairs(prefill_cases, "+", "--prefill-cases"))
    if any(batch <= 0 or context <= 0 for batch, context in decode):
        raise ValueError("--decode-cases: batch and context must be positive")
    result = _with_status("bench kernels", lambda update: run_kernel_bench(
        decode_cases=decode, prefill_cases=prefill,
        store_tokens=_parse_ints(store_tokens, "--store-tokens"), contiguous=contiguous,
        sweep=sweep))
    if json_output:
        print_json(result)
    else:
        _print_kernels(result)


def _print_swap(result: dict[str, Any]) -> None:
    layout = "scattered" if result["scattered"] else "contiguous"
    if result["scattered"] and result["host_run_blocks"] > 1:
        layout += f", host slots in runs of {result['host_run_blocks']}"
    print_table(f"Pinned-copy ceiling on {result['device']}, GB/s",
                ("block KiB", "GPU->host", "host->GPU", "both"),
                [(s["block_bytes"] >> 10, f"{s['ceiling']['d2h_gbps']:.1f}",
                  f"{s['ceiling']['h2d_gbps']:.1f}", f"{s['ceiling']['both_gbps']:.1f}")
                 for s in result["sizes"]])
    rows = []
    for size in result["sizes"]:
        for method, r in size["methods"].items():
            slowdown = r.get("matmul_slowdown")
            rows.append((size["block_bytes"] >> 10, method, f"{r['d2h_vs_ceiling']:.2f}",
                         f"{r['h2d_vs_ceiling']:.2f}", f"{r['both_vs_ceiling']:.2f}",
                         f"{r['issue_ms_1000']:.2f}",
                         "-" if slowdown is None else f"{slowdown:.2f}",
                         "yes" if r["correct"] else "NO"))
    print_table(f"swap_blocks, {layout}: x ceiling; 1k = host ms to issue 1,000 blocks; "
                "mm = matmul time x alone",
                ("KiB", "method", "d2h", "h2d", "both", "1k ms", "mm", "ok"), rows)
    print_table("Write-through: GPU -> host blocks after every step (8 x 4096^3 matmuls)",
                ("KiB", "blocks", "step ms", "+ swaps", "ratio", "submit us", "ok"),
                [(w["block_bytes"] >> 10, w["blocks_per_step"], f"{w['step_ms']:.3f}",
                  f"{w['step_with_swaps_ms']:.3f}", f"{w['slowdown']:.3f}",
                  f"{w['submit_us_p50']:.0f}", "yes" if w["correct"] else "NO")
                 for w in result["write_through"]])


def swap(
    block_bytes: str = typer.Option(",".join(str(b) for b in DEFAULT_BLOCK_BYTES),
                                    help="Comma-separated block sizes in bytes."),
    scattered: bool = typer.Option(True, "--scattered/--contiguous",
                                   help="Random GPU blocks and host slots, or one run each."),
    host_run_blocks: int = typer.Option(1, help="With --scattered: host slots in runs of "
                                        "this many (1: every slot random)."),
    methods: str = typer.Option(",".join(SWAP_METHODS), help="Comma-separated methods."),
    total_mib: int = typer.Option(512, help="MiB copied per direction per swap."),
    repeats: int = typer.Option(5, help="Timed repeats; figures are medians."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """GPU <-> pinned host block swaps per method and block size vs the plain pinned copy
    (CUDA)."""
    sizes = _parse_ints(block_bytes, "--block-bytes")
    names = _parse_names(methods, SWAP_METHODS, "--methods")
    if host_run_blocks <= 0 or total_mib <= 0 or repeats <= 0:
        raise ValueError("--host-run-blocks, --total-mib and --repeats must be positive")
    result = _with_status("bench swap", lambda update: run_swap_bench(
        block_bytes=sizes, total_mib=total_mib, scattered=scattered,
        host_run_blocks=host_run_blocks, methods=names, repeats=repeats, progress=update))
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
