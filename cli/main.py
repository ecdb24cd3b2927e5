"""The `kvtier` command: the root app, global options, and the one place commands are added.

Each command lives in its own module and exposes a plain function (typer reads its
signature); `_register` below is where those functions are attached to the app. To add a
command, write its module and add one line there.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import Any

import typer
from kvtier.cli import cache, demo
from kvtier.cli.allocator import tune_malloc
from kvtier.cli.bench import commands as bench_commands
from kvtier.cli.bench import pool as bench_pool
from kvtier.cli.bench import roundtrip as bench_roundtrip
from kvtier.cli.bench import tiers as bench_tiers
from kvtier.cli.common import KvtierGroup, print_json, print_table

#: Distributions whose versions `kvtier info` reports, in this order.
_REPORTED_PACKAGES = ("torch", "triton", "transformers", "lmdb", "xxhash")

app = typer.Typer(
    name="kvtier",
    cls=KvtierGroup,
    help="KV-cache offload and tiered storage (GPU -> pinned host -> LMDB disk) for LLM "
         "inference, with a small embedded engine.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks (fixed seeds, medians; --json for machines).",
                        no_args_is_help=True)


def kvtier_version() -> str:
    """The installed kvtier version (the package's `__version__`)."""
    from kvtier import __version__
    return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtier {kvtier_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the kvtier version and exit."),
    debug: bool = typer.Option(False, "--debug",
                               help="Show the full traceback when a command fails."),
) -> None:
    """kvtier: KV-cache tiers for LLM inference."""
    tune_malloc()
    # Both options act elsewhere: --version in its callback, --debug in KvtierGroup.invoke,
    # which reads it from the root context's params under the name DEBUG_PARAM ("debug").


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _flash_attn_status() -> dict[str, Any]:
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:  # noqa: BLE001 (missing, or built for another torch / CUDA)
        return {"importable": False, "version": None, "reason": f"{type(exc).__name__}: {exc}"}
    return {"importable": True, "version": getattr(module, "__version__", None), "reason": None}


def collect_info() -> dict[str, Any]:
    """Versions, CUDA devices, optional backends and the default cache directory."""
    import torch
    from kvtier.engine.paths import cache_dir  # the engine's own resolution, so both always agree

    devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name,
                            "memory_bytes": int(props.total_memory),
                            "capability": f"{props.major}.{props.minor}"})
    return {
        "kvtier": kvtier_version(),
        "python": platform.python_version(),
        "packages": {name: _package_version(name) for name in _REPORTED_PACKAGES},
        "cuda": {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                 "devices": devices},
        "flash_attn": _flash_attn_status(),
        "default_cache_dir": str(cache_dir(create=False)),
    }


def info(
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Versions, CUDA devices, flash-attn, and the default cache directory."""
    result = collect_info()
    if json_output:
        print_json(result)
        return
    rows: list[tuple[str, str]] = [("kvtier", result["kvtier"]), ("python", result["python"])]
    rows += [(name, version or "not installed") for name, version in result["packages"].items()]
    cuda = result["cuda"]
    rows.append(("CUDA available", "yes" if cuda["available"] else "no"))
    for device in cuda["devices"]:
        rows.append((f"cuda:{device['index']}",
                     f"{device['name']}, {device['memory_bytes'] / 2**30:.1f} GiB"))
    flash = result["flash_attn"]
    rows.append(("flash-attn", f"yes ({flash['version']})" if flash["importable"] else "no"))
    rows.append(("default cache dir", result["default_cache_dir"]))
    print_table("kvtier info", ("item", "value"), rows)


def _register() -> None:
    """Attach every command to the app: the single place where commands are added."""
    app.command("info")(info)
    app.command("demo")(demo.demo)
    app.command("generate")(importlib.import_module("kvtier.cli.generate").generate)
    bench_app.command("pool")(bench_pool.pool)
    bench_app.command("longctx")(bench_commands.longctx)
    bench_app.command("serve")(bench_commands.serve)
    bench_app.command("diskread")(bench_commands.diskread)
    bench_app.command("kernels")(bench_commands.kernels)
    bench_app.command("swap")(bench_commands.swap)
    bench_app.command("tiers")(bench_tiers.tiers)
    bench_app.command("roundtrip")(bench_roundtrip.roundtrip)
    bench_app.command("soak")(importlib.import_module("kvtier.cli.bench.soak").soak)
    app.add_typer(bench_app, name="bench")
    cache_app = typer.Typer(help=cache.CACHE_HELP, no_args_is_help=True)
    for name, command in (("stats", cache.stats), ("inspect", cache.inspect),
                          ("verify", cache.verify), ("prune", cache.prune),
                          ("clear", cache.clear), ("export", cache.export),
                          ("import", cache.import_)):
        cache_app.command(name)(command)
    app.add_typer(cache_app, name="cache")


_register()

if __name__ == "__main__":
    app()
