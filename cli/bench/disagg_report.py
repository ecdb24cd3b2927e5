"""The report of `kvtier bench disagg` (kvtier.cli.bench.disagg runs it): what each
request's client saw (`Record`), a rate's latencies against the SLOs, the handoffs'
figures against the link's ceiling, and the tables printed from the JSON report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtier.cli.bench.longctx import summarize
from kvtier.cli.common import print_table


@dataclass(frozen=True, slots=True)
class Record:
    """One request as its client saw it."""

    long: bool
    ttft_s: float
    tpot_s: float | None
    token_ids: list[int]
    handoff: dict[str, Any] | None
    done_s: float


def rate_report(rate: float, records: list[Record], ttft_slo_s: float, tpot_slo_s: float
                ) -> dict[str, Any]:
    """One rate's figures: latencies, throughput, and whether P90 TTFT and P90 TPOT meet
    the SLOs (seconds)."""
    elapsed = max(r.done_s for r in records)
    ttfts = [r.ttft_s for r in records]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    ttft, tpot = summarize(ttfts), summarize(tpots) if tpots else None
    within = sum(1 for r in records if r.ttft_s <= ttft_slo_s
                 and (r.tpot_s is None or r.tpot_s <= tpot_slo_s))
    report: dict[str, Any] = {
        "rate_rps": rate, "num_requests": len(records), "elapsed_s": elapsed,
        "throughput_rps": len(records) / elapsed,
        "ttft_s": ttft, "tpot_s": tpot,
        "ttft_long_s": _summary_of([r.ttft_s for r in records if r.long]),
        "ttft_short_s": _summary_of([r.ttft_s for r in records if not r.long]),
        "slo_met": ttft["p90"] <= ttft_slo_s
        and (tpot is None or tpot["p90"] <= tpot_slo_s),
        "within_slo": within, "within_slo_rps": within / elapsed,
    }
    return report


def _summary_of(samples: list[float]) -> dict[str, float | int] | None:
    return summarize(samples) if samples else None


def handoff_report(records: list[Record], link: dict[str, Any] | None) -> dict[str, Any]:
    """The handoffs' figures as the prefill instances reported them (`x-kvtier-handoff`),
    their bandwidth against the link's ceiling `link`, and the fallbacks by reason."""
    figures = [r.handoff for r in records if r.handoff is not None]
    done = [f for f in figures if "fallback" not in f]
    num_bytes = sum(int(f.get("bytes", 0)) for f in done)
    transfer_s = sum(float(f.get("transfer_s", 0.0)) for f in done)
    per_request = [f["bytes"] / f["transfer_s"] / 1e9 for f in done
                   if f.get("transfer_s", 0) > 0 and f.get("bytes", 0) > 0]
    gb_s = num_bytes / transfer_s / 1e9 if transfer_s > 0 else None
    # The bytes' own time on the link, where the transport times it (NCCL, CUDA IPC): from
    # a send's rows being ready to their delivery, which the link ceiling is the bar for.
    timed = [f for f in done if isinstance(f.get("wire_s"), (int, float)) and f["wire_s"] > 0]
    wire_s = sum(float(f["wire_s"]) for f in timed)
    wire_gb_s = sum(int(f.get("bytes", 0)) for f in timed) / wire_s / 1e9 if timed else None
    reasons = Counter(str(f["fallback"]) for f in figures if "fallback" in f)
    return {
        "num_handoffs": len(done), "num_fallbacks": len(figures) - len(done),
        "fallback_reasons": dict(sorted(reasons.items())),
        "transports": sorted({str(f.get("transport")) for f in done}),
        "bytes": num_bytes, "transfer_s": transfer_s, "gb_s": gb_s,
        "gb_s_per_request": _summary_of(per_request),
        # Seconds per handoff: computing the prompt, sending, waiting for the decode
        # instance's acceptance (as the prefill instance reports them), and the whole call
        # as the router saw it.
        **{f"{phase}_s": _summary_of([float(f[f"{phase}_s"]) for f in done
                                      if isinstance(f.get(f"{phase}_s"), (int, float))])
           for phase in ("prefill", "transfer", "wait", "router")},
        # Where the transfer seconds went, summed over the handoffs (the prefill instance's
        # `read` and `commit`; within `commit`, the decode instance's `receive`, `place`).
        "phases_s": _phase_sums(done),
        "groups": sum(int(f.get("groups", 0)) for f in done),
        "blocks_sent": sum(int(f.get("blocks_sent", 0)) for f in done),
        "blocks_skipped": sum(int(f.get("blocks_skipped", 0)) for f in done),
        "of_link": gb_s / link["gb_s"] if gb_s is not None and link else None,
        "wire_s": wire_s if timed else None, "wire_gb_s": wire_gb_s,
        "wire_of_link": wire_gb_s / link["gb_s"] if wire_gb_s is not None and link else None,
    }


def _phase_sums(figures: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for figure in figures:
        phases = figure.get("phases_s")
        for phase, seconds in (phases.items() if isinstance(phases, dict) else ()):
            if isinstance(seconds, (int, float)):
                sums[phase] = sums.get(phase, 0.0) + float(seconds)
    return sums



def print_disagg(result: dict[str, Any]) -> None:
    """The result as tables: one row per mode and rate, then the handoff and the link."""
    def ms(summary: dict[str, Any] | None, key: str) -> str:
        return "-" if summary is None else f"{summary[key] * 1e3:,.0f}"

    config = result["config"]
    rows = []
    for mode, report in result["modes"].items():
        for run in report["rates"]:
            rate = f"{run['rate_rps']:g}" if run["rate_rps"] else "1 at a time"
            rows.append((mode, rate, ms(run["ttft_s"], "p50"),
                         ms(run["ttft_s"], "p90"), ms(run["ttft_s"], "p99"),
                         ms(run["tpot_s"], "p50"), ms(run["tpot_s"], "p90"),
                         ms(run["tpot_s"], "p99"), "yes" if run["slo_met"] else "no",
                         f"{run['within_slo_rps']:.2f}"))
    print_table(f"bench disagg: {result['model']}, SLO P90 TTFT <= {config['ttft_slo_s']} s "
                f"and P90 TPOT <= {config['tpot_slo_s']} s; times in ms",
                ("mode", "req/s", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
                 "SLO met", "req/s in SLO"), rows)
    lines = [(mode, f"{report['goodput_rps']:g} req/s", ", ".join(report["instances"]))
             for mode, report in result["modes"].items()]
    if result["goodput_ratio"] is not None:
        lines.append(("disaggregated / colocated", f"{result['goodput_ratio']:.2f}x", ""))
    handoff = result["modes"].get("disaggregated", {}).get("handoff")
    if handoff is not None:
        rate = "-" if handoff["gb_s"] is None else f"{handoff['gb_s']:.2f} GB/s"
        lines.append(("handoff", rate, f"{handoff['num_handoffs']} handoffs, "
                      f"{handoff['bytes'] / 2**20:,.1f} MiB, {handoff['num_fallbacks']} "
                      "fallbacks"))
        if handoff.get("wire_gb_s") is not None:
            lines.append(("handoff bytes on the link", f"{handoff['wire_gb_s']:.2f} GB/s",
                          f"{handoff['wire_s']:.3f} s from ready to delivered"))
        phases = handoff.get("phases_s") or {}
        if phases:
            lines.append(("handoff seconds by part", f"{sum(phases.values()):.3f} s",
                          ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
                          + f"; {handoff.get('groups', 0)} groups"))
    if result["link"] is not None:
        link = result["link"]
        lines.append((f"link ceiling ({link['backend']})", f"{link['gb_s']:.2f} GB/s",
                      f"{link['bytes'] / 2**20:,.0f} MiB {link['src_device']} -> "
                      f"{link['dst_device']}"))
        copies = link.get("copy_engine")
        if copies is not None:
            lines.append(("copy engine ceiling", f"{copies['gb_s']:.2f} GB/s",
                          f"{copies['bytes'] / 2**20:,.0f} MiB peer copy, one process"))
    if result["ttft_p50_ratio"] is not None:
        ratios = ", ".join(f"{r:.2f}x" for r in result["ttft_p50_ratio"])
        lines.append(("TTFT p50 disaggregated / colocated", ratios, "per rate"))
    if result["outputs_equal"] is not None:
        equal = result["outputs_equal"]
        lines.append(("outputs equal", f"{equal['equal']} of {equal['total']}", ""))
    print_table("goodput", ("", "value", "detail"), lines)
