"""`kvtier cache ...`: look after a disk tier directory (stats, inspect, verify, prune, clear,
export, import).

Thin wrappers over `kvtier.tiers.disk.admin`; every command takes `--dir` (default: the
engine's disk cache directory) and reports problems as one line through the root group's
error handling. Do not run them on a directory that a kvtier engine in the same process has
open; other processes are fine (LMDB's locks coordinate them).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from kvtier.cli import cache_remote
from kvtier.cli.common import print_json, print_table
from kvtier.engine.engine_config import default_disk_cache_dir

from kvtier.tiers.disk import admin as disk_admin
from kvtier.tiers.disk.shard_layout import (
    LARGE_BUDGET_SHARDS,
    MAX_SHARDS,
    SHARDING_BUDGET_BYTES,
)

GIB = 1 << 30

#: Help of the `kvtier cache` group (the commands are attached in cli/main.py).
CACHE_HELP = ("Inspect and maintain a disk tier directory (LMDB). Default directory: the "
              "engine's disk cache (<user cache dir>/kv); choose another with --dir.")

_DIR_HELP = "Disk tier directory (default: <user cache dir>/kv, where the engine keeps it)."
_JSON_HELP = "Print JSON instead of a table."
_REMOTE = typer.Option(None, "--remote", help=cache_remote.REMOTE_HELP)
_PREFIX = typer.Option("kvtier", "--key-prefix", help=cache_remote.PREFIX_HELP)


def _resolve_dir(directory: Path | None) -> Path:
    return default_disk_cache_dir() if directory is None else directory.expanduser()


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:,.1f} MiB"


def stats(
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote: str | None = _REMOTE, key_prefix: str = _PREFIX,
) -> None:
    """Blocks, bytes used, budget and the KV layouts stored in a disk tier."""
    if remote is not None:
        return cache_remote.stats(remote, key_prefix, json_output)
    result = disk_admin.cache_stats(_resolve_dir(directory))
    if json_output:
        print_json(result)
        return
    rows = [
        ("path", result["path"]),
        ("shards", result["shards"]),
        ("blocks", f"{result['num_blocks']:,}"),
        ("record bytes", _mib(result["bytes_used"])),
        ("budget", _mib(result["budget_bytes"])),
        ("file size", _mib(result["file_bytes"])),
        ("disk format", result["format_version"]),
    ]
    print_table("disk tier", ("item", "value"), rows)
    if result["layouts"]:
        print_table("layouts", ("layout", "blocks", "bytes"),
                    [(entry["layout"] or entry["fingerprint"], f"{entry['num_blocks']:,}",
                      _mib(entry["bytes"])) for entry in result["layouts"]])


def _when(row: dict) -> str:
    """A block's last access as a local time (its sequence number when it has none)."""
    seconds = row.get("last_access_time")
    if seconds is None:
        return f"#{row['last_access']}"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def inspect(
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    limit: int = typer.Option(20, "--limit", min=0, help="How many blocks to list."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote: str | None = _REMOTE, key_prefix: str = _PREFIX,
) -> None:
    """The most recently used blocks, newest first (headers only; `verify` checks bytes)."""
    if remote is not None:
        return cache_remote.inspect(remote, key_prefix, limit, json_output)
    rows = disk_admin.inspect(_resolve_dir(directory), limit)
    if json_output:
        print_json(rows)
        return
    print_table(f"{len(rows)} most recently used blocks",
                ("hash", "last access", "tokens", "bytes", "status", "layout"),
                [(row["hash"][:16], _when(row), row["num_tokens"] or "-",
                  row["bytes"] if row["bytes"] is not None else "-", row["status"],
                  row["layout"] or "-") for row in rows])


def verify(
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    repair: bool = typer.Option(False, "--repair",
                                help="Delete damaged blocks and rebuild the access index."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote: str | None = _REMOTE, key_prefix: str = _PREFIX,
) -> None:
    """Check LMDB's files, every block's header and checksum, and the access index.

    Damaged LMDB files (a page, the length or the kind of data.mdb, lock.mdb) cannot be
    mended: --repair moves them aside to <dir>.damaged-<time>, as the engine does, and the
    next run starts an empty cache. Exits with status 1 when damage was found and --repair
    was not given.
    """
    if remote is not None:
        return cache_remote.verify(remote, key_prefix, repair, json_output)
    report = disk_admin.verify(_resolve_dir(directory), repair=repair)
    if json_output:
        print_json({"num_checked": report.num_checked, "ok": report.ok,
                    "bad": [{"hash": key, "reason": reason} for key, reason in report.bad],
                    "index_errors": report.index_errors, "num_removed": report.num_removed,
                    "repaired": report.repaired, "files_problem": report.files_problem,
                    "moved_to": report.moved_to})
    elif report.files_problem is not None:
        typer.echo(f"damaged files: {report.files_problem}")
        if report.moved_to is not None:
            typer.echo(f"repaired: moved the damaged files to {report.moved_to} (kept, not "
                       "deleted); the next run starts an empty disk cache")
        else:
            typer.echo("run `kvtier cache verify --repair` to move them aside (nothing is "
                       "deleted); the engine does the same when it meets them")
    else:
        rows = [("blocks checked", f"{report.num_checked:,}"),
                ("damaged blocks", len(report.bad)),
                ("index errors", report.index_errors),
                ("removed", report.num_removed)]
        print_table("verify", ("item", "value"), rows)
        if report.bad:
            print_table("damaged blocks", ("hash", "reason"),
                        [(key[:16], reason) for key, reason in report.bad])
        if report.ok:
            typer.echo("ok: every block and the index are sound")
        elif repair:
            typer.echo("repaired: damaged blocks removed, index rebuilt")
        else:
            typer.echo("damage found; run `kvtier cache verify --repair` to remove it")
    if not report.ok and not repair:
        raise typer.Exit(1)


def prune(
    max_gb: float = typer.Option(..., "--max-gb", min=0.0,
                                 help="Keep at most this many GiB of blocks (least recently "
                                      "used go first)."),
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Evict least-recently-used blocks until the tier holds at most --max-gb GiB."""
    max_bytes = int(max_gb * GIB)
    num_removed = disk_admin.prune(_resolve_dir(directory), max_bytes)
    if json_output:
        print_json({"num_removed": num_removed, "max_bytes": max_bytes})
    else:
        typer.echo(f"removed {num_removed} blocks; at most {_mib(max_bytes)} remain")


def clear(
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
    remote: str | None = _REMOTE, key_prefix: str = _PREFIX,
) -> None:
    """Delete every block of the disk tier (or, with --remote, of the remote tier)."""
    if remote is not None:
        return cache_remote.clear(remote, key_prefix, yes, json_output)
    path = _resolve_dir(directory)
    if not yes:
        typer.confirm(f"Delete every cached block in {path}?", abort=True)
    num_removed = disk_admin.clear(path)
    if json_output:
        print_json({"num_removed": num_removed})
    else:
        typer.echo(f"removed {num_removed} blocks from {path}")


def export(
    file: Path = typer.Argument(..., help="Export file to write (replaced if it exists)."),
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Write every block to one portable, checksummed file."""
    num_blocks = disk_admin.export_cache(_resolve_dir(directory), file)
    if json_output:
        print_json({"num_blocks": num_blocks, "file": str(file)})
    else:
        typer.echo(f"exported {num_blocks} blocks to {file}")


def import_(
    file: Path = typer.Argument(..., help="Export file made by `kvtier cache export`."),
    directory: Path | None = typer.Option(None, "--dir", help=_DIR_HELP),
    shards: int | None = typer.Option(
        None, "--shards", min=1, max=MAX_SHARDS,
        help="LMDB environments a new directory is split over (an existing one keeps its "
             f"own; default: {LARGE_BUDGET_SHARDS} for a file of "
             f"{SHARDING_BUDGET_BYTES >> 30} GiB or more, else 1).", show_default=False),
    json_output: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Add the blocks of an export file (verified first; blocks already present are kept)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist or is not a file; pass the path of a "
                                "file made by `kvtier cache export`")
    num_new = disk_admin.import_cache(_resolve_dir(directory), file, shards=shards)
    if json_output:
        print_json({"num_new": num_new, "file": str(file)})
    else:
        typer.echo(f"imported {num_new} new blocks from {file}")
