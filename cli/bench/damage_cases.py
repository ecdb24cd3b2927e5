"""Ways to damage a disk tier directory, for `kvtier bench damage` and the tests.

Each case changes the files the way a failing disk, a stray `dd`, a full disk or a careless
user would. Pages are chosen by their LMDB header (the page flags at byte 10), not by guess:
`page_kinds` reads them. On a compacted file (`lmdb.Environment.copy(compact=True)`) every
page is live, so each leaf or branch page found there is one LMDB will follow.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
_FLAGS = struct.Struct("<H")
_FLAGS_OFFSET = 10
# Meta page: 16-byte page header, magic and version (8 bytes), then the fields LMDB trusts.
_META_FIELDS_OFFSET = 24
_META_FIELDS_BYTES = 8 + 8 + 2 * 48 + 8 + 8  # address, map size, two dbs, last page, txnid

Damage = Callable[[Path, random.Random], str]


def page_size(data_file: Path) -> int:
    """LMDB's page size, as meta page 0 states it (the free database's pad field)."""
    with open(data_file, "rb") as file:
        return struct.unpack_from("<I", file.read(_META_FIELDS_OFFSET + 24), 40)[0]


def page_kinds(data_file: Path) -> dict[int, list[int]]:
    """Page numbers by page flag (P_BRANCH, P_LEAF, P_OVERFLOW, P_META) of every page
    that starts with an LMDB page header (overflow continuation pages have none)."""
    size = page_size(data_file)
    raw = data_file.read_bytes()
    kinds: dict[int, list[int]] = {P_BRANCH: [], P_LEAF: [], P_OVERFLOW: [], P_META: []}
    page = 0
    while (page + 1) * size <= len(raw):
        pgno = struct.unpack_from("<Q", raw, page * size)[0]
        flags = _FLAGS.unpack_from(raw, page * size + _FLAGS_OFFSET)[0] & 0x0F
        span = 1
        if pgno == page and flags in kinds:
            kinds[flags].append(page)
            if flags == P_OVERFLOW:
                span = max(1, struct.unpack_from("<I", raw, page * size + 12)[0])
        page += span
    return kinds


def overwrite(data_file: Path, offset: int, payload: bytes) -> None:
    with open(data_file, "r+b") as file:
        file.seek(offset)
        file.write(payload)


def _page_body(directory: Path, rng: random.Random, kind: int) -> str:
    data_file = directory / "data.mdb"
    size = page_size(data_file)
    pages = page_kinds(data_file)[kind]
    if not pages:
        raise LookupError(f"no page of kind {kind:#x} in {data_file}")
    page = rng.choice(pages)
    overwrite(data_file, page * size + 16, rng.randbytes(size - 16))
    return f"page {page} (flags {kind:#x}) bytes 16-{size - 1} random"


def _whole_page(directory: Path, rng: random.Random, page: int) -> str:
    data_file = directory / "data.mdb"
    size = page_size(data_file)
    overwrite(data_file, page * size, rng.randbytes(size))
    return f"page {page} random"


def _meta_fields(directory: Path, rng: random.Random) -> str:
    data_file = directory / "data.mdb"
    size = page_size(data_file)
    for page in (0, 1):  # magic and version intact: LMDB accepts the page and trusts it
        overwrite(data_file, page * size + _META_FIELDS_OFFSET,
                  rng.randbytes(_META_FIELDS_BYTES))
    return "both meta pages' fields random (magic and version kept)"


def _length(directory: Path, rng: random.Random, how: str) -> str:
    data_file = directory / "data.mdb"
    size = data_file.stat().st_size
    if how == "half":
        os.truncate(data_file, size // 2)
    elif how == "zero":
        os.truncate(data_file, 0)
    else:  # bytes that are not a whole page
        with open(data_file, "ab") as file:
            file.write(rng.randbytes(1000))
    return f"data.mdb length: {how}"


def _stale_tail(directory: Path, rng: random.Random) -> str:
    """Pages past the last one, as interrupted commits leave them after several kills: an
    overflow run's first page whose run a later commit's pages cut into, then bytes that
    are no page header."""
    data_file = directory / "data.mdb"
    size = page_size(data_file)
    first = data_file.stat().st_size // size
    header = struct.pack("<QHHI", first, 0, P_OVERFLOW, 4)  # pgno, pad, flags, 4 pages
    with open(data_file, "ab") as file:
        file.write(header + rng.randbytes(size - len(header)))
        file.write(rng.randbytes(5 * size))
    return f"pages {first}..{first + 5} past the end: a cut overflow run and random bytes"


def _replace(directory: Path, rng: random.Random, name: str, kind: str) -> str:
    target = directory / name
    target.unlink(missing_ok=True)
    if kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "garbage":
        target.write_bytes(b"\xff" + rng.randbytes(8191))  # never LMDB's magic
    else:
        target.symlink_to(kind)
    return f"{name} replaced by {kind}"


#: The cases every test and the soak know by name.
DAMAGES: dict[str, Damage] = {
    "leaf page": lambda d, rng: _page_body(d, rng, P_LEAF),
    "branch page": lambda d, rng: _page_body(d, rng, P_BRANCH),
    "meta pages": _meta_fields,
    "first page": lambda d, rng: _whole_page(d, rng, 0),
    "second page": lambda d, rng: _whole_page(d, rng, 1),
    "half length": lambda d, rng: _length(d, rng, "half"),
    "zero length": lambda d, rng: _length(d, rng, "zero"),
    "extended by bytes": lambda d, rng: _length(d, rng, "bytes"),
    "data a directory": lambda d, rng: _replace(d, rng, "data.mdb", "directory"),
    "data a fifo": lambda d, rng: _replace(d, rng, "data.mdb", "fifo"),
    "data a link to /dev/zero": lambda d, rng: _replace(d, rng, "data.mdb", "/dev/zero"),
    "data a link to a missing file": lambda d, rng: _replace(d, rng, "data.mdb",
                                                             "/nonexistent/data.mdb"),
    "lock garbage": lambda d, rng: _replace(d, rng, "lock.mdb", "garbage"),
    "lock a directory": lambda d, rng: _replace(d, rng, "lock.mdb", "directory"),
}


#: Changes that leave every block readable: the tier must open as it is, nothing moved aside.
HARMLESS: dict[str, Damage] = {
    "stale pages past the end": _stale_tail,
}


def damage_random_pages(directory: Path, rng: random.Random, num_pages: int) -> list[str]:
    """Damage `num_pages` random pages of a disk tier's data.mdb, each in a random way
    (random bytes over the page after its header, a short random run, a flipped bit, or a
    random header); what was done, one line per page."""
    data_file = directory / "data.mdb"
    size = page_size(data_file)
    num_file_pages = data_file.stat().st_size // size
    done = []
    for _ in range(num_pages):
        page = rng.randrange(num_file_pages)
        how = rng.choice(("page", "run", "bit", "header"))
        if how == "page":
            overwrite(data_file, page * size + 16, rng.randbytes(size - 16))
        elif how == "run":
            offset = rng.randrange(size - 64)
            overwrite(data_file, page * size + offset, rng.randbytes(rng.randrange(1, 64)))
        elif how == "bit":
            offset = page * size + rng.randrange(size)
            with open(data_file, "r+b") as file:
                file.seek(offset)
                byte = file.read(1)[0] ^ (1 << rng.randrange(8))
                file.seek(offset)
                file.write(bytes([byte]))
        else:
            overwrite(data_file, page * size + rng.randrange(16), rng.randbytes(2))
        done.append(f"page {page}: {how}")
    return done


def copy_cache(source: Path, target: Path) -> None:
    """A fresh copy of a disk tier directory (the target is replaced)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, symlinks=True)
