"""Where LMDB keeps a value, found without reading the value.

py-lmdb's `Transaction.get` and `Cursor.value` touch one byte of every page of the value
before they return (to take the page faults with the GIL released). For a 2 MiB KV record
that is a 2 MiB read through the memory map, page fault by page fault: a lookup that only
asks whether a block is stored reads the whole block, and a read that then `pread`s the
record reads it twice. `Cursor.set_key` positions on the key without touching the value, and
with buffers=True `Cursor.key` is a view of the key inside its leaf page, right after the
node header that says how long the value is and, for a long value, on which overflow page it
starts. `find_value` reads those 8 + 8 bytes and nothing else.

Layouts are liblmdb 0.9's on 64-bit builds, the ones `kvtier.tiers.disk.lmdb_tree` checks on
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

from kvtier.tiers.disk.lmdb_tree import F_BIGDATA, P_OVERFLOW

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


#: Bytes between two values that a grouped read reads (and drops) rather than issue a
#: second read: LMDB puts a few tree pages between the values of two write transactions.
MAX_GAP_BYTES = 64 << 10
#: Values per preadv at most (4 buffers each, well under the kernel's IOV_MAX of 1024).
MAX_RUN_VALUES = 64


def num_pages(spot: ValueSpot, page_size: int) -> int:
    """Overflow pages the value `spot` names takes (LMDB's OVPAGES)."""
    return (OVERFLOW_HEADER_BYTES - 1 + spot.size) // page_size + 1


def pread_values(fd: int, spots: list[ValueSpot], page_size: int,
                 buffers: list[list[memoryview]]) -> list[bool]:
    """Read the values `spots` name (on overflow pages) from data.mdb, open as `fd`:
    `buffers[i]` (together `spots[i].size` bytes) receives value i, straight where the
    caller wants it, with the GIL released. Values lying one after the other in the file (as
    the values of one write transaction do), at most `MAX_GAP_BYTES` apart, are read with
    one preadv: one system call, and one release of the GIL, for a run of them instead of
    one per value. Per value, whether it was read and the page there is the start of its
    overflow pages (False, e.g. where the file ended first: the caller reads that value
    through LMDB). Only sound inside a read transaction that found `spots`: it keeps those
    pages from being reused until it ends."""
    assert all(spot.page is not None for spot in spots), "inline values are read with get"
    order = sorted(range(len(spots)), key=lambda i: spots[i].page)
    results = [False] * len(spots)
    run: list[int] = []
    for index in order:
        if run and (len(run) == MAX_RUN_VALUES or not 0 <= _gap(spots[run[-1]], spots[index],
                                                               page_size) <= MAX_GAP_BYTES):
            _pread_run(fd, spots, page_size, buffers, run, results)
            run = []
        run.append(index)
    if run:
        _pread_run(fd, spots, page_size, buffers, run, results)
    return results


def _gap(first: ValueSpot, second: ValueSpot, page_size: int) -> int:
    """Bytes from the end of `first`'s value to the start of `second`'s overflow pages
    (negative when `second` does not lie after it)."""
    return second.file_offset(page_size) - (first.file_offset(page_size)
                                            + OVERFLOW_HEADER_BYTES + first.size)


def _pread_run(fd: int, spots: list[ValueSpot], page_size: int,
               buffers: list[list[memoryview]], run: list[int], results: list[bool]) -> None:
    """Read the values `run` (ascending in the file, gaps within bounds) with one preadv;
    set `results` for them."""
    gaps = [_gap(spots[a], spots[b], page_size) for a, b in zip(run, run[1:])] + [0]
    filler = memoryview(bytearray(max(gaps)))  # the gaps' bytes, dropped
    heads = [bytearray(OVERFLOW_HEADER_BYTES) for _ in run]
    vectors: list[memoryview] = []
    for head, index, gap in zip(heads, run, gaps):
        vectors += [memoryview(head), *buffers[index]]
        if gap:
            vectors.append(filler[:gap])
    if not _preadv_full(fd, vectors, spots[run[0]].file_offset(page_size)):
        return
    for head, index in zip(heads, run):
        results[index] = bool(check_overflow_header(head, spots[index], page_size))


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
    page, _, flags, num_stored = _PAGE_HEADER.unpack(bytes(raw[:OVERFLOW_HEADER_BYTES]))
    return page == spot.page and flags & P_OVERFLOW and num_stored >= num_pages(spot, page_size)
