"""The keys of one LMDB database, read from the data file with `pread`, not through the map.

A page read through LMDB's map stays mapped, and a mapped page outlives a dropped page cache
together with the folio around it, which after a write holds the values stored beside the
tree's leaves: a walk of a disk tier's whole tree through the map would keep its records in
memory, and a later "cold" read would be a memory copy. So this walks the branch and leaf
pages of one database with `pread`, in the snapshot of a read transaction that the caller
holds open meanwhile (LMDB reuses no page of a snapshot that a reader holds), a bounded
number of leaves per call, resuming after a key.

Layouts are liblmdb 0.9's on 64-bit builds, as `kvtier.tiers.disk.lmdb_tree` checks them at open.
"""

from __future__ import annotations

import os
import struct

_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_PAGE_HEADER = struct.Struct("<QHHHH")  # page number, pad, flags, lower, upper
_HEADER_BYTES = 16
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_OFFSET = struct.Struct("<H")
_P_BRANCH, _P_LEAF = 0x01, 0x02
_F_BIGDATA = 0x01
_PGNO = struct.Struct("<Q")
_P_TRANSIENT = 0x10 | 0x4000 | 0x8000
_INVALID_PAGE = (1 << 64) - 1
_MAX_DEPTH = 32


class KeyWalkError(ValueError):
    """A page is not what the database record leads to expect: the snapshot was not held,
    or the file is damaged."""


def read_keys(fd: int, page_size: int, db_record: bytes, after: bytes | None,
              max_leaves: int) -> tuple[list[tuple[bytes, int | None, int]], bool]:
    """The keys greater than `after` (all, if None), in order, from at most `max_leaves`
    leaf pages of the database whose record is `db_record` (its value in the main database,
    as `Transaction.get(name)` returns it), read from `fd` (the data file, `page_size`-byte
    pages), each as (key, first overflow page of its value or None for a value stored in
    the leaf, the value's length); and whether no key follows them. Raises KeyWalkError for
    pages that do not fit the record, OSError when a read fails."""
    if len(db_record) != _DB.size:
        raise KeyWalkError(f"a database record is {_DB.size} bytes, got {len(db_record)}")
    _, _, depth, _, _, _, num_entries, root = _DB.unpack(db_record)
    if num_entries == 0 or root == _INVALID_PAGE:
        return [], True
    if not 1 <= depth <= _MAX_DEPTH:
        raise KeyWalkError(f"the database record states a depth of {depth}")
    walk = _Walk(fd, page_size, depth, after, max_leaves)
    done = walk.visit(root, 1)
    return walk.keys, done


class _Walk:
    def __init__(self, fd: int, page_size: int, depth: int, after: bytes | None,
                 max_leaves: int) -> None:
        self.fd, self.page_size, self.depth = fd, page_size, depth
        self.after, self.leaves_left = after, max_leaves
        self.keys: list[tuple[bytes, int | None, int]] = []

    def visit(self, page: int, level: int) -> bool:
        """Collect the keys of `page`'s subtree; False once the leaf budget is spent."""
        is_leaf = level == self.depth
        nodes = self._nodes(page, _P_LEAF if is_leaf else _P_BRANCH)
        if is_leaf:
            self.keys += [(key, page, size) for page, key, size in nodes
                          if self.after is None or key > self.after]
            self.leaves_left -= 1
            return self.leaves_left > 0
        for i, (child, _, _) in enumerate(nodes):
            # Child i holds the keys below child i + 1's first key.
            if self.after is not None and i + 1 < len(nodes) \
                    and nodes[i + 1][1] <= self.after:
                continue
            if not self.visit(child, level + 1):
                return False
        return True

    def _nodes(self, page: int, kind: int) -> list[tuple[int | None, bytes, int]]:
        """(page, key, size) of each node of `page`: in a branch page the child's page
        number (size 0); in a leaf the value's first overflow page (None: the value sits in
        the leaf) and its length."""
        raw = os.pread(self.fd, self.page_size, page * self.page_size)
        if len(raw) != self.page_size:
            raise KeyWalkError(f"page {page} lies past the end of the file")
        number, _, flags, lower, upper = _PAGE_HEADER.unpack_from(raw)
        if number != page or flags & ~_P_TRANSIENT != kind \
                or not _HEADER_BYTES <= lower <= upper <= self.page_size:
            raise KeyWalkError(f"page {page} is not the {'leaf' if kind == _P_LEAF else 'branch'}"
                               " page its parent names")
        nodes = []
        for i in range((lower - _HEADER_BYTES) // 2):
            (offset,) = _OFFSET.unpack_from(raw, _HEADER_BYTES + 2 * i)
            if offset < upper or offset + _NODE.size > self.page_size:
                raise KeyWalkError(f"page {page}: node {i} lies outside its node area")
            lo, hi, node_flags, key_size = _NODE.unpack_from(raw, offset)
            start = offset + _NODE.size
            if start + key_size > self.page_size:
                raise KeyWalkError(f"page {page}: node {i}'s key runs past the page")
            key = raw[start:start + key_size]
            if kind == _P_BRANCH:
                nodes.append((lo | hi << 16 | node_flags << 32, key, 0))
            elif node_flags & _F_BIGDATA and start + key_size + _PGNO.size <= self.page_size:
                nodes.append((_PGNO.unpack_from(raw, start + key_size)[0], key, lo | hi << 16))
            else:
                nodes.append((None, key, lo | hi << 16))
        return nodes
