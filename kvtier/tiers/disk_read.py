"""Reading one disk-tier record into the caller's buffer, checked.

The record is found from its key's leaf node (`kvtier.tiers.lmdb_value.find_value`) and read
from `data.mdb` with one `preadv` at its overflow page: the header into a small buffer, the
payload straight into the destination. A value too short for overflow pages, or a read that
does not land where the tree says, is read through LMDB instead. Either way the header must
name this layout and block, the payload length must match, and the xxh3 checksum is taken
over the bytes in the destination, the ones the caller will use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lmdb
import numpy as np

from kvtier.tiers.disk_index import LmdbIndex
from kvtier.tiers.lmdb_value import find_value, pread_value
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


def read_record_into(source: RecordSource, txn: lmdb.Transaction, cursor: lmdb.Cursor,
                     meta: BlockMeta, array: np.ndarray) -> tuple[bool, bool]:
    """Copy the payload of `meta`'s record into `array` (uint8, the block's bytes) inside the
    read transaction `txn` (buffers=True) whose `cursor` is on the blocks database.
    Returns (whether it is a verified hit, whether the value failed a check and should be
    deleted); on (False, _) the contents of `array` are unspecified."""
    head, size = _pread_record(source, cursor, meta, array)
    value = None
    if head is None:  # a short value in its leaf page, or the pread did not work out
        value = source.index.get(txn, meta.block_hash)
        if value is None:
            return False, False
        size = len(value)
    try:
        header, offset = decode_header(value if head is None else head, source.fingerprint)
        # With `head`, this also pins the payload to start right after it.
        check_payload_len(header, size - offset, array.nbytes)
        if not header.matches(meta):
            raise CorruptRecord("wrong block", "stored parent hash or token ids differ")
        checksum = (copy_checksummed(value[offset:], array) if value is not None
                    else payload_checksum(array))
        if checksum != header.payload_checksum:
            raise CorruptRecord("bad checksum")
    except CorruptRecord as exc:
        logger.info("disk cache: rejecting %s (%s)", meta.block_hash.hex(), exc)
        return False, True
    return True, False


def _pread_record(source: RecordSource, cursor: lmdb.Cursor, meta: BlockMeta,
                  array: np.ndarray) -> tuple[bytes | None, int]:
    """Read a stored record from data.mdb with one preadv at its overflow page: its header
    into the returned bytes, its payload (the last `array.nbytes` bytes) straight into
    `array`; also returns the record's length. (None, 0) when the block is not stored, its
    value sits in its leaf page, or the read comes short or lands elsewhere than the tree
    says (the caller reads through LMDB then). Nothing is read through the map but the
    tree's pages."""
    try:
        spot = find_value(cursor, meta.block_hash)
    except ValueError:
        return None, 0
    if spot is None or spot.page is None or spot.size <= array.nbytes:
        return None, 0
    head = bytearray(spot.size - array.nbytes)
    if not pread_value(source.data_fd, spot, source.page_size,
                       [memoryview(head), memoryview(array).cast("B")]):
        return None, 0
    return bytes(head), spot.size
