"""Print the short table of scripts/gpu_restore.sh from the JSON files in a directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def longctx_rows(name: str, result: dict) -> None:
    runs = result["runs"] if "runs" in result else [result]
    for run in runs:
        base = run["strategies"]["recompute"]["ttft_s"]["p50"]
        for strategy, f in run["strategies"].items():
            meet = f["meeting_blocks"]
            restored = [m["host"] + m["disk"] for m in meet]
            computed = [m["computed"] for m in meet]
            print(f"{name} {run['prompt_tokens']:>6} {strategy:>9} ttft_p50 "
                  f"{f['ttft_s']['p50'] * 1e3:8.1f} ms  x_recompute {f['ttft_s']['p50'] / base:.3f}"
                  f"  computed/restored {computed}/{restored} cold={f.get('cold')}")
        disk = run.get("disk_read")
        if disk:
            raw = disk["raw"]
            print(f"{name} {run['prompt_tokens']:>6} disk tier {disk['tier']['gb_s']:.2f} GB/s"
                  f" (cold={disk['tier']['cold']}); raw buffered {raw.get('buffered_gb_s')}"
                  f" direct {raw.get('direct_gb_s')} best {raw['best_gb_s']:.2f};"
                  f" ratio {disk['tier_vs_best_raw']:.2f}"
                  f" (scattered {disk.get('scattered_vs_best_raw', float('nan')):.2f})")
        print(f"{name} {run['prompt_tokens']:>6} outputs identical: {run['outputs_identical']}")


def main(directory: str) -> None:
    out = Path(directory)
    diskread = load(out / "diskread.json")
    if diskread:
        for part in ("methods", "tier", "raw"):
            print("diskread", part, {k: round(v, 2) if isinstance(v, float) else v
                                     for k, v in diskread[part].items()})
    for name in ("longctx_cold", "longctx_warm"):
        result = load(out / f"{name}.json")
        if result:
            longctx_rows(name, result)
    io_table = out / "io.json"  # the `io` stage prints text
    if io_table.exists():
        print(io_table.read_text())
    serve = load(out / "serve.json")
    if serve:
        for mode, m in serve["modes"].items():
            print(f"serve {mode:>10} tok/s {m['throughput_tok_s']:8.1f} ttft p50 "
                  f"{m['ttft_s']['p50']:.3f} p99 {m['ttft_s']['p99']:.3f} "
                  f"ratio {serve['ratios_vs_baseline'][mode]}")
            for run in m.get("runs", []):
                print(f"      run tok/s {run['throughput_tok_s']:8.1f} "
                      f"ttft p99 {run['ttft_p99_s']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
