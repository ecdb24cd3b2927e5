"""Reading disk-tier records into the caller's buffers, checked.

A record is found from its key's leaf node (`kvtier.tiers.disk.lmdb_value.find_value`), or where
the tier's in-memory copy last saw it (`kvtier.tiers.disk.keys`: no tree page read, which
after a dropped page cache is a disk read made holding the GIL), and read from `data.mdb`
at its overflow page: the header into a small buffer, the payload straight
into the destination, with one `preadv` for each run of records that lie one after the
other. A value too short for overflow pages, or a read that does not land where the tree
says, is read through LMDB instead. Either way the header must name this layout and block,
the payload length must match, and the xxh3 checksum is taken over the bytes in the
destination, the ones the caller will use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb
import numpy as np

from kvtier.tiers.disk.index import LmdbIndex
from kvtier.tiers.disk.lmdb_value import ValueSpot, find_value, pread_values
from kvtier.tiers.record import (
    BlockMeta,
    CorruptRecord,
    check_payload_len,
    copy_checksummed,
    decode_header,
    payload_checksum,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecordSource:
    """Where records are read from: the tier's index, data.mdb open as `data_fd`, LMDB's
    page size, and the layout fingerprint every header must carry."""

    index: LmdbIndex
    data_fd: int
    page_size: int
    fingerprint: bytes


def read_records_into(source: RecordSource, txn: lmdb.Transaction, cursor: lmdb.Cursor,
                      metas: Sequence[BlockMeta], arrays: Sequence[np.ndarray],
                      hints: Sequence[ValueSpot | None] | None = None
                      ) -> list[tuple[bool, bool]]:
    """Copy the payload of each `metas[i]`'s record into `arrays[i]` (uint8, the block's
    bytes) inside the read transaction `txn` (buffers=True) whose `cursor` is on the blocks
    database. Records lying one after the other in data.mdb are read with one preadv
    (`lmdb_value.pread_values`). `hints[i]`, where given, is where the record lay when last
    seen: it is read there without a tree lookup, and looked up afresh if what lies there
    is not it (a hint may be stale: the page checks and the record's own checks catch
    that, and a stale hint never marks a value for deletion). Per block: (whether it is a
    verified hit, whether the value failed a check and should be deleted); on (False, _)
    the contents of its array are unspecified."""
    hints = hints if hints is not None else [None] * len(metas)
    results = _read(source, txn, cursor, metas, arrays, hints)
    again = [i for i, (hint, (ok, _)) in enumerate(zip(hints, results))
             if hint is not None and not ok]
    if again:
        retried = _read(source, txn, cursor, [metas[i] for i in again],
                        [arrays[i] for i in again], [None] * len(again))
        for i, result in zip(again, retried):
            results[i] = result
    return results


def _read(source: RecordSource, txn: lmdb.Transaction, cursor: lmdb.Cursor,
          metas: Sequence[BlockMeta], arrays: Sequence[np.ndarray],
          hints: Sequence[ValueSpot | None]) -> list[tuple[bool, bool]]:
    spots: list[ValueSpot | None] = []
    for meta, array, hint in zip(metas, arrays, hints):
        try:
            spot = hint if hint is not None else find_value(cursor, meta.block_hash)
        except ValueError:  # not LMDB's node layout: read through LMDB
            spot = None
        # A value in its leaf page, or one too short for the payload, goes through LMDB.
        spots.append(spot if spot is not None and spot.page is not None
                     and spot.size > array.nbytes else None)
    direct = [i for i, spot in enumerate(spots) if spot is not None]
    heads = {i: bytearray(spots[i].size - arrays[i].nbytes) for i in direct}
    landed = pread_values(source.data_fd, [spots[i] for i in direct], source.page_size,
                          [[memoryview(heads[i]), memoryview(arrays[i]).cast("B")]
                           for i in direct])
    read = {i for i, ok in zip(direct, landed) if ok}
    results = []
    for i, (meta, array, hint) in enumerate(zip(metas, arrays, hints)):
        if hint is not None:  # looked up afresh by the caller unless it checks out here
            results.append((i in read and _verify(source, meta, array, bytes(heads[i]),
                                                  spots[i].size, quiet=True)[0], False))
            continue
        if i in read:
            results.append(_verify(source, meta, array, bytes(heads[i]), spots[i].size))
            continue
        value = source.index.get(txn, meta.block_hash)  # not stored, or read it through LMDB
        results.append((False, False) if value is None
                       else _verify(source, meta, array, value, len(value), copy=True))
    return results


def _verify(source: RecordSource, meta: BlockMeta, array: np.ndarray, record_head,
            size: int, copy: bool = False, quiet: bool = False) -> tuple[bool, bool]:
    """Check a record of `size` bytes whose start is `record_head`: with `copy`, the whole
    record, whose payload is copied into `array`; else its header alone, its payload already
    in `array`. Returns (verified hit, should be deleted); `quiet`: a failure is not
    logged (a stale hint's)."""
    try:
        header, offset = decode_header(record_head, source.fingerprint)
        # Without `copy`, this also pins the payload to start right after the header.
        check_payload_len(header, size - offset, array.nbytes)
        if not header.matches(meta):
            raise CorruptRecord("wrong block", "stored parent hash or token ids differ")
        checksum = (copy_checksummed(record_head[offset:], array) if copy
                    else payload_checksum(array))
        if checksum != header.payload_checksum:
            raise CorruptRecord("bad checksum")
    except CorruptRecord as exc:
        if not quiet:
            logger.info("disk cache: rejecting %s (%s)", meta.block_hash.hex(), exc)
        return False, True
    return True, False
