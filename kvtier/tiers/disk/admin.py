"""Operations on a disk tier directory for the `kvtier cache` command.

They open the LMDB environment themselves and coordinate with running DiskTiers of other
processes through LMDB's locks. Do not call them on a directory that a DiskTier of *this*
process has open: LMDB forbids opening one environment twice in a process. A sharded
directory (`kvtier.tiers.disk.shards`) is handled shard by shard, and the answers added up;
`prune` keeps each shard within its share of the bytes (blocks spread evenly over shards).

The portable export file:

    b"KVTX", u16 EXPORT_VERSION, u32 n, n bytes of JSON {"disk_format", "record_version",
    "layouts": {fingerprint hex: describe()}}
    per block (oldest access first): u32 key length, u64 value length, key, value (a record)
    end: u32 0, u64 number of blocks, u64 xxh3_64 of every byte after the JSON and before it

Each value keeps its own header and payload checksums; the trailing checksum also covers the
keys and the framing, so a truncated or edited file is refused before anything is imported.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from kvtier.fsutil import PRIVATE_FILE_MODE, ensure_private_dir
from kvtier.layout import KVLayout
from kvtier.tiers.disk.index import DISK_FORMAT_VERSION, LmdbIndex, access_time
from kvtier.tiers.disk.recovery import move_aside
from kvtier.tiers.disk.shard_layout import (
    default_shards,
    existing_shards,
    shard_dirs,
    shard_of,
)
from kvtier.tiers.record import RECORD_VERSION, CorruptRecord, decode_header, decode_record

EXPORT_MAGIC = b"KVTX"
EXPORT_VERSION = 1

_FILE_HEADER = struct.Struct("<4sHI")
_FRAME = struct.Struct("<IQ")
_END = struct.Struct("<I")
_TRAILER = struct.Struct("<QQ")
_CHUNK_BYTES = 8 << 20
_IMPORT_TXN_BYTES = 64 << 20
_MAP_SLACK = 64 << 20


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` found. `bad` lists (block hash hex, reason) of damaged values;
    `index_errors` counts access-order entries and counters that did not add up;
    `files_problem` says why LMDB's files could not be opened or failed their structural
    check (nothing else was then checked), and `moved_to` where a repair moved them."""

    num_checked: int
    bad: tuple[tuple[str, str], ...]
    index_errors: int
    num_removed: int
    repaired: bool
    files_problem: str | None = None
    moved_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.bad and not self.index_errors and self.files_problem is None


def _open(path: str | os.PathLike[str], *, write: bool, extra_bytes: int = 0) -> LmdbIndex:
    root = ensure_private_dir(path, create=False)
    data_file = root / "data.mdb"
    if not os.path.lexists(data_file):
        raise FileNotFoundError(f"{root} holds no kvtier disk cache (no data.mdb)")
    data_bytes = os.lstat(data_file).st_size if data_file.is_file() else 0
    map_size = data_bytes + extra_bytes + (_MAP_SLACK if write else 0)
    return LmdbIndex.open(root, readonly=not write, durable=True, map_size=map_size,
                          mode=PRIVATE_FILE_MODE)


def _check_format(index: LmdbIndex, txn: lmdb.Transaction, path: object) -> None:
    version = index.format_version(txn)
    if version != DISK_FORMAT_VERSION:
        raise ValueError(f"{path} was written with disk format {version}; this build reads "
                         f"{DISK_FORMAT_VERSION}. Run `kvtier cache clear` or open it with "
                         "kvtier to start it afresh")


def _shard_roots(path: str | os.PathLike[str]) -> list[Path]:
    """The LMDB directories of the disk tier in `path` (one, or its shards'). Raises
    FileNotFoundError when it holds no cache, ValueError for mixed or incomplete shards,
    and the errors of `ensure_private_dir`."""
    root = ensure_private_dir(path, create=False)
    count = existing_shards(root)
    if count is None:
        raise FileNotFoundError(f"{root} holds no kvtier disk cache (no data.mdb)")
    return shard_dirs(root, count)


def _stored(roots: list[Path]) -> list[Path]:
    """Of `roots`, those with files: a shard without (moved aside by a repair, say) holds
    nothing, and the engine starts it empty."""
    return [root for root in roots if os.path.lexists(root / "data.mdb")]


def cache_stats(path: str | os.PathLike[str]) -> dict:
    """Blocks, bytes, budget and the layouts present (with counts) of a disk tier directory,
    and its number of shards.

    Raises FileNotFoundError when there is no cache, and the errors of `ensure_private_dir`.
    """
    roots = _shard_roots(path)
    parts = [_shard_stats(root) for root in _stored(roots)]
    layouts: dict[str, dict] = {}
    for part in parts:
        for entry in part["layouts"]:
            total = layouts.setdefault(entry["fingerprint"], {**entry, "num_blocks": 0,
                                                              "bytes": 0})
            total["num_blocks"] += entry["num_blocks"]
            total["bytes"] += entry["bytes"]
    budgets = [part["budget_bytes"] for part in parts if part["budget_bytes"] is not None]
    return {
        "path": str(Path(path).absolute()),
        "shards": len(roots),
        "format_version": parts[0]["format_version"] if parts else None,
        "num_blocks": sum(part["num_blocks"] for part in parts),
        "bytes_used": sum(part["bytes_used"] for part in parts),
        "budget_bytes": sum(budgets) if budgets else None,
        "file_bytes": sum(part["file_bytes"] for part in parts),
        "layouts": sorted(layouts.values(), key=lambda e: -e["num_blocks"]),
    }


def _shard_stats(path: Path) -> dict:
    index = _open(path, write=False)
    try:
        with index.env.begin(buffers=True) as txn:
            names = index.layout_names(txn)
            layouts: dict[str, dict] = {}
            for _, value in txn.cursor(db=index.blocks):
                try:
                    fingerprint = decode_header(value)[0].layout_fingerprint
                    key, name = fingerprint.hex(), names.get(fingerprint)
                except CorruptRecord as exc:
                    key, name = "unreadable", exc.reason
                entry = layouts.setdefault(key, {"fingerprint": key, "layout": name,
                                                 "num_blocks": 0, "bytes": 0})
                entry["num_blocks"] += 1
                entry["bytes"] += len(value)
            return {
                "path": str(Path(path).absolute()),
                "format_version": index.format_version(txn),
                "num_blocks": index.num_blocks(txn),
                "bytes_used": index.counter(txn, "bytes_used"),
                "budget_bytes": index.counter(txn, "budget_bytes") or None,
                "file_bytes": (Path(path) / "data.mdb").stat().st_size,
                "layouts": sorted(layouts.values(), key=lambda e: -e["num_blocks"]),
            }
    finally:
        index.env.close()


def inspect(path: str | os.PathLike[str], limit: int = 20) -> list[dict]:
    """The `limit` most recently used blocks, newest first: hash, layout, token count,
    record bytes, last access sequence number and its time (seconds since the epoch; None
    for blocks last used before sequence numbers were times) (headers only; see `verify`
    for payloads).
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows = [row for root in _stored(_shard_roots(path)) for row in _shard_inspect(root, limit)]
    return sorted(rows, key=lambda row: -row["last_access"])[:limit]


def _shard_inspect(path: Path, limit: int) -> list[dict]:
    index = _open(path, write=False)
    try:
        with index.env.begin(buffers=True) as txn:
            names = index.layout_names(txn)
            rows = []
            for seq, block_hash in index.lru_order(txn, newest_first=True):
                if len(rows) >= limit:
                    break
                value = index.get(txn, block_hash)
                row = {"hash": block_hash.hex(), "last_access": seq,
                       "last_access_time": access_time(seq), "layout": None,
                       "num_tokens": None, "bytes": None if value is None else len(value),
                       "status": "missing" if value is None else "ok"}
                if value is not None:
                    try:
                        header, _ = decode_header(value)
                        row["layout"] = names.get(header.layout_fingerprint,
                                                  header.layout_fingerprint.hex())
                        row["num_tokens"] = header.num_tokens
                    except CorruptRecord as exc:
                        row["status"] = exc.reason
                rows.append(row)
            return rows
    finally:
        index.env.close()


def verify(path: str | os.PathLike[str], repair: bool = False) -> VerifyReport:
    """Check every value's header and payload checksum and the access-order index.

    With `repair`, damaged values are deleted, index entries rebuilt and the byte counter
    recomputed (in one write transaction, re-checking each value first, so a value replaced
    meanwhile by a running tier is kept). LMDB's files are checked first
    (`kvtier.tiers.disk.check`); when they cannot be opened or fail that check, the report
    says why and, with `repair`, they are moved aside as the engine would
    (`kvtier.tiers.disk.recovery.move_aside`; nothing is deleted). Raises like
    `cache_stats` otherwise (no cache there, an unsafe directory).
    """
    every = _shard_roots(path)
    count = len(every)  # before a repair empties any
    roots = _stored(every)
    reports = [_shard_verify(root, repair) for root in roots]
    if count == 1:
        return reports[0]
    problems = [f"{root.name}: {r.files_problem}" for root, r in zip(roots, reports)
                if r.files_problem is not None]
    moved = [r.moved_to for r in reports if r.moved_to is not None]
    return VerifyReport(sum(r.num_checked for r in reports),
                        tuple(item for r in reports for item in r.bad),
                        sum(r.index_errors for r in reports),
                        sum(r.num_removed for r in reports), repair,
                        files_problem="; ".join(problems) or None,
                        moved_to=", ".join(moved) or None)


def _shard_verify(root: Path, repair: bool) -> VerifyReport:
    try:
        index = _open(root, write=repair)
    except (OSError, lmdb.Error) as exc:
        moved_to = str(move_aside(root)) if repair else None
        return VerifyReport(0, (), 0, 0, repair, files_problem=str(exc), moved_to=moved_to)
    try:
        with index.env.begin(buffers=True) as txn:
            bad = []
            num_checked = total_bytes = 0
            for key, value in txn.cursor(db=index.blocks):
                num_checked += 1
                total_bytes += len(value)
                try:
                    decode_record(value)
                except CorruptRecord as exc:
                    bad.append((bytes(key).hex(), exc.reason))
            index_errors = _count_index_errors(index, txn, total_bytes)
        num_removed = 0
        if repair and (bad or index_errors):
            with index.env.begin(write=True, buffers=True) as txn:
                for key_hex, _ in bad:
                    value = index.get(txn, bytes.fromhex(key_hex))
                    if value is not None and not _is_record(value):
                        num_removed += index.remove(txn, bytes.fromhex(key_hex))
                _rebuild_index(index, txn)
        return VerifyReport(num_checked, tuple(bad), index_errors, num_removed, repair)
    finally:
        index.env.close()


def _is_record(value) -> bool:
    try:
        decode_record(value)
    except CorruptRecord:
        return False
    return True


def _count_index_errors(index: LmdbIndex, txn: lmdb.Transaction, total_bytes: int) -> int:
    errors = int(index.counter(txn, "bytes_used") != total_bytes)
    for seq, block_hash in index.lru_order(txn):
        errors += index.access_seq(txn, block_hash) != seq or not index.has(txn, block_hash)
    errors += abs(txn.stat(index.access)["entries"] - index.num_blocks(txn))
    return errors


def _rebuild_index(index: LmdbIndex, txn: lmdb.Transaction) -> None:
    """Make access/lru/bytes_used agree with `blocks`, keeping the existing order."""
    order = [h for seq, h in index.lru_order(txn)
             if index.has(txn, h) and index.access_seq(txn, h) == seq]
    ordered = set(order)
    unordered = [bytes(k) for k in txn.cursor(db=index.blocks).iternext(values=False)
                 if bytes(k) not in ordered]
    total = sum(len(v) for _, v in txn.cursor(db=index.blocks))
    txn.drop(index.access, delete=False)
    txn.drop(index.lru, delete=False)
    index.touch(txn, unordered + order)  # blocks the order had lost count as oldest
    index.set_counter(txn, "bytes_used", total)


def prune(path: str | os.PathLike[str], max_bytes: int) -> int:
    """Evict least-recently-used blocks until at most `max_bytes` of records remain;
    how many were removed. Raises ValueError for a negative `max_bytes`."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    roots = _shard_roots(path)
    share = max_bytes // len(roots)
    return sum(_shard_prune(root, share) for root in _stored(roots))


def _shard_prune(path: Path, max_bytes: int) -> int:
    index = _open(path, write=True)
    try:
        with index.env.begin(write=True, buffers=True) as txn:
            over = index.counter(txn, "bytes_used") - max_bytes
            return index.evict(txn, over)[0] if over > 0 else 0
    finally:
        index.env.close()


def clear(path: str | os.PathLike[str]) -> int:
    """Delete every block (whatever its format); how many there were."""
    return sum(_shard_clear(root) for root in _stored(_shard_roots(path)))


def _shard_clear(path: Path) -> int:
    index = _open(path, write=True)
    try:
        with index.env.begin(write=True, buffers=True) as txn:
            num_blocks = index.num_blocks(txn)
            index.reset(txn)
            index.set_format_version(txn, DISK_FORMAT_VERSION)
            return num_blocks
    finally:
        index.env.close()


# ---- export / import ---------------------------------------------------------------------


def export_cache(path: str | os.PathLike[str], file: str | os.PathLike[str]) -> int:
    """Write every block to `file` (mode 0o600, replaced atomically); how many were written.

    Raises like `cache_stats`, ValueError for a directory of another disk format, and
    OSError when the file cannot be written.
    """
    return _export(path, Path(file))


def _export(path: str | os.PathLike[str], file: Path) -> int:
    partial = file.with_name(file.name + ".partial")
    with contextlib.ExitStack() as stack:
        indexes = []
        for root in _stored(_shard_roots(path)):
            indexes.append(_open(root, write=False))
            stack.callback(indexes[-1].env.close)
        txns = [stack.enter_context(index.env.begin(buffers=True)) for index in indexes]
        try:
            layouts: dict[str, str] = {}
            for index, txn in zip(indexes, txns):
                _check_format(index, txn, path)
                layouts.update((fp.hex(), name) for fp, name in index.layout_names(txn).items())
            meta = {"disk_format": DISK_FORMAT_VERSION, "record_version": RECORD_VERSION,
                    "layouts": layouts}
            meta_bytes = json.dumps(meta, sort_keys=True).encode()
            hasher = xxhash.xxh3_64()
            num_blocks = 0
            # Oldest access first over every shard (access sequence numbers are times).
            order = heapq.merge(*[_tagged(index.lru_order(txn), k)
                                  for k, (index, txn) in enumerate(zip(indexes, txns))])
            with open(partial, "wb", opener=_private_opener) as out:
                out.write(_FILE_HEADER.pack(EXPORT_MAGIC, EXPORT_VERSION, len(meta_bytes))
                          + meta_bytes)
                chunk = bytearray()
                for _, k, block_hash in order:
                    value = indexes[k].get(txns[k], block_hash)
                    if value is None:
                        continue
                    frame = _FRAME.pack(len(block_hash), len(value)) + block_hash
                    chunk += frame
                    chunk += value
                    hasher.update(frame)
                    hasher.update(value)
                    num_blocks += 1
                    if len(chunk) >= _CHUNK_BYTES:
                        out.write(chunk)
                        chunk.clear()
                trailer = _END.pack(0) + _TRAILER.pack(num_blocks, hasher.intdigest())
                out.write(chunk + trailer)
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, file)
            return num_blocks
        except BaseException:
            partial.unlink(missing_ok=True)
            raise


def _tagged(order: Iterator[tuple[int, bytes]], shard: int) -> Iterator[tuple[int, int, bytes]]:
    """(access sequence, shard, block hash) of one shard's access order."""
    for seq, block_hash in order:
        yield seq, shard, block_hash


def _private_opener(name: str, flags: int) -> int:
    return os.open(name, flags, PRIVATE_FILE_MODE)


def import_cache(path: str | os.PathLike[str], file: str | os.PathLike[str],
                 layout: KVLayout | None = None, shards: int | None = None) -> int:
    """Add the blocks of an export file to the tier in `path` (created if missing, with
    `shards` shards, by default `default_shards` of the file's size; an existing tier keeps
    its own); how many were new. Blocks already
    present are kept. The whole file is verified first.

    Raises ValueError (nothing imported) for a file of an unknown format version, a file
    with blocks of another layout than `layout` (when given), or a damaged or truncated file.
    """
    file = Path(file)
    return _import(path, file, layout,
                   shards if shards is not None else default_shards(file.stat().st_size))


def _import(path: str | os.PathLike[str], file: Path, layout: KVLayout | None,
            shards: int) -> int:
    for _ in _read_export(file, layout):  # pass 1: verify everything
        pass
    root = ensure_private_dir(path)
    roots = shard_dirs(root, existing_shards(root) or shards)
    with contextlib.ExitStack() as stack:
        indexes = []
        for shard_root in roots:
            ensure_private_dir(shard_root)
            if not (shard_root / "data.mdb").exists():
                LmdbIndex.open(shard_root, readonly=False, durable=True, map_size=_MAP_SLACK,
                               mode=PRIVATE_FILE_MODE).env.close()
            index = _open(shard_root, write=True,
                          extra_bytes=file.stat().st_size * 5 // 4 // len(roots))
            stack.callback(index.env.close)
            with index.env.begin(write=True) as txn:
                if index.format_version(txn) is None and not index.num_blocks(txn):
                    index.set_format_version(txn, DISK_FORMAT_VERSION)
                _check_format(index, txn, shard_root)
            indexes.append(index)
        # The file's order (oldest first) becomes the access order, one sequence over all
        # shards: from past every shard's counter and the clock.
        next_seq = max([time.time_ns() // 1000]
                       + [_next_seq(index) for index in indexes])
        num_new = 0
        batches: list[list[tuple[bytes, bytes, dict[str, str], int]]] = [[] for _ in roots]
        batch_bytes = [0] * len(roots)
        for position, (key, value, names) in enumerate(_read_export(file, layout)):  # pass 2
            k = shard_of(key, len(roots))
            batches[k].append((key, value, names, next_seq + position))
            batch_bytes[k] += len(value)
            if batch_bytes[k] >= _IMPORT_TXN_BYTES:
                num_new += _insert(indexes[k], batches[k])
                batches[k], batch_bytes[k] = [], 0
        return num_new + sum(_insert(index, batch) for index, batch in zip(indexes, batches))


def _next_seq(index: LmdbIndex) -> int:
    with index.env.begin() as txn:
        return index.counter(txn, "next_seq")


def _insert(index: LmdbIndex, items: list[tuple[bytes, bytes, dict[str, str], int]]) -> int:
    """Insert (key, record, layout names, access sequence) items in one transaction; how
    many were new."""
    with index.env.begin(write=True) as txn:
        for fingerprint_hex, name in (items[0][2].items() if items else ()):
            index.set_layout_name(txn, bytes.fromhex(fingerprint_hex), name)
        return sum(index.insert_many(txn, [(key, value) for key, value, _, _ in items],
                                     seqs=[seq for _, _, _, seq in items]))


def _read_export(file: Path, layout: KVLayout | None
                 ) -> Iterator[tuple[bytes, bytes, dict[str, str]]]:
    """Yield (key, record, layout names) of a verified export file; ValueError on damage
    or, when `layout` is given, on a block of another layout."""
    expected_fingerprint = None if layout is None else layout.fingerprint()
    with open(file, "rb") as source:
        reader = _ChunkReader(source, file)
        magic, version, meta_len = _FILE_HEADER.unpack(reader.read(_FILE_HEADER.size))
        if magic != EXPORT_MAGIC:
            raise ValueError(f"{file} is not a kvtier cache export (magic {magic!r})")
        if version != EXPORT_VERSION:
            raise ValueError(f"{file} has export format version {version}; this build reads "
                             f"version {EXPORT_VERSION}. Export it again with this build")
        meta = json.loads(reader.read(meta_len))
        names: dict[str, str] = meta.get("layouts", {})
        hasher, num_blocks = xxhash.xxh3_64(), 0
        while True:
            (key_len,) = _END.unpack(reader.read(_END.size))
            if key_len == 0:
                break
            (value_len,) = struct.unpack("<Q", reader.read(8))
            key, value = reader.read(key_len), reader.read(value_len)
            hasher.update(_FRAME.pack(key_len, value_len) + key)
            hasher.update(value)
            num_blocks += 1
            try:
                fingerprint = decode_record(value)[0].layout_fingerprint
            except CorruptRecord as exc:
                raise ValueError(f"{file}: block {num_blocks} ({key.hex()}) is damaged "
                                 f"({exc}); nothing was imported") from exc
            if expected_fingerprint is not None and fingerprint != expected_fingerprint:
                raise ValueError(f"{file} holds blocks of layout "
                                 f"{names.get(fingerprint.hex(), fingerprint.hex())}, not "
                                 f"{layout.describe()}; import it for that model's layout or "
                                 "without one; nothing was imported")
            yield key, value, names
        stored_count, stored_checksum = _TRAILER.unpack(reader.read(_TRAILER.size))
        if (stored_count, stored_checksum) != (num_blocks, hasher.intdigest()):
            raise ValueError(f"{file} fails its trailing checksum (edited or damaged); "
                             "nothing was imported")
        if reader.read_rest():
            raise ValueError(f"{file} has bytes after its end marker; nothing was imported")


class _ChunkReader:
    """Exact-size reads over a binary file, one read call per 8 MiB."""

    def __init__(self, source, file: Path) -> None:
        self._source, self._file = source, file
        self._buffer, self._pos = b"", 0

    def read(self, size: int) -> bytes:
        while len(self._buffer) - self._pos < size:
            more = self._source.read(max(_CHUNK_BYTES, size))
            if not more:
                raise ValueError(f"{self._file} is truncated; nothing was imported")
            self._buffer = self._buffer[self._pos:] + more
            self._pos = 0
        out = self._buffer[self._pos:self._pos + size]
        self._pos += size
        return out

    def read_rest(self) -> bytes:
        return self._buffer[self._pos:] + self._source.read()
