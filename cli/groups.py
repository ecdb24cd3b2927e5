"""The `kvtier bench` and `kvtier cache` command groups.

Imported only when one of their commands runs (see `kvtier.cli.main`): the benchmark
modules import torch.
"""

from __future__ import annotations

import importlib

import typer
from kvtier.cli import cache
from kvtier.cli.bench import commands as bench_commands
from kvtier.cli.bench import pool as bench_pool
from kvtier.cli.bench import roundtrip as bench_roundtrip
from kvtier.cli.bench import tiers as bench_tiers

#: One-line help of each group, shown by `kvtier --help` without importing this module.
BENCH_HELP = "Benchmarks (fixed seeds, medians; --json for machines)."

bench_app = typer.Typer(help=BENCH_HELP, no_args_is_help=True, add_completion=False)
bench_app.command("pool")(bench_pool.pool)
bench_app.command("longctx")(bench_commands.longctx)
bench_app.command("serve")(bench_commands.serve)
bench_app.command("diskread")(bench_commands.diskread)
bench_app.command("kernels")(bench_commands.kernels)
bench_app.command("swap")(bench_commands.swap)
bench_app.command("invariance")(bench_commands.invariance)
bench_app.command("tiers")(bench_tiers.tiers)
bench_app.command("roundtrip")(bench_roundtrip.roundtrip)
bench_app.command("soak")(importlib.import_module("kvtier.cli.bench.soak").soak)
bench_app.command("damage")(importlib.import_module("kvtier.cli.bench.damage").damage)
bench_app.command("disagg")(importlib.import_module("kvtier.cli.bench.disagg").disagg)

cache_app = typer.Typer(help=cache.CACHE_HELP, no_args_is_help=True, add_completion=False)
for _name, _command in (("stats", cache.stats), ("inspect", cache.inspect),
                        ("verify", cache.verify), ("prune", cache.prune),
                        ("clear", cache.clear), ("export", cache.export),
                        ("import", cache.import_)):
    cache_app.command(_name)(_command)
