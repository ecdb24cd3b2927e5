"""Where LMDB keeps a value, found without reading the value.

py-lmdb's `Transaction.get` and `Cursor.value` touch one byte of every page of the value
before they return (to take the page faults with the GIL released). For a 2 MiB KV record
that is a 2 MiB read through the memory map, page fault by page fault: a lookup that only
asks whether a block is stored reads the whole block, and a read that then `pread`s the
record reads it twice. `Cursor.set_key` positions on the key without touching the value, and
with buffers=True `Cursor.key` is a view of the key inside its leaf page, right after the
node header that says how long the value is and, for a long value, on which overflow page it
starts. `find_value` reads those 8 + 8 bytes and nothing else.

Layouts are liblmdb 0.9's on 64-bit builds, the ones `kvtier.tiers.lmdb_tree` checks on
every open: node header (size lo, size hi, flags, key size), then the key, then the value or,
with F_BIGDATA, the 8-byte number of its first overflow page; an overflow page holds a
16-byte page header, then the value.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

import lmdb
import numpy as np

from kvtier.tiers.lmdb_tree import F_BIGDATA, P_OVERFLOW

_NODE = struct.Struct("<HHHH")  # size lo, size hi, flags, key size
_PAGE_HEADER = struct.Struct("<QHHI")  # page number, pad, flags, overflow page count
_PGNO = struct.Struct("<Q")
#: Bytes before a value's first byte on its first overflow page.
OVERFLOW_HEADER_BYTES = 16


@dataclass(frozen=True, slots=True)
class ValueSpot:
    """A stored value's length and, when it lives on overflow pages, the first of them
    (`page` None: the value sits in its leaf page; read it with `Transaction.get`)."""

    size: int
    page: int | None

    def file_offset(self, page_size: int) -> int:
        """Byte offset in data.mdb of the overflow page header that precedes the value."""
        assert self.page is not None, "an inline value has no overflow page"
        return self.page * page_size


def find_value(cursor: lmdb.Cursor, key: bytes) -> ValueSpot | None:
    """Position `cursor` (of a buffers=True transaction) on `key` and say where its value
    is; None when the key is not stored. Touches the tree's pages, never the value's.
    Raises ValueError if the node does not look like LMDB's (a transaction without
    buffers, or another LMDB build): callers then read the value the ordinary way."""
    if not cursor.set_key(key):
        return None
    found = cursor.key()
    if not isinstance(found, memoryview) or len(found) != len(key):
        raise ValueError("the cursor's key is not a view of its leaf page (buffers=False?)")
    address = np.frombuffer(found, dtype=np.uint8).ctypes.data
    lo, hi, flags, key_size = _NODE.unpack(ctypes.string_at(address - _NODE.size, _NODE.size))
    if key_size != len(key) or bytes(found) != key:
        raise ValueError("the node before the key does not describe it")
    size = lo | hi << 16
    if not flags & F_BIGDATA:
        return ValueSpot(size, None)
    (page,) = _PGNO.unpack(ctypes.string_at(address + key_size, _PGNO.size))
    return ValueSpot(size, page)


def pread_value(fd: int, spot: ValueSpot, page_size: int, buffers: list[memoryview]) -> bool:
    """Read the value `spot` names (on overflow pages) from data.mdb, open as `fd`, into
    `buffers` (together `spot.size` bytes), with preadv: the value's bytes go straight
    where the caller wants them, at the disk's speed, with the GIL released. False when the
    file ends first or the page there is not the start of the value's overflow pages; the
    caller then reads the value through LMDB. Only sound inside a read transaction that
    found `spot`: it keeps those pages from being reused until it ends."""
    assert spot.page is not None, "an inline value is read with Transaction.get"
    page_head = bytearray(OVERFLOW_HEADER_BYTES)
    return _preadv_full(fd, [memoryview(page_head), *buffers], spot.file_offset(page_size)) \
        and check_overflow_header(page_head, spot, page_size)


def _preadv_full(fd: int, buffers: list[memoryview], offset: int) -> bool:
    """Fill `buffers` from `fd` at `offset`, reading again after a short read; False at the
    end of the file."""
    while buffers:
        got = os.preadv(fd, buffers, offset)
        if got <= 0:
            return False
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and got:
            buffers = [buffers[0][got:], *buffers[1:]]
    return True


def check_overflow_header(raw: bytes | bytearray, spot: ValueSpot, page_size: int) -> bool:
    """Whether `raw`, the 16 bytes read at `spot.file_offset`, is the header of the run of
    overflow pages that `spot` names, long enough for the value."""
    page, _, flags, num_pages = _PAGE_HEADER.unpack(bytes(raw[:OVERFLOW_HEADER_BYTES]))
    needed = (OVERFLOW_HEADER_BYTES - 1 + spot.size) // page_size + 1
    return page == spot.page and flags & P_OVERFLOW and num_pages >= needed
