"""`kvtier bench roundtrip`: GPU -> host -> GPU through the tier manager, and disk -> GPU.

Blocks are Llama-3-8B-shaped by default (32 layers, 8 kv heads, head dim 128, 16 tokens,
bfloat16: 2 MiB each). Each repeat writes `total_mib` of freshly hashed blocks through the
manager (`cache_full_blocks`, then `flush`: GPU -> pinned host) and loads them back into
other GPU blocks (`prepare_load` + `complete_load`: host -> GPU). The same run measures the
ceiling: one contiguous pinned copy of the same bytes in each direction. Ratios are
manager bandwidth / ceiling bandwidth (1.0 = as fast as the bare copy).

The disk part closes a manager that wrote the blocks through to an LMDB directory, opens a
second manager with the host tier off on it, and restores every block disk -> staging slots
-> GPU. One warm-up restore fills the page cache first, so it measures the code path, not the
device. Figures are medians over `repeats`. On a CPU the "GPU" is a CPU tensor; use small
sizes there (a smoke run).

With `--remote-cache URL`, the same blocks are also restored from a Redis server or cluster
(remote -> host -> GPU) side by side with a plain redis-py pipeline of GETs of the same values
(`kvtier.cli.bench.remote_restore`).

    python -m kvtier.cli.bench.roundtrip [--total-mib 1024] [--repeats 5] [--json]
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer
from kvtier.cli.bench import tables
from kvtier.cli.common import print_json

from kvtier.config import DEFAULT_IO_THREADS, TierConfig
from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout, parse_dtype
from kvtier.manager import TierManager
from kvtier.tiers.record import BlockMeta

_MiB = 1 << 20
#: Staging slots of the host-off manager that restores from disk (blocks per disk wave).
_STAGING_SLOTS = 64
#: Room per block for the LMDB record header and page overhead in the disk budget.
_DISK_SLACK_PER_BLOCK = 64 * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, work: Callable[..., object], *args: object
           ) -> tuple[float, object]:
    """Seconds `work(*args)` takes from a synchronized start to a synchronized end, and
    what it returned."""
    _sync(device)
    start = time.perf_counter()
    value = work(*args)
    _sync(device)
    return time.perf_counter() - start, value


def _store(m: TierManager, blocks: list, metas: list[BlockMeta]) -> None:
    """Cache the blocks and wait until their write-through landed in the host tier."""
    m.cache_full_blocks(blocks, metas)
    m.flush()


def _load(m: TierManager, metas: list[BlockMeta], targets: list) -> int:
    return m.complete_load(m.prepare_load(metas, targets))


def _metas(layout: KVLayout, tag: int, num_blocks: int) -> list[BlockMeta]:
    """Distinct blocks for one repeat: every repeat stores new hashes."""
    parent = BlockHash(tag.to_bytes(16, "little"))
    metas = []
    for i in range(num_blocks):
        block_hash = BlockHash((tag << 32 | i + 1).to_bytes(16, "little"))
        token_ids = tuple(range(i, i + layout.block_size))
        metas.append(BlockMeta(block_hash, parent, token_ids))
        parent = block_hash
    return metas


def _ceiling(device: torch.device, num_bytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of one contiguous copy of `num_bytes`, each direction."""
    if device.type == "cuda":
        gpu = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    else:
        gpu = torch.empty(num_bytes, dtype=torch.uint8)
        host = torch.empty(num_bytes, dtype=torch.uint8)
    gpu.fill_(1)
    host.fill_(2)
    d2h = [_timed(device, host.copy_, gpu, True)[0] for _ in range(repeats)]
    h2d = [_timed(device, gpu.copy_, host, True)[0] for _ in range(repeats)]
    return {"d2h_s": statistics.median(d2h), "h2d_s": statistics.median(h2d)}


def _host_round_trips(layout: KVLayout, device: torch.device, num_blocks: int, repeats: int,
                      swap_method: str, seed: int) -> dict:
    config = TierConfig(num_gpu_blocks=2 * num_blocks,
                        host_capacity_bytes=num_blocks * layout.bytes_per_block,
                        swap_method=swap_method)
    m = TierManager(layout, config, device)
    try:
        generator = torch.Generator(device=device).manual_seed(seed)
        # [2 * num_blocks, *block_shape] of random values; the contents only feed the check.
        m.kv_cache.view(torch.uint8).random_(0, 256, generator=generator)
        store_s, load_s, verified = [], [], True
        for repeat in range(repeats):
            metas = _metas(layout, repeat + 1, num_blocks)
            blocks = m.allocate(num_blocks)
            assert blocks is not None
            store_s.append(_timed(device, _store, m, blocks, metas)[0])
            m.free(blocks)
            targets = m.allocate(num_blocks)
            assert targets is not None
            seconds, num_ok = _timed(device, _load, m, metas, targets)
            load_s.append(seconds)
            m.poll()  # reap the finished copies: their host slots take the next store
            src = torch.tensor([b.block_id for b in blocks], device=device)
            dst = torch.tensor([b.block_id for b in targets], device=device)
            verified &= num_ok == num_blocks and torch.equal(
                m.kv_cache.index_select(0, src).view(torch.uint8),
                m.kv_cache.index_select(0, dst).view(torch.uint8))
            m.free(targets)
    finally:
        m.close()
    return {"store_s": statistics.median(store_s), "load_s": statistics.median(load_s),
            "store_runs_s": store_s, "load_runs_s": load_s, "verified": bool(verified)}


def store_random_blocks(writer: TierManager, metas: list[BlockMeta], device: torch.device,
                        seed: int) -> torch.Tensor:
    """Fill `writer`'s whole GPU cache with seeded random bytes, cache one block per meta
    (write-through to its lower tiers) and free them; returns each meta's block bytes in
    meta order ([len(metas), *block_shape], a copy)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    writer.kv_cache.view(torch.uint8).random_(0, 256, generator=generator)
    blocks = writer.allocate(len(metas))
    assert blocks is not None
    order = torch.tensor([b.block_id for b in blocks], device=device)
    expected = writer.kv_cache.index_select(0, order)  # [len(metas), *block_shape]
    writer.cache_full_blocks(blocks, metas)
    writer.free(blocks)
    return expected


def _disk_restores(layout: KVLayout, device: torch.device, num_blocks: int, repeats: int,
                   swap_method: str, disk_dir: Path, seed: int, io_threads: int) -> dict:
    budget = num_blocks * (layout.bytes_per_block + _DISK_SLACK_PER_BLOCK)
    metas = _metas(layout, 1 << 20, num_blocks)
    writer = TierManager(layout, TierConfig(
        num_gpu_blocks=num_blocks, host_capacity_bytes=num_blocks * layout.bytes_per_block,
        disk_path=disk_dir, disk_budget_bytes=budget, swap_method=swap_method), device)
    try:
        expected = store_random_blocks(writer, metas, device, seed)
    finally:
        writer.close()  # writes every host block back to disk
    reader = TierManager(layout, TierConfig(
        num_gpu_blocks=num_blocks, disk_path=disk_dir, disk_budget_bytes=budget,
        swap_method=swap_method, staging_slots=min(_STAGING_SLOTS, num_blocks),
        io_threads=io_threads), device)
    try:
        restore_s, verified = [], True
        for run in range(repeats + 1):  # the first run only warms the page cache
            targets = reader.allocate(num_blocks)  # evicts the previous run's blocks
            assert targets is not None
            seconds, num_ok = _timed(device, _load, reader, metas, targets)
            if run:
                restore_s.append(seconds)
            got = reader.kv_cache.index_select(
                0, torch.tensor([t.block_id for t in targets], device=device))
            verified &= num_ok == num_blocks and torch.equal(
                got.view(torch.uint8), expected.view(torch.uint8))
            reader.free(targets)
    finally:
        reader.close()
    return {"restore_s": statistics.median(restore_s), "restore_runs_s": restore_s,
            "verified": bool(verified)}


def run_roundtrip_bench(total_mib: int = 1024, repeats: int = 5, num_layers: int = 32,
                        num_kv_heads: int = 8, head_dim: int = 128, block_size: int = 16,
                        dtype: str = "bfloat16", swap_method: str = "auto", disk: bool = True,
                        disk_dir: str | Path | None = None, device: str | None = None,
                        io_threads: int = DEFAULT_IO_THREADS, seed: int = 0,
                        remote_cache: str | None = None) -> dict:
    """Measure the manager's round trip and disk restore; returns a JSON-ready dict.

    `total_mib` of blocks move each way per repeat (rounded down to whole blocks); `device`
    defaults to CUDA when available. `disk_dir` (default: a temporary directory, removed
    afterwards) holds the LMDB files; `io_threads` read it during restores. Raises
    ValueError for sizes that hold no block or non-positive repeats.
    """
    if repeats <= 0:
        raise ValueError(f"--repeats must be positive, got {repeats}")
    layout = KVLayout(num_layers, num_kv_heads, head_dim, block_size, parse_dtype(dtype))
    num_blocks = total_mib * _MiB // layout.bytes_per_block
    if num_blocks <= 0:
        raise ValueError(f"--total-mib {total_mib} holds no block of {layout.bytes_per_block} "
                         "bytes; raise it or shrink the layout")
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    num_bytes = num_blocks * layout.bytes_per_block
    ceiling = _ceiling(resolved, num_bytes, repeats)
    host = _host_round_trips(layout, resolved, num_blocks, repeats, swap_method, seed)
    result = {
        "device": torch.cuda.get_device_name(resolved) if resolved.type == "cuda" else "cpu",
        "layout": layout.describe(), "block_bytes": layout.bytes_per_block,
        "num_blocks": num_blocks, "bytes_each_way": num_bytes, "repeats": repeats,
        "swap_method": swap_method,
        "ceiling": {"d2h_gbps": num_bytes / ceiling["d2h_s"] / 1e9,
                    "h2d_gbps": num_bytes / ceiling["h2d_s"] / 1e9, **ceiling},
        "manager": {
            "store_gbps": num_bytes / host["store_s"] / 1e9,
            "load_gbps": num_bytes / host["load_s"] / 1e9,
            "store_vs_ceiling": ceiling["d2h_s"] / host["store_s"],
            "load_vs_ceiling": ceiling["h2d_s"] / host["load_s"],
            "roundtrip_vs_ceiling": (ceiling["d2h_s"] + ceiling["h2d_s"])
            / (host["store_s"] + host["load_s"]),
            **host,
        },
        "disk": None,
        "remote": None,
    }
    if disk:
        own_dir = disk_dir is None
        path = Path(tempfile.mkdtemp(prefix="kvtier-roundtrip-")) if own_dir else Path(disk_dir)
        try:
            restored = _disk_restores(layout, resolved, num_blocks, repeats, swap_method,
                                      path / "lmdb", seed, io_threads)
        finally:
            if own_dir:
                shutil.rmtree(path, ignore_errors=True)
        result["disk"] = {"io_threads": io_threads,
                          "restore_gbps": num_bytes / restored["restore_s"] / 1e9,
                          "restore_vs_h2d_ceiling": ceiling["h2d_s"] / restored["restore_s"],
                          **restored}
    if remote_cache is not None:
        from kvtier.cli.bench.remote_restore import remote_restores
        remote = remote_restores(layout, resolved, _metas(layout, 1 << 21, num_blocks),
                                 remote_cache, repeats, swap_method, io_threads, seed)
        result["remote"] = {"restore_gbps": num_bytes / remote["restore_s"] / 1e9,
                            "plain_get_gbps": num_bytes / remote["plain_get_s"] / 1e9,
                            "vs_plain_get": remote["plain_get_s"] / remote["restore_s"],
                            **remote}
    return result


def roundtrip(
    total_mib: int = typer.Option(1024, help="MiB of blocks moved each way per repeat."),
    repeats: int = typer.Option(5, help="Timed runs; figures are medians."),
    swap_method: str = typer.Option("auto", help="GPU <-> host copies: auto, dma, staged or "
                                    "triton."),
    disk: bool = typer.Option(True, help="Also measure disk -> GPU restores."),
    disk_dir: str | None = typer.Option(None, help="Directory for the LMDB files "
                                        "(default: a temporary one)."),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda if present)."),
    io_threads: int = typer.Option(DEFAULT_IO_THREADS,
                                   help="I/O threads reading the disk during restores."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    remote_cache: str | None = typer.Option(
        None, "--remote-cache", help="Also restore remote -> GPU from this Redis URL, beside "
        "a plain redis-py pipeline of GETs of the same values."),
) -> None:
    """Tier-manager GPU -> host -> GPU round trip and disk restore vs the pinned-copy ceiling."""
    result = run_roundtrip_bench(total_mib=total_mib, repeats=repeats, swap_method=swap_method,
                                 disk=disk, disk_dir=disk_dir, device=device,
                                 io_threads=io_threads, remote_cache=remote_cache)
    if json_output:
        print_json(result)
        return
    tables.print_roundtrip(result)


def main() -> None:
    typer.run(roundtrip)


if __name__ == "__main__":
    main()
