"""How `kvtier bench` prints its results as tables (rich), one function per bench; each
takes the dict its bench returns (the same that `--json` prints)."""

from __future__ import annotations

from typing import Any

import typer
from kvtier.cli.common import print_table


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f}"


def print_longctx(result: dict[str, Any]) -> None:
    config = result["config"]
    strategies = result["strategies"]
    print_table(f"bench longctx: {config['num_docs']} documents x {config['doc_tokens']} tokens, "
                f"{result['model_id']} on {result['device']} ({result['dtype']}), GPU budget "
                f"{result['gpu_blocks']} blocks; round-two time to first token (ms)",
                ("strategy", "p50", "p90", "p99", "speedup", "round 1 p50"),
                [(name, ms(f["ttft_s"]["p50"]), ms(f["ttft_s"]["p90"]),
                  ms(f["ttft_s"]["p99"]), f"{f['speedup_vs_recompute']:.2f}x",
                  ms(f["ttft_round1_s"]["p50"])) for name, f in strategies.items()])
    print_table("Where round-two prompt tokens came from, and transfers over both rounds",
                ("strategy", "GPU", "host", "disk", "computed", "MiB moved", "swap steps",
                 "max MiB/step"),
                [(name, f["tokens"]["gpu"], f["tokens"]["host"], f["tokens"]["disk"],
                  f["tokens"]["computed"], mib(sum(f["bytes_moved"].values())),
                  f"{f['num_swap_steps']} of {f['num_steps']}", mib(f["max_bytes_per_step"]))
                 for name, f in strategies.items()])
    headline = result["headline"]
    for name in ("host", "disk"):
        key = f"speedup_{name}_vs_recompute"
        if key in headline:
            goal = (f"; goal {headline['host_speedup_goal']:.0f}x for 32K tokens on a GPU"
                    if name == "host" and headline.get("host_speedup_goal") else "")
            typer.echo(f"{name} restore vs recompute, {headline['prompt_tokens']}-token prompt: "
                       f"{ratio_words(headline[key])} first token (p50{goal})")
    verdict = "identical" if result["outputs_identical"] else "DIFFERENT"
    typer.echo(f"generated tokens across strategies: {verdict}")
    print_numerics(result, "equal_to_baseline", "requests equal to")
    hf = result.get("transformers")
    if hf is not None:
        typer.echo(f"transformers' forward pass, same prompts and weights: TTFT p50 "
                   f"{ms(hf['ttft_s']['p50'])} ms; engine recompute / transformers = "
                   f"{hf['engine_recompute_vs_hf']:.2f}x")
    print_disk_writes({name: f.get("disk_writes") for name, f in result["strategies"].items()})
    warm = {name: f["ttft_warm_s"] for name, f in result["strategies"].items()
            if f.get("ttft_warm_s") is not None}
    for name, ttft in warm.items():
        typer.echo(f"{name}: warm page cache, a second fresh engine: TTFT p50 "
                   f"{ms(ttft['p50'])} ms, worst {ms(ttft['p99'])} ms")
    print_fronts(strategies)
    print_disk_read(result)


def print_fronts(strategies: dict[str, Any]) -> None:
    """Per disk strategy and document: what round one left on disk, and where round two's
    fronts met (blocks computed / read from disk), cold and warm."""
    def met(meeting: dict[str, int] | None) -> str:
        return "-" if meeting is None else f"{meeting['computed']} / {meeting['disk']}"

    rows = []
    for name, f in strategies.items():
        stored = f.get("stored_on_disk")
        if not stored:
            continue
        warm = f.get("meeting_blocks_warm") or [None] * len(stored)
        for doc, (span, cold, hot) in enumerate(zip(stored, f["meeting_blocks"], warm)):
            rows.append((name, doc + 1, f"{span['stored']} of {span['blocks']}",
                         span["tail"], span["runs"], met(cold), met(hot)))
    if rows:
        print_table("Per document: blocks round one left on disk, the run ending the document "
                    "(tail), stored runs; round two's blocks computed / read from disk",
                    ("strategy", "doc", "on disk", "tail", "runs", "cold", "warm"), rows)


def ratio_words(speedup: float) -> str:
    """A time ratio as a person says it: "3.20x sooner" or "11x slower", never "0.09x
    sooner"."""
    if speedup >= 1:
        return f"{speedup:.2f}x sooner"
    slowdown = 1 / speedup
    return f"{slowdown:.2f}x slower" if slowdown < 10 else f"{slowdown:.0f}x slower"


def print_numerics(result: dict[str, Any], key: str, what: str) -> None:
    """Per mode: outputs equal to the baseline's, in the default and (when it ran) the
    deterministic mode, and the deterministic mode's cost beside the default."""
    if "deterministic_cost" not in result:
        return
    baseline = result.get("baseline", "recompute")
    default, det = result[key], result[f"deterministic_{key}"]
    print_table(f"default vs deterministic mode: {what} {baseline}, and the deterministic "
                "mode's cost (its figure / the default's)",
                ("mode", "default", "deterministic", *result["deterministic_cost_columns"]),
                [(name, f"{default[name]['identical']} of {default[name]['of']}",
                  f"{det[name]['identical']} of {det[name]['of']}",
                  *("-" if value is None else f"{value:.2f}x"
                    for value in result["deterministic_cost"][name].values()))
                 for name in default])


def print_disk_writes(writes: dict[str, dict[str, Any] | None]) -> None:
    """Per mode with a disk tier: where its computed blocks went, and its write speed."""
    rows = [(name, f"{w['offered']:,}", f"{w['written']:,}", f"{w['duplicate']:,}",
             ", ".join(f"{k} {v:,}" for k, v in w["skipped"].items() if v) or "0",
             f"{w['pending']:,}", f"{w['lost']:,}",
             "-" if w["write_gb_s"] is None else f"{w['write_gb_s']:.2f}",
             "-" if w["raw_write_gb_s"] is None else f"{w['raw_write_gb_s']:.2f}")
            for name, w in writes.items() if w is not None]
    if rows:
        print_table("Blocks computed and offered to the disk tier (lost must be 0); GB/s while "
                    "writing, beside a raw sequential write of the same disk",
                    ("mode", "offered", "written", "dup", "skipped", "pending", "lost",
                     "tier GB/s", "raw GB/s"), rows)


def print_disk_read(result: dict[str, Any]) -> None:
    disk = result.get("disk_read")
    if "disk" not in result["strategies"]:
        return
    colds = {name: f.get("cold") for name, f in result["strategies"].items() if name == "disk"}
    cold_note = {True: "page cache dropped before each disk restore",
                 False: "page cache NOT dropped (not permitted: run as root)",
                 None: "warm page cache (no --cold)"}[colds.get("disk")]
    typer.echo(f"disk restores: {cold_note}")
    if disk is None:
        return
    raw = disk["raw"]

    def gbs(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    threaded = next((v for k, v in raw.items() if k.startswith("buffered_")
                     and k.endswith("threads_gb_s")), None)
    scattered = disk.get("tier_scattered")
    typer.echo(f"disk tier {'cold' if disk['tier']['cold'] else 'warm'} read, one document "
               "as a restore reads it: "
               f"{disk['tier']['gb_s']:.2f} GB/s"
               + ("" if scattered is None else
                  f"; as many blocks scattered over the file: {scattered['gb_s']:.2f} GB/s")
               + f" ({disk['tier']['threads']} threads, cold={disk['tier']['cold']}); raw "
               f"sequential read of {raw['bytes'] / 2**30:.2f} GiB: buffered "
               f"{gbs(raw.get('buffered_gb_s'))}, O_DIRECT {gbs(raw.get('direct_gb_s'))}, "
               f"threaded {gbs(threaded)} GB/s (cold={raw['cold']}); tier / best raw = "
               f"{disk['tier_vs_best_raw']:.2f}"
               + ("" if scattered is None else
                  f" (scattered {disk['scattered_vs_best_raw']:.2f})"))


def print_longctx_sweep(sweep: dict[str, Any]) -> None:
    rows = []
    for run in sweep["runs"]:
        strategies = run["strategies"]
        for name, f in strategies.items():
            meet = f["meeting_blocks"]
            restored = sum(m["host"] + m["disk"] for m in meet) / len(meet)
            computed = sum(m["computed"] for m in meet) / len(meet)
            rows.append((run["prompt_tokens"], name, ms(f["ttft_s"]["p50"]),
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
        print_disk_read(run)


def print_serve(result: dict[str, Any]) -> None:
    config = result["config"]
    modes, ratios = result["modes"], result["ratios_vs_baseline"]
    rows = []
    for name, m in modes.items():
        ttft, tpot = m["ttft_s"], m["tpot_s"]
        rows.append((name, f"{m['throughput_tok_s']:,.1f}", f"{ratios[name]['throughput']:.2f}x",
                     ms(ttft["p50"]), ms(ttft["p90"]), ms(ttft["p99"]),
                     *((ms(tpot["p50"]), ms(tpot["p90"]), ms(tpot["p99"])) if tpot
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
                  mib(sum(m["bytes_moved"].values()))) for name, m in modes.items()])
    print_table("Prefix lookups below the GPU (per lookup; a waiting request is looked up "
                "again each step)",
                ("mode", "restores started", "given up: no GPU blocks",
                 "waiting for GPU blocks", "rates said compute", "probes",
                 "blocks read ahead"),
                [(name, *(m["restores"].get(k, 0) for k in ("started", "no_room", "room_waits",
                                                            "turned_away", "probes",
                                                            "prefetched")))
                 for name, m in modes.items() if "restores" in m])
    print_table("The engine thread, seconds of each mode's run (on the CPU the step's "
                "compute is part of its launch)",
                ("mode", "run", "planning", "launching", "after launch",
                 "waiting for the GPU"),
                [(name, f"{m['elapsed_s']:.2f}",
                  *(f"{m['engine_thread_s'][k]:.2f}" for k in
                    ("planning_s", "launching_s", "after_launch_s", "waiting_s")))
                 for name, m in modes.items() if "engine_thread_s" in m])
    worker_rows = [(name, verb, c["calls"], f"{c['seconds']:.3f}",
                    ms(c["seconds"] / c["calls"]) if c["calls"] else "-")
                   for name, m in modes.items() for verb, c in
                   (m.get("disk_worker_calls") or {}).items()]
    if worker_rows:
        print_table("Requests to the disk worker process: the seconds the engine's threads "
                    "waited for their answers", ("mode", "verb", "calls", "seconds", "mean ms"),
                    worker_rows)
    round_rows = [(name, index + 1, f"{r['seconds']:.2f}", f"{r['planning_s']:.2f}",
                   ms(r["ttft_p50_s"]),
                   r["tokens"]["host"], r["tokens"]["disk"], r["tokens"]["computed"],
                   "-" if r["disk_ledger"] is None else
                   "{written} / {pending} / {gpu_reused}".format(**r["disk_ledger"]))
                  for name, m in modes.items() for index, r in enumerate(m.get("rounds") or ())]
    if round_rows:
        print_table("Rounds (lockstep): prompt tokens per source; the disk ledger at the "
                    "round's end",
                    ("mode", "round", "seconds", "planning", "TTFT p50", "host", "disk",
                     "computed",
                     "written / pending / reused"), round_rows)
    verdict = "identical" if result["outputs_identical"] else "DIFFERENT"
    typer.echo(f"conversations across modes: {verdict}")
    print_numerics(result, "equal_to_baseline", "conversations equal to")
    if config["runs"] > 1:
        print_table(f"Every run (each mode above is its median run of {config['runs']})",
                    ("mode", "tok/s per run", "TTFT p99 per run (ms)"),
                    [(name, " / ".join(f"{r['throughput_tok_s']:,.1f}" for r in m["runs"]),
                      " / ".join(ms(r["ttft_p99_s"]) for r in m["runs"]))
                     for name, m in modes.items()])
    print_disk_writes({name: m.get("disk_writes") for name, m in modes.items()})
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


def print_kernels(result: dict[str, Any]) -> None:
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
                 "paged/SDPA", "cudnn backend", "cudnn/SDPA"),
                [(r["chunk"], r["prefix"], f"{r['paged_ms']:.3f}", f"{r['paged_tflops']:,.0f}",
                  f"{r['sdpa']['ms_by_backend'].get('flash', float('nan')):.3f}",
                  "-" if r["ratio_vs_sdpa_flash"] is None else f"{r['ratio_vs_sdpa_flash']:.2f}",
                  f"{r['sdpa']['default_ms']:.3f}", f"{r['ratio_vs_sdpa_default']:.2f}",
                  "-" if "cudnn" not in r else f"{r['cudnn']['ms']:.3f}",
                  "-" if "cudnn" not in r else f"{r['cudnn']['ratio_vs_sdpa_default']:.2f}")
                 for r in result["prefill"]])
    print_table("store_kv vs a device-to-device copy",
                ("tokens", "store GB/s", "copy GB/s", "ratio", "correct"),
                [(r["num_tokens"], f"{r['store_gbps']:,.0f}", f"{r['d2d_gbps']:,.0f}",
                  f"{r['ratio_vs_d2d']:.2f}", r["correct"]) for r in result["store_kv"]])
    print_table("targets", ("target", "met"), list(result["targets"].items()))


def print_swap(result: dict[str, Any]) -> None:
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


def print_invariance(result: dict[str, Any]) -> None:
    """Per mode and engine shape: requests equal to the mode's first shape, and the time."""
    config = result["config"]
    cost = result.get("deterministic_time", {})
    rows = [(mode, shape, f"{row['same_tokens']} of {row['of']}",
             f"{row['same_logprob_bits']} of {row['of']}", f"{row['seconds']:.2f}",
             f"{cost[shape]:.2f}x" if mode == "deterministic" and shape in cost else "")
            for mode, shapes in result["modes"].items() for shape, row in shapes.items()]
    print_table(f"bench invariance: {config['num_prompts']} prompts of "
                f"{config['min_tokens']}-{config['max_tokens_prompt']} tokens, "
                f"{config['max_tokens']} greedy tokens each, {config['model']}; each shape "
                "(max_num_seqs x max_num_batched_tokens) against the mode's first",
                ("mode", "shape", "same tokens", "same logprob bits", "seconds",
                 "time / default"), rows)


def print_diskread(result: dict[str, Any]) -> None:
    rows = [(k.removesuffix("_gb_s"), "n/a" if v is None else f"{v:.2f}")
            for part in ("methods", "tier", "raw") for k, v in result[part].items()
            if k.endswith("_gb_s")]
    print_table(f"bench diskread: {result['methods']['values']} values, "
                f"{result['methods']['bytes'] / 2**30:.2f} GiB, cold={result['methods']['cold']}",
                ("read", "GB/s"), rows)


def print_roundtrip(result: dict[str, Any]) -> None:
    ceiling, manager = result["ceiling"], result["manager"]
    rows = [
        ("pinned copy D2H / H2D (GB/s)",
         f"{ceiling['d2h_gbps']:.1f} / {ceiling['h2d_gbps']:.1f}"),
        ("write-through GPU -> host (GB/s)", f"{manager['store_gbps']:.1f}"),
        ("load host -> GPU (GB/s)", f"{manager['load_gbps']:.1f}"),
        ("store / load vs ceiling",
         f"{manager['store_vs_ceiling']:.2f} / {manager['load_vs_ceiling']:.2f}"),
        ("round trip vs ceiling", f"{manager['roundtrip_vs_ceiling']:.2f}"),
        ("bytes verified", str(manager["verified"])),
    ]
    if result["disk"] is not None:
        rows += [(f"restore disk -> GPU, warm, {result['disk']['io_threads']} I/O threads (GB/s)",
                  f"{result['disk']['restore_gbps']:.1f}"),
                 ("restore vs H2D ceiling", f"{result['disk']['restore_vs_h2d_ceiling']:.2f}"),
                 ("restored bytes verified", str(result["disk"]["verified"]))]
    if result["remote"] is not None:
        remote = result["remote"]
        kind = "cluster" if remote["cluster"] else "server"
        rows += [(f"restore remote ({kind}) -> GPU, {remote['io_threads']} I/O threads (GB/s)",
                  f"{remote['restore_gbps']:.2f}"),
                 ("plain redis-py pipeline of GETs (GB/s)", f"{remote['plain_get_gbps']:.2f}"),
                 ("remote restore vs plain GETs", f"{remote['vs_plain_get']:.2f}"),
                 ("remote bytes verified", str(remote["verified"]))]
    print_table(f"bench roundtrip: {result['num_blocks']} blocks of "
                f"{result['block_bytes'] / 2**20:.1f} MiB on {result['device']} "
                f"(median of {result['repeats']})", ("metric", "value"), rows)
