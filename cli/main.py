"""The `kvtier` command: the root app, global options, and the one place commands are added.

Each command lives in its own module and exposes a plain function (typer reads its
signature). `LAZY_COMMANDS` below lists them by name, "module:attribute" and one-line help:
a module is imported only when its command runs, so `kvtier --version` and `kvtier --help`
never import torch. To add a command, write its module and add one line there.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import Any

import typer
from kvtier.cli.allocator import tune_malloc
from kvtier.cli.common import KvtierGroup, print_json, print_table

#: Distributions whose versions `kvtier info` reports, in this order.
_REPORTED_PACKAGES = ("torch", "triton", "transformers", "lmdb", "xxhash",
                      "nvidia-cudnn-frontend")

#: (name, "module:attribute", help) of every command loaded when it runs; the help repeats
#: the command's own (its docstring or group help; a test keeps them equal).
LAZY_COMMANDS = (
    ("generate", "kvtier.cli.generate:generate",
     "Generate text for PROMPTs with the tiered KV cache."),
    ("demo", "kvtier.cli.demo:demo",
     "Play a multi-turn long-document session whose KV spills GPU -> host -> disk and comes "
     "back; show per-turn restores and check every answer against a tiers-off run."),
    ("serve", "kvtier.cli.serve:serve",
     "Serve the model over an OpenAI-compatible HTTP API (completions, chat, metrics)."),
    ("router", "kvtier.cli.router:router",
     "Route OpenAI-compatible requests over prefill and decode instances (or colocated)."),
    ("bench", "kvtier.cli.groups:bench_app",
     "Benchmarks (fixed seeds, medians; --json for machines)."),
    ("cache", "kvtier.cli.groups:cache_app",
     "Inspect and maintain a disk tier directory (LMDB). Default directory: the engine's "
     "disk cache (<user cache dir>/kv); choose another with --dir."),
)


class _RootGroup(KvtierGroup):
    lazy_commands = LAZY_COMMANDS


app = typer.Typer(
    name="kvtier",
    cls=_RootGroup,
    help="KV-cache offload and tiered storage (GPU -> pinned host -> LMDB disk) for LLM "
         "inference, with a small embedded engine.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=True,
)


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
    from kvtier.engine.attention import select_backend
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
        "attn_backend_auto": select_backend("cuda" if torch.cuda.is_available() else "cpu", 16),
        "default_cache_dir": str(cache_dir(create=False)),
    }


def info(
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Versions, CUDA devices, optional attention backends, the default cache directory."""
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
    rows.append(("attention backend (auto)", result["attn_backend_auto"]))
    rows.append(("default cache dir", result["default_cache_dir"]))
    print_table("kvtier info", ("item", "value"), rows)


def _register() -> None:
    """Attach the commands defined here; the others are in `LAZY_COMMANDS`."""
    app.command("info")(info)


_register()

if __name__ == "__main__":
    app()
