"""A structural check of an LMDB data file, read with plain `pread` calls.

LMDB trusts every page number and offset it finds in its file. This walks the tree of the
meta page LMDB will use and checks each of them first: both meta pages (flags, magic,
version, page size), every branch and leaf page of the free list, the main database and
the named databases in it (page number in the header, kind at that depth, node offsets and
sizes inside the page, keys in order and within their parent's bounds, depth and page and
entry counts as the database record states them), every value's overflow pages (inside the
file, an overflow page long enough at the start), no page used twice, and the free list
(inside the file, disjoint from pages in use); the file must be whole pages long (what lies
past the last page is left by interrupted commits and never read). Nothing here maps the
file, so whatever its bytes, the worst this code does is raise `LmdbTreeDamage`.

Layouts are liblmdb 0.9's on 64-bit builds (py-lmdb bundles it): page header 16 bytes
(page number, pad, flags at byte 10, lower/upper or an overflow page count), node header 8
bytes (lo, hi, flags, key size), database record 48 bytes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# LMDB's on-disk format (liblmdb 0.9, 64-bit builds): page header, node header, flags.
_PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (or u32 pages)
_PAGE_HEADER_BYTES = 16
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_NODE_BYTES = 8
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META = struct.Struct("<IIQQ")  # magic, version, address, map size (after the page header)
_META_DBS_OFFSET = _PAGE_HEADER_BYTES + _META.size
_META_TAIL = struct.Struct("<QQ")  # last page number, transaction id (after the two dbs)
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
_P_TRANSIENT = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP: in-memory marks
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
_REVERSEKEY, _DUPSORT, _INTEGERKEY = 0x02, 0x04, 0x08
_UNSUPPORTED_DB_FLAGS = ~(_REVERSEKEY | _INTEGERKEY) & 0xFFFF  # no duplicate-key databases
_NUM_METAS = 2
_INVALID_PAGE = (1 << 64) - 1
_MAX_DEPTH = 32  # LMDB's cursor stack
_MAX_KEY_BYTES = 511


class LmdbTreeDamage(ValueError):
    """The data file is not what LMDB writes; the message says where and how."""


@dataclass(frozen=True, slots=True)
class TreeReport:
    """What a passing check walked: branch and leaf pages, values (all databases), pages
    on the free list."""

    num_tree_pages: int
    num_values: int
    num_free_pages: int


def check_lmdb_tree(fd: int, size: int) -> TreeReport:
    """Check the LMDB data file open as `fd`, `size` bytes long. Raises LmdbTreeDamage
    saying what is wrong, OSError when reading fails."""
    return _TreeCheck(fd, size).run()


@dataclass(slots=True)
class _DbRecord:
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def unpack(cls, raw: bytes, offset: int) -> _DbRecord:
        _, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack_from(raw, offset)
        return cls(flags, depth, branch, leaf, overflow, entries, root)


@dataclass(slots=True)
class _Walk:
    """Counts of one database's tree as walked."""

    branch_pages: int = 0
    leaf_pages: int = 0
    overflow_pages: int = 0
    entries: int = 0


class _TreeCheck:
    """One pass over the tree of the current meta page of an open data file."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.page_size = 0
        self.num_pages = 0  # pages the meta says exist (last page + 1)
        self.used = bytearray()
        self.num_tree_pages = self.num_values = 0

    def fail(self, problem: str) -> LmdbTreeDamage:
        return LmdbTreeDamage(problem)

    def run(self) -> TreeReport:
        if self.size == 0:
            raise self.fail("it is empty (0 bytes), but LMDB writes two meta pages when it "
                            "creates it")
        meta = self._read_metas()
        free_db = _DbRecord.unpack(meta, _META_DBS_OFFSET)
        main_db = _DbRecord.unpack(meta, _META_DBS_OFFSET + _DB.size)
        last_page, _ = _META_TAIL.unpack_from(meta, _META_DBS_OFFSET + 2 * _DB.size)
        self.num_pages = last_page + 1
        file_pages = self.size // self.page_size
        if self.num_pages > file_pages or last_page < _NUM_METAS - 1:
            raise self.fail(f"it has {self.size} bytes but its meta page says it has "
                            f"{self.num_pages} pages of {self.page_size} bytes: the file was "
                            "cut short or its meta page is damaged")
        self.used = bytearray(self.num_pages)
        self.used[0:_NUM_METAS] = b"\x01" * _NUM_METAS
        free_pages: list[int] = []
        self._walk_db("the free list", free_db, free_pages)
        sub_dbs: list[tuple[bytes, _DbRecord]] = []
        self._walk_db("the main database", main_db, sub_dbs)
        for name, record in sub_dbs:
            self._walk_db(f"database {name.decode(errors='replace')!r}", record, None)
        for page in free_pages:
            if not _NUM_METAS <= page < self.num_pages:
                raise self.fail(f"its free list names page {page}, outside pages "
                                f"{_NUM_METAS}..{last_page}")
            if self.used[page]:
                raise self.fail(f"page {page} is both in use and on the free list")
            self.used[page] = 1
        self._check_tail()
        return TreeReport(self.num_tree_pages, self.num_values, len(free_pages))

    # ---- pages ------------------------------------------------------------------------

    def _read(self, offset: int, length: int) -> bytes:
        raw = os.pread(self.fd, length, offset)
        if len(raw) != length:
            raise self.fail(f"it ends at byte {self.size}, inside a page it needs "
                            f"(offset {offset}): the file was cut short")
        return raw

    def _read_metas(self) -> bytes:
        # LMDB reads meta 0 at offset 0 and meta 1 one page (as meta 0 states it) later.
        metas = []
        offset = 0
        for index in range(_NUM_METAS):
            if self.size < offset + _META_DBS_OFFSET + 2 * _DB.size + _META_TAIL.size:
                raise self.fail(f"it is too short ({self.size} bytes) for LMDB's two meta "
                                "pages: the file was cut short or is not LMDB's")
            raw = self._read(offset, _META_DBS_OFFSET + 2 * _DB.size + _META_TAIL.size)
            _, _, flags, _, _ = _PAGE_HEADER.unpack_from(raw)
            magic, version, _, _ = _META.unpack_from(raw, _PAGE_HEADER_BYTES)
            if not flags & P_META or magic != MDB_MAGIC:
                raise self.fail(f"meta page {index} is damaged (not an LMDB meta page)")
            if version != MDB_DATA_VERSION:
                raise self.fail(f"meta page {index} has LMDB data version {version}, not "
                                f"{MDB_DATA_VERSION}")
            page_size = _DB.unpack_from(raw, _META_DBS_OFFSET)[0]  # the free db's pad
            if page_size & (page_size - 1) or not 512 <= page_size <= 65536:
                raise self.fail(f"meta page {index} states a page size of {page_size} bytes")
            if index == 0:
                self.page_size = page_size
            elif page_size != self.page_size:
                raise self.fail("its two meta pages disagree on the page size")
            metas.append(raw)
            offset += page_size
        txnids = [_META_TAIL.unpack_from(m, _META_DBS_OFFSET + 2 * _DB.size)[1] for m in metas]
        return metas[int(txnids[0] < txnids[1])]  # the one LMDB uses: the newest

    def _page(self, page: int, what: str) -> bytes:
        if not _NUM_METAS <= page < self.num_pages:
            raise self.fail(f"{what} points to page {page}, outside pages {_NUM_METAS}.."
                            f"{self.num_pages - 1}")
        if self.used[page]:
            raise self.fail(f"page {page} is used twice (reached again from {what})")
        self.used[page] = 1
        raw = self._read(page * self.page_size, self.page_size)
        if _PAGE_HEADER.unpack_from(raw)[0] != page:
            raise self.fail(f"page {page} ({what}) carries the number of another page: it "
                            "was overwritten")
        return raw

    def _nodes(self, raw: bytes, page: int) -> list[tuple[int, int, int, int]]:
        """(offset, lo | hi << 16, flags, key size) of each node, bounds checked."""
        _, _, _, lower, upper = _PAGE_HEADER.unpack_from(raw)
        if not _PAGE_HEADER_BYTES <= lower <= upper <= self.page_size:
            raise self.fail(f"page {page} has a damaged header (free space {lower}..{upper})")
        nodes = []
        for i in range((lower - _PAGE_HEADER_BYTES) // 2):
            (offset,) = struct.unpack_from("<H", raw, _PAGE_HEADER_BYTES + 2 * i)
            if offset < upper or offset + _NODE_BYTES > self.page_size:
                raise self.fail(f"page {page}: node {i} lies outside the page's node area")
            lo, hi, flags, key_size = _NODE.unpack_from(raw, offset)
            if offset + _NODE_BYTES + key_size > self.page_size:
                raise self.fail(f"page {page}: node {i}'s key runs past the page")
            nodes.append((offset, lo | hi << 16, flags, key_size))
        return nodes

    # ---- databases --------------------------------------------------------------------

    def _walk_db(self, name: str, record: _DbRecord, collect: list | None) -> None:
        if record.flags & _UNSUPPORTED_DB_FLAGS:
            raise self.fail(f"{name} has flags {record.flags:#x}; kvtier writes none of "
                            "duplicate-key databases")
        walked = _Walk()
        if record.root == _INVALID_PAGE:
            depth = 0
        else:
            if not 1 <= record.depth <= _MAX_DEPTH:
                raise self.fail(f"{name} states a tree depth of {record.depth}")
            depth = record.depth
            self._walk_page(name, record, record.root, 1, None, None, walked, collect)
        stated = (depth, record.branch_pages, record.leaf_pages, record.overflow_pages,
                  record.entries)
        found = (record.depth, walked.branch_pages, walked.leaf_pages, walked.overflow_pages,
                 walked.entries)
        if stated != found:
            raise self.fail(f"{name}'s record (depth, branch, leaf, overflow pages, entries "
                            f"{stated}) disagrees with its tree {found}")

    def _key(self, record: _DbRecord, key: bytes) -> object:
        if record.flags & _INTEGERKEY:
            return int.from_bytes(key, "little")
        return key[::-1] if record.flags & _REVERSEKEY else key

    def _walk_page(self, name: str, record: _DbRecord, page: int, level: int,
                   low: object, high: object, walked: _Walk, collect: list | None) -> None:
        """Check `page` at tree level `level` (1 = root) and its subtree; every key must lie
        in [low, high) (None: unbounded)."""
        raw = self._page(page, name)
        self.num_tree_pages += 1
        kind = _PAGE_HEADER.unpack_from(raw)[2] & ~_P_TRANSIENT
        is_leaf = level == record.depth
        if kind != (P_LEAF if is_leaf else P_BRANCH):
            raise self.fail(f"page {page} of {name} should be a "
                            f"{'leaf' if is_leaf else 'branch'} page but has flags {kind:#x}")
        nodes = self._nodes(raw, page)
        if not nodes and not is_leaf:
            raise self.fail(f"branch page {page} of {name} has no entries")
        keys = []
        for i, (offset, value, flags, key_size) in enumerate(nodes):
            key_start = offset + _NODE_BYTES
            key = self._key(record, raw[key_start:key_start + key_size])
            if is_leaf or i > 0:  # a branch page's first key is ignored (always empty)
                if key_size > _MAX_KEY_BYTES or (keys and not keys[-1] < key) \
                        or (low is not None and key < low) or (high is not None and
                                                               not key < high):
                    raise self.fail(f"page {page} of {name}: its keys are out of order")
                keys.append(key)
            if is_leaf:
                self._leaf_value(name, record, raw, page, key_start + key_size, value, flags,
                                 raw[key_start:key_start + key_size], walked, collect)
        if is_leaf:
            walked.leaf_pages += 1
            walked.entries += len(nodes)
            return
        walked.branch_pages += 1
        bounds = [low] + keys + [high]
        for i, (_, value, flags, _) in enumerate(nodes):
            child = value | flags << 32
            self._walk_page(name, record, child, level + 1, bounds[i], bounds[i + 1],
                            walked, collect)

    def _leaf_value(self, name: str, record: _DbRecord, raw: bytes, page: int,
                    data_start: int, data_size: int, flags: int, key: bytes, walked: _Walk,
                    collect: list | None) -> None:
        if flags & F_DUPDATA or flags & ~(F_BIGDATA | F_SUBDATA):
            raise self.fail(f"page {page} of {name} has a node with flags {flags:#x}")
        if flags & F_BIGDATA:
            if data_start + _U64.size > self.page_size:
                raise self.fail(f"page {page} of {name}: a value's page number runs past "
                                "the page")
            (first,) = _U64.unpack_from(raw, data_start)
            walked.overflow_pages += self._overflow(name, first, data_size)
            is_free_list = record.flags & _INTEGERKEY and collect is not None
            # Only the free list's long values are read: kvtier's own are checked by their
            # checksums when they are loaded.
            data = self._overflow_bytes(first, data_size) if is_free_list else None
        else:
            if data_start + data_size > self.page_size:
                raise self.fail(f"page {page} of {name}: a value runs past the page")
            data = raw[data_start:data_start + data_size]
        self.num_values += 1
        if flags & F_SUBDATA:
            if data is None or len(data) != _DB.size or collect is None \
                    or record.flags & _INTEGERKEY:
                raise self.fail(f"page {page} of {name}: a damaged database record")
            collect.append((key, _DbRecord.unpack(data, 0)))
        elif record.flags & _INTEGERKEY and collect is not None:  # the free list
            assert data is not None, "a long free-list value was read above"
            collect.extend(self._free_page_list(data, page))

    def _overflow(self, name: str, first: int, data_size: int) -> int:
        """Check the overflow pages of a `data_size`-byte value starting at `first`; how
        many pages they span."""
        needed = (_PAGE_HEADER_BYTES - 1 + data_size) // self.page_size + 1
        if not _NUM_METAS <= first or first + needed > self.num_pages:
            raise self.fail(f"a value of {name} ({data_size} bytes) points to pages "
                            f"{first}..{first + needed - 1}, past the last page "
                            f"{self.num_pages - 1}")
        header = self._read(first * self.page_size, _PAGE_HEADER_BYTES)
        pgno, _, page_flags, _, _ = _PAGE_HEADER.unpack_from(header)
        (num_pages,) = _U32.unpack_from(header, 12)
        if pgno != first or page_flags & ~_P_TRANSIENT != P_OVERFLOW or num_pages < needed \
                or first + num_pages > self.num_pages:
            raise self.fail(f"a value of {name} points to page {first}, which is not the "
                            "start of a long enough run of overflow pages")
        span = self.used[first:first + num_pages]
        if any(span):
            raise self.fail(f"overflow pages {first}..{first + num_pages - 1} of {name} "
                            "overlap pages in use")
        self.used[first:first + num_pages] = b"\x01" * num_pages
        return num_pages

    def _overflow_bytes(self, first: int, data_size: int) -> bytes:
        return self._read(first * self.page_size + _PAGE_HEADER_BYTES, data_size)

    def _free_page_list(self, data: bytes, page: int) -> list[int]:
        """The page numbers of one free-list record (an LMDB ID list: count, then ids)."""
        if len(data) < _U64.size or len(data) % _U64.size:
            raise self.fail(f"page {page}: a free-list record of {len(data)} bytes")
        (count,) = _U64.unpack_from(data)
        if (count + 1) * _U64.size > len(data):
            raise self.fail(f"page {page}: a free-list record counts {count} pages in "
                            f"{len(data)} bytes")
        return list(struct.unpack_from(f"<{count}Q", data, _U64.size))

    def _check_tail(self) -> None:
        """Bytes past the last page: whole pages only, whatever they hold.

        LMDB never reads a page past the last one its meta page names, and its next commits
        write over them. They are what interrupted commits left, and after several
        interruptions those leftovers overlap (a later commit's pages start inside an
        earlier one's overflow run), so their headers cannot be followed. Only a length
        that is not a whole number of pages says bytes were added or cut by something else.
        """
        if self.size % self.page_size:
            raise self.fail(f"its length ({self.size} bytes) is not a whole number of "
                            f"{self.page_size}-byte pages: bytes were added or cut")
