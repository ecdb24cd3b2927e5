"""`kvtier bench tiers`: host <-> disk throughput of the LMDB tier against a plain file.

Each repeat writes the same `num_blocks` blocks (random bytes, fixed seed) from a host slab
twice, through the tier's write jobs (`DiskTier.write_job`, or with `shards` above one a
`ShardedDiskTier`'s, whose shards commit side by side) in batches and to one plain
file, then reads them back into the slab, through `DiskTier.get_many_into` and with
`readinto` from the file. The plain file gets the durability the tier is opened with.
Non-durable (the default, as the engine opens its tier): the tier syncs in the background
every `sync_every_bytes` as in the engine, and each pass ends with one sync of its file
(the tier's `sync()`, an `os.fsync` of the plain file) inside the timed write, so the
ratio compares the tier with a raw sequential write of the same bytes to the same disk,
getting them onto it included. Durable: one fdatasync per file batch, as LMDB (sync on,
meta sync off) does once per commit, and the same final sync. With `writers` above one, that
many threads run the tier's write jobs, each taking the next batch, as the store path keeps
`write_depth` batches in flight; the plain file is written by one thread either way (the
bar: the disk's sequential speed). Both reads hit the page cache the writes just filled, so
they compare the code paths, not the device. The two paths alternate which goes first,
after one untimed pass of each (`_warm_up`).
Figures are medians over `repeats`; per-batch latencies are pooled over all repeats for
p50/p90/p99 (the final sync is not a batch: its seconds are reported apart, `sync_s`).
Minor page faults per batch (the process's, counted outside the timed region) are reported
next to them: LMDB copies each value into pages it mallocs, and when the C library hands
that memory back to the system between commits every batch faults it in again.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import typer
from kvtier.cli.common import print_json, print_table

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout, parse_dtype
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import (
    LARGE_BUDGET_SHARDS,
    MAX_SHARDS,
    SHARDING_BUDGET_BYTES,
)
from kvtier.tiers.record import BlockMeta, metas_for

_MB = 1e6


def _make_blocks(layout: KVLayout, num_blocks: int, seed: int
                 ) -> tuple[list[BlockMeta], torch.Tensor]:
    parent = namespace_hash("bench/tiers", layout)
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, 50_000, num_blocks * layout.block_size).tolist()
    metas = metas_for(parent, hash_blocks(parent, token_ids, layout.block_size), token_ids,
                      layout.block_size)
    # [num_blocks, bytes_per_block] uint8: the host slab the blocks come from and go to
    slab = torch.from_numpy(rng.integers(0, 256, (num_blocks, layout.bytes_per_block),
                                         dtype=np.uint8))
    return metas, slab


def _batches(num_blocks: int, batch_size: int) -> list[slice]:
    return [slice(i, min(i + batch_size, num_blocks)) for i in range(0, num_blocks, batch_size)]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _new_times() -> dict[str, list[float]]:
    return {"write": [], "read": [], "write_faults": [], "read_faults": [], "sync": []}


@contextmanager
def _timed(times: dict[str, list[float]], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    times[key].append(time.perf_counter() - start)


@contextmanager
def _measured(times: dict[str, list[float]], op: str) -> Iterator[None]:
    """Append the block's seconds to `times[op]` and the process's minor page faults
    meanwhile to `times[op + "_faults"]` (read outside the timed region)."""
    faults = _minor_faults()
    start = time.perf_counter()
    yield
    times[op].append(time.perf_counter() - start)
    times[f"{op}_faults"].append(_minor_faults() - faults)


def _lmdb_pass(root: Path, layout: KVLayout, metas: list[BlockMeta], slab: torch.Tensor,
               batches: list[slice], durable: bool, writers: int,
               shards: int) -> dict[str, list[float]]:
    budget = len(metas) * (layout.bytes_per_block + 4096) * 2
    times = _new_times()
    tier, _ = open_disk_tier(root, layout, budget, shards=shards, durable=durable)
    assert tier is not None, f"no disk tier could be opened in {root}"
    with tier:
        def write(batch: slice) -> None:
            job, stored = tier.write_job(metas[batch], list(slab[batch]))
            job.run()
            assert all(stored), "the bench budget must hold every block"

        if writers == 1:
            for batch in batches:
                with _measured(times, "write"):
                    write(batch)
        else:
            _write_on_threads(write, batches, writers, times)
        with _timed(times, "sync"):
            tier.sync()
        syncs = tier.stats().syncs
        slab.zero_()
        for batch in batches:
            with _measured(times, "read"):
                found = tier.get_many_into(metas[batch], list(slab[batch]))
            assert all(found), "a block written by the bench was not read back"
    times["syncs"] = [syncs]
    return times


def _write_on_threads(write, batches: list[slice], writers: int,
                      times: dict[str, list[float]]) -> None:
    """`write` every batch on `writers` threads, each taking the next batch: the whole
    pass is one "write" time (the batches overlap), with the process's page faults."""
    queue = list(reversed(batches))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue or failures:
                    return
                batch = queue.pop()
            try:
                write(batch)
            except BaseException as exc:  # re-raised on the bench's thread
                with lock:
                    failures.append(exc)
                return

    with _measured(times, "write"):
        threads = [threading.Thread(target=worker, name=f"bench-writer-{i}")
                   for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    times["write_faults"][-1] /= len(batches)  # per batch, like the file's


def _file_pass(root: Path, slab: torch.Tensor, batches: list[slice],
               durable: bool) -> dict[str, list[float]]:
    path = root / "blocks.bin"
    array = slab.numpy()  # [num_blocks, bytes_per_block]
    times = _new_times()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "r+b", buffering=0, closefd=False) as out:
            for batch in batches:
                with _measured(times, "write"):
                    for row in array[batch]:
                        out.write(row)
                    if durable:
                        os.fdatasync(fd)
            with _timed(times, "sync"):
                os.fsync(fd)
            slab.zero_()
            out.seek(0)
            for batch in batches:
                with _measured(times, "read"):
                    for row in array[batch]:
                        out.readinto(row)
    finally:
        os.close(fd)
    return times


def _warm_up(root: Path, layout: KVLayout, metas: list[BlockMeta], slab: torch.Tensor,
             batches: list[slice], durable: bool, writers: int, shards: int) -> None:
    """One untimed pass of each path: on the CPU machine (a VM) the first GiB a process
    wrote took seconds more than the next ones, whichever path wrote it (memory touched for
    the first time), and repeat 0 always starts with LMDB. The figures are then the paths'
    steady state, which a long-running engine sees."""
    for path in ("lmdb", "file"):
        (root / path).mkdir(mode=0o700, parents=True)
        if path == "lmdb":
            _lmdb_pass(root / path, layout, metas, slab, batches, durable, writers, shards)
        else:
            _file_pass(root / path, slab, batches, durable)
        shutil.rmtree(root / path)


def _summary(seconds_per_repeat: list[float], batch_seconds: list[float],
             batch_faults: list[float], num_bytes: int,
             sync_seconds: list[float] | None = None) -> dict:
    median = statistics.median(seconds_per_repeat)
    pooled = np.asarray(batch_seconds) * 1e3
    summary = {"mb_per_s": num_bytes / median / _MB, "median_s": median,
               "seconds": seconds_per_repeat,
               "batch_ms": {f"p{q}": float(np.percentile(pooled, q)) for q in (50, 90, 99)},
               "minor_faults_per_batch": statistics.median(batch_faults)}
    if sync_seconds is not None:  # the final sync, inside `seconds`
        summary["sync_s"] = statistics.median(sync_seconds)
    return summary


def run_tiers_bench(num_blocks: int, layout: KVLayout, tmpdir: str | os.PathLike[str], *,
                    batch_size: int = 16, repeats: int = 5, durable: bool = False,
                    seed: int = 0, writers: int = 1, shards: int = 1) -> dict:
    """Time LMDB and plain-file writes and reads of the same blocks; a JSON-ready dict.

    `write_ratio` / `read_ratio` are LMDB MB/s over plain-file MB/s (goals: >= 0.8 and
    >= 0.9; reported, not asserted); a write's time ends with one sync of its file (see the
    module docstring for `durable`). `writers`: threads running the tier's write jobs (then
    the LMDB write batch latencies are the whole pass's). `shards`: LMDB environments the
    tier is split over (`kvtier.tiers.disk.shards`). Work happens in a fresh directory
    under `tmpdir`, removed afterwards. Raises ValueError for non-positive sizes.
    """
    for name, value in (("num_blocks", num_blocks), ("batch_size", batch_size),
                        ("repeats", repeats), ("writers", writers), ("shards", shards)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    metas, slab = _make_blocks(layout, num_blocks, seed)
    expected = slab.clone()
    batches = _batches(num_blocks, batch_size)
    num_bytes = num_blocks * layout.bytes_per_block
    totals: dict[str, dict[str, list[float]]] = {
        path: {"write": [], "read": []} for path in ("lmdb", "file")}
    pooled = {path: _new_times() for path in ("lmdb", "file")}
    base = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=tmpdir))
    try:
        _warm_up(base / "warm-up", layout, metas, slab, batches, durable, writers, shards)
        for repeat in range(repeats):
            order = ("lmdb", "file") if repeat % 2 == 0 else ("file", "lmdb")
            for path in order:
                root = base / f"{path}-{repeat}"
                root.mkdir(mode=0o700)
                slab.copy_(expected)
                if path == "lmdb":
                    times = _lmdb_pass(root, layout, metas, slab, batches, durable, writers,
                                       shards)
                else:
                    times = _file_pass(root, slab, batches, durable)
                assert torch.equal(slab, expected), f"{path}: bytes read back differ"
                shutil.rmtree(root)
                totals[path]["write"].append(sum(times["write"]) + sum(times["sync"]))
                totals[path]["read"].append(sum(times["read"]))
                for key, values in times.items():
                    pooled[path].setdefault(key, []).extend(values)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result: dict = {"layout": layout.describe(), "bytes_per_block": layout.bytes_per_block,
                    "num_blocks": num_blocks, "batch_size": batch_size, "repeats": repeats,
                    "durable": durable, "mode": _mode(durable), "writers": writers,
                    "shards": shards,
                    "tmpdir": str(tmpdir)}
    for path in ("lmdb", "file"):
        result[path] = {
            "write": _summary(totals[path]["write"], pooled[path]["write"],
                              pooled[path]["write_faults"], num_bytes, pooled[path]["sync"]),
            "read": _summary(totals[path]["read"], pooled[path]["read"],
                             pooled[path]["read_faults"], num_bytes)}
    # The tier's syncs per repeat, the final one included (more when a pass wrote past
    # `sync_every_bytes`, whose background syncs overlap the writes).
    result["lmdb"]["syncs"] = statistics.median(pooled["lmdb"]["syncs"])
    for op in ("write", "read"):
        result[f"{op}_ratio"] = (result["lmdb"][op]["mb_per_s"]
                                 / result["file"][op]["mb_per_s"])
    return result


def _mode(durable: bool) -> str:
    return ("durable: a sync per commit / file batch, and one at the end" if durable else
            "non-durable: one sync at the end (and the tier's every GiB), as the engine")


def tiers(
    num_blocks: int = typer.Option(128, help="Blocks written and read per repeat."),
    num_layers: int = typer.Option(32, help="Layers of the block layout."),
    num_kv_heads: int = typer.Option(8, help="KV heads of the block layout."),
    head_dim: int = typer.Option(128, help="Head dimension of the block layout."),
    block_size: int = typer.Option(16, help="Tokens per block."),
    dtype: str = typer.Option("bfloat16", help="float32, float16 or bfloat16."),
    batch_size: int = typer.Option(16, help="Blocks per put / get / fdatasync."),
    repeats: int = typer.Option(5, help="Repeats; figures are medians."),
    durable: bool = typer.Option(
        False, help="fsync each commit (and each file batch). Either way both writes end with "
        "one sync of their file, inside the time. (default: off, as the engine's tier)",
        show_default=False),
    writers: int = typer.Option(1, help="Threads running the tier's write jobs (the store "
                                        "path keeps 2 batches in flight)."),
    shards: int = typer.Option(1, min=1, max=MAX_SHARDS,
                               help="LMDB environments the tier is split over (the engine's "
                                    f"default: {LARGE_BUDGET_SHARDS} from a "
                                    f"{SHARDING_BUDGET_BYTES >> 30} GiB budget, else 1)."),
    tmpdir: Path | None = typer.Option(None, help="Where the files go (default: the "
                                                   "system temporary directory)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """LMDB disk tier vs a plain file: host <-> disk MB/s, measured side by side."""
    layout = KVLayout(num_layers, num_kv_heads, head_dim, block_size, parse_dtype(dtype))
    result = run_tiers_bench(num_blocks, layout, tmpdir or tempfile.gettempdir(),
                             batch_size=batch_size, repeats=repeats, durable=durable,
                             writers=writers, shards=shards)
    if json_output:
        print_json(result)
        return
    rows = []
    for op, goal in (("write", 0.8), ("read", 0.9)):
        lmdb_figures, file_figures = result["lmdb"][op], result["file"][op]
        rows.append((op, f"{lmdb_figures['mb_per_s']:,.0f}", f"{file_figures['mb_per_s']:,.0f}",
                     f"{result[f'{op}_ratio']:.2f} ({goal})",
                     (f"{lmdb_figures['batch_ms']['p50']:.1f} / "
                      f"{lmdb_figures['batch_ms']['p99']:.1f}"),
                     (f"{lmdb_figures['minor_faults_per_batch']:,.0f} / "
                      f"{file_figures['minor_faults_per_batch']:,.0f}")))
    print_table(f"bench tiers: {num_blocks} x {layout.bytes_per_block / 2**20:.2f} MiB blocks, "
                f"{writers} writer thread(s), {shards} shard(s), median of {repeats}; "
                f"{result['mode']}; minor page "
                "faults LMDB / file",
                ("op", "LMDB MB/s", "file MB/s", "ratio (goal)", "LMDB ms p50/99",
                 "faults/batch"), rows)


def main() -> None:
    """Run the bench as a script: `python -m kvtier.cli.bench.tiers --help`."""
    typer.run(tiers)


if __name__ == "__main__":
    main()
