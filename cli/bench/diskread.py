"""Cold reads from disk: what the disk gives, and what the disk tier gets out of it.

  * `drop_page_cache()`: `sync` and `echo 3 > /proc/sys/vm/drop_caches` (needs root).
  * `resident_fraction(path)`: the share of a file's pages in the page cache (mincore),
    which says whether a drop left it cold; `tier_resident_fraction(root)` the same over a
    disk tier's data files (one per shard).
  * `stored_spans(root, layout, documents)`: which of each document's blocks a disk tier
    holds, and how many of them end the document back to back (what a load front reads);
    `forget_blocks` deletes blocks from a tier, `read_into_page_cache` warms its files.
  * `raw_sequential_read(directory, num_bytes)`: a file of that size written in `directory`
    (same disk as the tier), read back sequentially in 8 MiB requests, cold: buffered, with
    O_DIRECT, and buffered by several threads at once. The best of them is the bar.
  * `disk_tier_read(path, layout)`: blocks of a disk tier read through
    `DiskTier.get_many_into` in groups of `group_blocks`, by `threads` threads, cold: every
    block in key order (scattered over the file), or one document's from its tail backward
    (as a restore reads them).
  * `read_methods(path, layout)`: ways of reading the tier's values cold (through LMDB's
    map, the map after madvise(WILLNEED), pread at the value's offset with 1..N threads,
    O_DIRECT on the pages holding it), which chose the disk tier's read path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.tiers.disk.check import DATA_FILE
from kvtier.tiers.disk.lmdb_value import OVERFLOW_HEADER_BYTES, ValueSpot, find_value
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import existing_shards, shard_dirs, shard_of
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, decode_header, payload_checksum

_CHUNK = 8 << 20
_ALIGN = 4096
#: Bytes read for a record's header: more than any header (hashes and a block's tokens).
_HEADER_READ = 64 << 10


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache; False where not permitted (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as control:
            control.write("3\n")
    except OSError:
        return False
    return True


def resident_fraction(path: Path) -> float | None:
    """The share of `path`'s pages in the page cache (mincore over a private map of it);
    None where it cannot be asked (no file, an empty one, no mincore)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        with open(path, "rb") as handle:
            # A copy-on-write map is writable, so ctypes can take its address; it is never
            # written, so its pages are the file's cached pages.
            mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
        num_pages = -(-size // page)
        flags = (ctypes.c_ubyte * num_pages)()
        start = ctypes.c_char.from_buffer(mapped)  # an export of the map, released below
        try:
            failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(start)),
                                  ctypes.c_size_t(size), flags) != 0
        finally:
            del start
            mapped.close()
        if failed:
            return None
        resident = int(np.count_nonzero(np.frombuffer(flags, dtype=np.uint8) & 1))
    except (OSError, AttributeError, ValueError, BufferError):
        return None
    return resident / num_pages


def tier_resident_fraction(root: Path) -> float | None:
    """`resident_fraction` over the data files of the disk tier in `root` (one, or one per
    shard), weighted by their sizes; None where none can be asked."""
    try:
        count = existing_shards(root)
    except ValueError:
        return None
    parts = [(resident_fraction(shard / DATA_FILE), shard / DATA_FILE)
             for shard in shard_dirs(root, count or 1)]
    sized = [(share, path.stat().st_size) for share, path in parts if share is not None]
    total = sum(size for _, size in sized)
    return sum(share * size for share, size in sized) / total if total else None


def _gb_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / max(seconds, 1e-9) / 1e9


def _read_file(path: Path, direct: bool, threads: int = 1) -> float:
    """Seconds to read `path` sequentially in 8 MiB requests (split in `threads` spans)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    size = path.stat().st_size
    span = -(-size // threads // _CHUNK) * _CHUNK

    def read_span(start: int) -> None:
        fd = os.open(path, flags)
        buffer = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
        try:
            offset = start
            while offset < min(start + span, size):
                if os.preadv(fd, [buffer], offset) <= 0:
                    break
                offset += _CHUNK
        finally:
            buffer.close()
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_span, range(0, size, span)))
    return time.perf_counter() - started


def write_raw_file(path: Path, num_bytes: int, sync_every: int | None = None,
                   ) -> tuple[int, float]:
    """Write `num_bytes` (rounded to whole `_CHUNK`s, at least one) of seeded random bytes to
    `path` sequentially, in `_CHUNK` calls; with `sync_every`, `fdatasync` every that many
    bytes and at the end. Returns (bytes written, seconds the writes and syncs took)."""
    num_bytes = max(_CHUNK, num_bytes // _CHUNK * _CHUNK)
    chunk = np.random.default_rng(0).integers(0, 255, _CHUNK, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        unsynced = 0
        for _ in range(num_bytes // _CHUNK):
            os.write(fd, chunk)
            unsynced += _CHUNK
            if sync_every is not None and unsynced >= sync_every:
                os.fdatasync(fd)
                unsynced = 0
        if sync_every is not None:
            os.fdatasync(fd)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return num_bytes, seconds


def raw_sequential_read(directory: str | os.PathLike[str], num_bytes: int,
                        threads: int = 4, drop: bool = True) -> dict[str, Any]:
    """Cold sequential read bandwidth (GB/s) of a `num_bytes` file written in `directory`:
    buffered, O_DIRECT, and buffered by `threads` threads; `cold` says whether the page
    cache could be dropped first (never tried without `drop`). The file is removed
    afterwards."""
    path = Path(directory) / "kvtier-raw-read.bin"
    num_bytes, _ = write_raw_file(path, num_bytes)
    result: dict[str, Any] = {"bytes": num_bytes, "cold": drop}
    try:
        for name, direct, num_threads in (("buffered", False, 1), ("direct", True, 1),
                                          (f"buffered_{threads}_threads", False, threads)):
            if drop:
                result["cold"] &= drop_page_cache()
            try:
                result[f"{name}_gb_s"] = _gb_s(num_bytes, _read_file(path, direct, num_threads))
            except OSError as exc:  # O_DIRECT is refused by some file systems (tmpfs)
                result[f"{name}_gb_s"] = None
                result[f"{name}_error"] = str(exc)
    finally:
        path.unlink()
    result["best_gb_s"] = max(v for k, v in result.items()
                              if k.endswith("_gb_s") and v is not None)
    return result


def _value_spots(disk: DiskTier) -> list[tuple[bytes, ValueSpot]]:
    """(key, where its value is) of every block stored in `disk`, found from the index
    alone (`find_value`): no value is read."""
    with disk._map.txn() as txn, txn.cursor(db=disk._index.blocks) as cursor:  # noqa: SLF001
        keys = [bytes(key) for key in cursor.iternext(values=False)]
        spots = [(key, find_value(cursor, key)) for key in keys]
    return [(key, spot) for key, spot in spots if spot is not None]


def tier_metas(disk: DiskTier) -> list[BlockMeta]:
    """The `BlockMeta` of every block stored in `disk`, from the records' headers.

    Each header is read with one small pread at the value's offset: walking the values
    through the map would read every stored block, page fault by page fault."""
    page_size = disk._index.env.stat()["psize"]  # noqa: SLF001 (a benchmark reads the tier)
    fd = os.open(disk.path / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
    metas = []
    try:
        for key, spot in _value_spots(disk):
            if spot.page is None:
                with disk._map.txn() as txn:  # noqa: SLF001
                    head = bytes(txn.get(key, db=disk._index.blocks))  # noqa: SLF001
            else:
                head = os.pread(fd, min(spot.size, _HEADER_READ),
                                spot.file_offset(page_size) + OVERFLOW_HEADER_BYTES)
            header, _ = decode_header(head)
            metas.append(BlockMeta(key, header.parent_hash, header.token_ids))
    finally:
        os.close(fd)
    return metas


def longest_chain(metas: Sequence[BlockMeta]) -> list[BlockMeta]:
    """The longest run of blocks each of whose parent is the one before (one document's
    blocks, in order), following the first child where chains branch."""
    by_hash = {meta.block_hash: meta for meta in metas}
    children: dict[bytes, BlockMeta] = {}
    for meta in metas:
        children.setdefault(meta.parent_hash, meta)
    best: list[BlockMeta] = []
    for meta in metas:
        if meta.parent_hash in by_hash:
            continue  # not the start of a chain
        chain = [meta]
        # (Bounded: a damaged tier could hold a cycle.)
        while (child := children.get(chain[-1].block_hash)) is not None \
                and len(chain) <= len(by_hash):
            chain.append(child)
        if len(chain) > len(best):
            best = chain
    return best


def disk_tier_read(path: str | os.PathLike[str], layout: KVLayout, threads: int = 4,
                   group_blocks: int = 4, pin_memory: bool = False,
                   max_blocks: int | None = None, order: str = "key",
                   resident: bool = True, drop: bool = True) -> dict[str, Any]:
    """Read blocks of the disk tier at `path` cold through `DiskTier.get_many_into`,
    `group_blocks` per call, on `threads` threads; GB/s and how many blocks verified.

    The destination buffers are `resident` (written once before the clock starts), as the
    engine's host slab is; untouched, the timed read would also pay the kernel's zeroing of
    their first-touched pages (~12 ms for 64 MiB on a 2-core machine), a cost no restore
    pays.

    order "key": every block (at most `max_blocks`) in key order, so scattered over the
    file; "document": the longest chain of blocks (one document, at most its last
    `max_blocks`) in groups from the tail backward, as a restore's load front reads them."""
    if order not in ("key", "document"):
        raise ValueError(f"order must be 'key' or 'document', got {order!r}")
    with DiskTier(path, layout, 1 << 50, readonly=True) as disk:
        metas = tier_metas(disk)
    if order == "key":
        metas = metas[:max_blocks]
        groups = [metas[i:i + group_blocks] for i in range(0, len(metas), group_blocks)]
    else:
        metas = longest_chain(metas)
        metas = metas[len(metas) - min(len(metas), max_blocks or len(metas)):]
        groups = [metas[max(0, stop - group_blocks):stop]
                  for stop in range(len(metas), 0, -group_blocks)]
    # Opened again: the pages the headers were read through stay mapped, and a mapped page
    # survives a cache drop.
    with DiskTier(path, layout, 1 << 50, readonly=True) as disk:
        dests = [torch.empty(layout.bytes_per_block, dtype=torch.uint8,
                             pin_memory=pin_memory) for _ in range(threads * group_blocks)]
        if resident:
            for dest in dests:
                dest.zero_()
        slots = threading.local()
        counter = iter(range(threads))
        lock = threading.Lock()

        def read(group: Sequence[BlockMeta]) -> int:
            if not hasattr(slots, "index"):
                with lock:
                    slots.index = next(counter)
            mine = dests[slots.index * group_blocks:(slots.index + 1) * group_blocks]
            return sum(disk.get_many_into(group, mine[:len(group)]))

        cold = drop_page_cache() if drop else False
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            num_ok = sum(pool.map(read, groups))
        seconds = time.perf_counter() - started
    num_bytes = len(metas) * layout.bytes_per_block
    return {"blocks": len(metas), "verified": num_ok, "bytes": num_bytes, "cold": cold,
            "threads": threads, "group_blocks": group_blocks, "order": order,
            "resident": resident,
            "gb_s": _gb_s(num_bytes, seconds)}


def _value_spans(disk: DiskTier) -> list[tuple[int, int]]:
    """(file offset, length) of every value in the tier's data.mdb."""
    page_size = disk._index.env.stat()["psize"]  # noqa: SLF001
    return sorted((spot.file_offset(page_size) + OVERFLOW_HEADER_BYTES, spot.size)
                  for _, spot in _value_spots(disk) if spot.page is not None)


def read_methods(path: str | os.PathLike[str], layout: KVLayout,
                 thread_counts: Sequence[int] = (1, 4, 8)) -> dict[str, Any]:
    """Cold GB/s of reading every value of the disk tier at `path` (each checksummed) by:
    copying from a map of data.mdb (what LMDB's reads do), the same after
    madvise(WILLNEED) on the value's span, pread of the span with 1..N threads, and
    O_DIRECT pread of the pages holding it."""
    with DiskTier(path, layout, 1 << 50, readonly=True) as disk:
        spans = _value_spans(disk)
    data_file = Path(path) / "data.mdb"
    total = sum(length for _, length in spans)
    fd = os.open(data_file, os.O_RDONLY)
    results: dict[str, Any] = {"values": len(spans), "bytes": total}
    maps: list[mmap.mmap] = []  # a fresh map per method: mapped pages survive a cache drop

    def from_map(advise: bool) -> Callable[[tuple[int, int]], None]:
        def read(span: tuple[int, int]) -> None:
            mapped = maps[-1]
            offset, length = span
            if advise:
                start = offset // mmap.PAGESIZE * mmap.PAGESIZE
                mapped.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
            array = np.empty(length, dtype=np.uint8)
            np.copyto(array, np.frombuffer(mapped, dtype=np.uint8, count=length, offset=offset))
            payload_checksum(array)
        return read

    def by_pread(direct: bool) -> Callable[[tuple[int, int]], None]:
        local = threading.local()

        def read(span: tuple[int, int]) -> None:
            offset, length = span
            if direct:
                start = offset // _ALIGN * _ALIGN
                size = -(-(offset + length - start) // _ALIGN) * _ALIGN
                if getattr(local, "size", 0) < size:
                    local.buffer, local.size = mmap.mmap(-1, size), size
                    local.fd = os.open(data_file, os.O_RDONLY | os.O_DIRECT)
                os.preadv(local.fd, [memoryview(local.buffer)[:size]], start)
                payload_checksum(memoryview(local.buffer)[offset - start:offset - start + length])
                return
            array = np.empty(length, dtype=np.uint8)
            os.preadv(fd, [array], offset)
            payload_checksum(array)
        return read

    methods: list[tuple[str, Callable[[tuple[int, int]], None], int]] = [
        ("map_copy", from_map(False), 1), ("map_madvise_willneed", from_map(True), 1)]
    methods += [(f"pread_{n}_threads", by_pread(False), n) for n in thread_counts]
    methods += [(f"odirect_{n}_threads", by_pread(True), n) for n in thread_counts]
    try:
        for name, read, threads in methods:
            while maps:
                maps.pop().close()
            maps.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
            results["cold"] = drop_page_cache()
            started = time.perf_counter()
            try:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(read, spans))
                results[f"{name}_gb_s"] = _gb_s(total, time.perf_counter() - started)
            except OSError as exc:
                results[f"{name}_gb_s"] = None
                results[f"{name}_error"] = str(exc)
    finally:
        for mapped in maps:
            mapped.close()
        os.close(fd)
    return results


def write_chain(path: str | os.PathLike[str], layout: KVLayout, num_blocks: int) -> None:
    """A fresh disk tier at `path` holding one chain of `num_blocks` blocks (one random
    payload), stored in write transactions of 32 blocks, as write-backs store them."""
    payload = torch.randint(0, 255, (layout.bytes_per_block,), dtype=torch.uint8)
    with DiskTier(path, layout, num_blocks * (layout.bytes_per_block + 4096) + (64 << 20),
                  durable=False) as disk:
        for start in range(0, num_blocks, 32):
            metas = [BlockMeta(i.to_bytes(16, "big"), (i - 1).to_bytes(16, "big", signed=True),
                               tuple(range(16)))
                     for i in range(start, min(start + 32, num_blocks))]
            disk.put(metas, [payload] * len(metas))


def run_diskread_bench(directory: str | os.PathLike[str], gib: float,
                       thread_counts: Sequence[int],
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write `gib` GiB of random 2 MiB blocks (Llama-3-8B's 16-token block) to a fresh disk
    tier under `directory`, then time the read methods, the tier's read path and the raw
    sequential read, all cold where permitted. Raises ValueError for a size under 2 MiB."""
    import tempfile

    report = progress or (lambda message: None)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype=torch.bfloat16)
    num_blocks = int(gib * 2**30) // layout.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"--gib {gib} holds no {layout.bytes_per_block}-byte block")
    with tempfile.TemporaryDirectory(prefix="kvtier-diskread-", dir=directory) as scratch:
        path = Path(scratch) / "kv"
        report(f"writing {num_blocks} blocks")
        write_chain(path, layout, num_blocks)
        report("reading the values by each method")
        methods = read_methods(path, layout, thread_counts)
        report("reading through the disk tier")
        tier = {f"tier_{n}_threads_gb_s": disk_tier_read(path, layout, threads=n)["gb_s"]
                for n in thread_counts}
        report("raw sequential reads")
        raw = raw_sequential_read(scratch, num_blocks * layout.bytes_per_block,
                                  threads=max(thread_counts))
    return {"bench": "diskread", "methods": methods, "tier": tier, "raw": raw}


def stored_flags(root: Path, layout: KVLayout,
                 prompts: Sequence[Sequence[BlockHash]]) -> list[list[bool]]:
    """Per prompt (its block hashes, in order), whether the disk tier in `root` holds each
    block, asked read-only."""
    count = existing_shards(root) or 1
    # A shard without files (moved aside) holds nothing; the lookups may wait on a cold disk.
    tiers = [DiskTier(path, layout, 1 << 50, readonly=True, lookup_deadline_s=60.0)
             if (path / DATA_FILE).exists() else None for path in shard_dirs(root, count)]
    try:
        flags = []
        for hashes in prompts:
            held = [False] * len(hashes)
            for shard, tier in enumerate(tiers):
                if tier is None:
                    continue
                at = [i for i, h in enumerate(hashes) if shard_of(h, count) == shard]
                for i, hit in zip(at, tier.contains([hashes[i] for i in at])):
                    held[i] = hit
            flags.append(held)
        return flags
    finally:
        for tier in tiers:
            if tier is not None:
                tier.close()


def stored_span(held: Sequence[bool]) -> dict[str, int]:
    """Of a document's blocks (whether each is stored, in prompt order): how many there are,
    how many are stored, how many end the document back to back (`tail`: what a load front
    reads with nothing computed after it), and in how many runs they lie."""
    tail = next((i for i, h in enumerate(reversed(held)) if not h), len(held))
    runs = sum(1 for i, h in enumerate(held) if h and (i == 0 or not held[i - 1]))
    return {"blocks": len(held), "stored": sum(held), "tail": tail, "runs": runs}


def stored_spans(root: Path, layout: KVLayout,
                 documents: Sequence[Sequence[BlockHash]]) -> list[dict[str, int]]:
    """`stored_span` of each document (its block hashes) in the disk tier in `root`."""
    return [stored_span(held) for held in stored_flags(root, layout, documents)]


def forget_blocks(root: Path, layout: KVLayout, hashes: Sequence[BlockHash]) -> int:
    """Delete `hashes` from the disk tier in `root` (those it holds); returns how many."""
    tier, _ = open_disk_tier(root, layout, 1 << 50)
    if tier is None:
        raise RuntimeError(f"the disk tier in {root} could not be opened")
    with tier:
        return tier.delete(hashes)


def read_into_page_cache(root: Path) -> int:
    """Read every data file of the disk tier in `root` (one, or one per shard) through the
    page cache, so that its reads then come from memory; returns the bytes read."""
    total = 0
    for shard in shard_dirs(root, existing_shards(root) or 1):
        path = shard / DATA_FILE
        if not path.exists():
            continue
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(8 << 20):
                total += len(chunk)
    return total
