"""`kvtier cache stats|inspect|verify|clear --remote URL`: the same commands for the blocks a
remote tier (Redis / Redis Cluster) holds, over `kvtier.tiers.remote.admin`."""

from __future__ import annotations

import typer
from kvtier.cli.common import print_json, print_table

from kvtier.tiers.remote.config import RemoteConfig

REMOTE_HELP = ("Work on a remote tier instead of a disk directory: a Redis URL "
               "(redis://, rediss://, redis+cluster://; user and password in the URL).")
PREFIX_HELP = "Key prefix of the remote tier's blocks (as the engines were given it)."


def _mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:,.1f} MiB"


def stats(url: str, key_prefix: str, json_output: bool) -> None:
    from kvtier.tiers.remote.admin import remote_stats
    result = remote_stats(RemoteConfig(url, key_prefix=key_prefix))
    if json_output:
        print_json(result)
        return
    print_table("remote tier", ("item", "value"), [
        ("url", result["url"]), ("cluster", result["cluster"]),
        ("key prefix", result["key_prefix"]), ("blocks", f"{result['num_blocks']:,}"),
        ("record bytes", _mib(result["bytes_used"]))])
    if result["layouts"]:
        print_table("layouts", ("layout fingerprint", "blocks", "bytes"),
                    [(e["fingerprint"], f"{e['num_blocks']:,}", _mib(e["bytes"]))
                     for e in result["layouts"]])
    print_table("servers", ("node", "used memory", "maxmemory", "policy"),
                [(s["node"], _mib(s["used_memory"]), _mib(s["maxmemory"]) if s["maxmemory"]
                  else "no limit", s["policy"]) for s in result["servers"]])


def inspect(url: str, key_prefix: str, limit: int, json_output: bool) -> None:
    from kvtier.tiers.remote.admin import remote_inspect
    rows = remote_inspect(RemoteConfig(url, key_prefix=key_prefix), limit)
    if json_output:
        print_json(rows)
        return
    print_table(f"{len(rows)} remote blocks",
                ("hash", "idle s", "ttl s", "tokens", "bytes", "status", "layout"),
                [(r["hash"][:16], r["idle_s"] if r["idle_s"] is not None else "-",
                  r["ttl_s"] if r["ttl_s"] is not None else "-", r["num_tokens"] or "-",
                  r["bytes"], r["status"], r["layout"][:16]) for r in rows])


def verify(url: str, key_prefix: str, repair: bool, json_output: bool) -> None:
    from kvtier.tiers.remote.admin import remote_verify
    report = remote_verify(RemoteConfig(url, key_prefix=key_prefix), repair=repair)
    if json_output:
        print_json({"num_checked": report.num_checked, "ok": report.ok,
                    "bad": [{"key": key, "reason": reason} for key, reason in report.bad],
                    "num_removed": report.num_removed})
    else:
        print_table("verify (remote)", ("item", "value"), [
            ("blocks checked", f"{report.num_checked:,}"), ("damaged blocks", len(report.bad)),
            ("removed", report.num_removed)])
        if report.bad:
            print_table("damaged blocks", ("key", "reason"), report.bad)
        typer.echo("ok: every block is sound" if report.ok else
                   "repaired: damaged blocks removed" if repair else
                   "damage found; run again with --repair to remove it (engines treat "
                   "damaged blocks as misses meanwhile)")
    if not report.ok and not repair:
        raise typer.Exit(1)


def clear(url: str, key_prefix: str, yes: bool, json_output: bool) -> None:
    from kvtier.tiers.remote.admin import remote_clear
    config = RemoteConfig(url, key_prefix=key_prefix)
    if not yes:
        typer.confirm(f"Delete every block under {key_prefix}:* in the remote cache?",
                      abort=True)
    num_removed = remote_clear(config)
    if json_output:
        print_json({"num_removed": num_removed})
    else:
        typer.echo(f"removed {num_removed} blocks from the remote cache")
