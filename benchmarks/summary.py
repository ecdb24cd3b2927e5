"""Print the tables of every `kvtier bench --json` result a GPU runner left in a directory.

    python3 benchmarks/summary.py OUT_DIR

A result's `bench` field says which bench wrote it, else the file's name does
(`kernels.json`, `swap*.json`, `roundtrip.json`, `invariance*.json`, as the
benchmarks/gpu_*.sh runners name them; `small_host.json` and `conversations.json` are
`bench longctx` and `bench serve` results); each is printed with the table its bench
prints without `--json`. A file that is missing, empty or not JSON (a stage that failed or
timed out) is named on stderr and skipped. Exits 1 when no result was found.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.cli.bench import tables
from kvtier.cli.bench.disagg_report import print_disagg


def _longctx(result: dict[str, Any]) -> None:
    (tables.print_longctx_sweep if "runs" in result else tables.print_longctx)(result)


#: File-name prefix -> the table of the bench that writes such files.
PRINTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "kernels": tables.print_kernels, "swap": tables.print_swap,
    "diskread": tables.print_diskread, "roundtrip": tables.print_roundtrip,
    "longctx": _longctx, "serve": tables.print_serve, "disagg": print_disagg,
    "invariance": tables.print_invariance,
}


def _printer(path: Path, result: object) -> Callable[[dict[str, Any]], None] | None:
    """The table for `result`: by its `bench` field (`longctx-sweep` is a longctx), else by
    the prefix of its file's name; None for a file that is no bench result."""
    bench = result.get("bench") if isinstance(result, dict) else None
    kind = bench.split("-")[0] if isinstance(bench, str) else None
    if kind is not None and kind in PRINTERS:
        return PRINTERS[kind]
    return next((p for prefix, p in PRINTERS.items() if path.stem.startswith(prefix)), None)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if len(argv) != 1 else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    directory = Path(argv[0])
    printed = 0
    for path in sorted(directory.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"{path.name}: no result ({exc})", file=sys.stderr)
            continue
        printer = _printer(path, result)
        if printer is None:
            continue
        print(f"== {path.name}")
        printer(result)
        printed += 1
    if not printed:
        print(f"no bench results (*.json) in {directory}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
