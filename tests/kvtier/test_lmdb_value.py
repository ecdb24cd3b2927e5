"""`kvtier.tiers.lmdb_value` on real LMDB files: a value's length and first overflow page,
found from its leaf node without reading it, agree with what LMDB returns and with the
bytes at that place in data.mdb."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest

from kvtier.tiers.lmdb_value import (
    OVERFLOW_HEADER_BYTES,
    ValueSpot,
    check_overflow_header,
    find_value,
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
