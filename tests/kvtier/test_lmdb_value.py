"""`kvtier.tiers.disk.lmdb_value` on real LMDB files: a value's length and first overflow page,
found from its leaf node without reading it, agree with what LMDB returns and with the
bytes at that place in data.mdb; values stored together are read back with one preadv."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest

from kvtier.tiers.disk import lmdb_value
from kvtier.tiers.disk.lmdb_value import (
    MAX_GAP_BYTES,
    OVERFLOW_HEADER_BYTES,
    ValueSpot,
    check_overflow_header,
    find_value,
    num_pages,
    pread_values,
)

BIG = os.urandom(300_000)  # on overflow pages
SMALL = b"in its leaf page"


@pytest.fixture
def env(tmp_path: Path):
    environment = lmdb.open(str(tmp_path), map_size=1 << 26, max_dbs=2)
    db = environment.open_db(b"blocks")
    with environment.begin(write=True) as txn:
        txn.put(b"big", BIG, db=db)
        txn.put(b"small", SMALL, db=db)
    yield environment, db
    environment.close()


def test_a_long_value_is_found_on_its_overflow_pages(env, tmp_path: Path) -> None:
    environment, db = env
    page_size = environment.stat()["psize"]
    with environment.begin(buffers=True) as txn, txn.cursor(db=db) as cursor:
        spot = find_value(cursor, b"big")
    assert spot is not None and spot.page is not None and spot.size == len(BIG)
    with open(tmp_path / "data.mdb", "rb") as data:
        data.seek(spot.file_offset(page_size))
        raw = data.read(OVERFLOW_HEADER_BYTES + spot.size)
    assert check_overflow_header(raw, spot, page_size)
    assert raw[OVERFLOW_HEADER_BYTES:] == BIG
    # A spot naming another page is not taken for this value's.
    assert not check_overflow_header(raw, ValueSpot(spot.size, spot.page + 1), page_size)
    assert not check_overflow_header(raw, ValueSpot(spot.size * 4, spot.page), page_size)


def test_a_short_value_and_a_missing_key(env) -> None:
    environment, db = env
    with environment.begin(buffers=True) as txn, txn.cursor(db=db) as cursor:
        assert find_value(cursor, b"small") == ValueSpot(len(SMALL), None)
        assert find_value(cursor, b"absent") is None


def test_a_transaction_without_buffers_is_refused(env) -> None:
    environment, db = env
    with environment.begin(buffers=False) as txn, txn.cursor(db=db) as cursor:
        with pytest.raises(ValueError, match="buffers"):
            find_value(cursor, b"big")


def _preadv_calls(monkeypatch) -> list[int]:
    """Counts the preadv system calls `lmdb_value` makes (each still made, for real)."""
    calls: list[int] = []
    real = os.preadv

    def counted(fd, buffers, offset):
        calls.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(lmdb_value.os, "preadv", counted)
    return calls


def test_values_of_one_transaction_are_read_with_one_preadv(tmp_path: Path,
                                                           monkeypatch) -> None:
    environment = lmdb.open(str(tmp_path), map_size=1 << 28, max_dbs=2)
    db = environment.open_db(b"blocks")
    values = {f"k{i:02d}".encode(): os.urandom(200_000 + 1000 * i) for i in range(12)}
    keys = list(values)
    with environment.begin(write=True) as txn:  # the first eight, then (apart) the rest
        for key in keys[:8]:
            txn.put(key, values[key], db=db)
    with environment.begin(write=True) as txn:
        txn.put(b"spacer", os.urandom(400_000), db=db)  # 400 KB between the two runs
        for key in keys[8:]:
            txn.put(key, values[key], db=db)
    page_size = environment.stat()["psize"]
    fd = os.open(tmp_path / "data.mdb", os.O_RDONLY)
    try:
        with environment.begin(buffers=True) as txn, txn.cursor(db=db) as cursor:
            asked = keys[::-1]  # in any order: read in file order
            spots = [find_value(cursor, key) for key in asked]
            assert num_pages(spots[0], page_size) * page_size >= spots[0].size
            buffers = [bytearray(spot.size) for spot in spots]
            calls = _preadv_calls(monkeypatch)
            landed = pread_values(fd, spots, page_size, [[memoryview(b)] for b in buffers])
        assert landed == [True] * 12
        assert [bytes(b) for b in buffers] == [values[key] for key in asked]
        assert len(calls) == 2  # two runs: the spacer is farther than MAX_GAP_BYTES
        assert 400_000 > MAX_GAP_BYTES
        # A spot that does not name the start of its overflow pages is not taken.
        spot = spots[0]
        wrong = [ValueSpot(spot.size, spot.page + 1), spot]
        buffers = [bytearray(spot.size), bytearray(spot.size)]
        assert pread_values(fd, wrong, page_size, [[memoryview(b)] for b in buffers]) \
            == [False, True]
        # Past the end of the file: not read.
        beyond = ValueSpot(spot.size, os.fstat(fd).st_size // page_size + 10)
        assert pread_values(fd, [beyond], page_size, [[memoryview(bytearray(spot.size))]]) \
            == [False]
    finally:
        os.close(fd)
        environment.close()
