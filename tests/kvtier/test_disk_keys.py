"""The disk tier's in-memory copy of its stored hashes (`kvtier.tiers.disk.keys`): lookups
answered from memory agree with what reads find, through this process's puts, prunes,
deletes and rejections, another process's writes, and commits made while the copy loads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest
from disk_cases import LARGE, SMALL, make_blocks, read_back, record_size, same_bytes

from kvtier.hashing import BlockHash
from kvtier.tiers.disk import lmdb_value
from kvtier.tiers.disk import read as disk_read
from kvtier.tiers.disk.key_changes import KeyChanges
from kvtier.tiers.disk.keys import DiskKeySet
from kvtier.tiers.disk.lmdb_keys import read_keys
from kvtier.tiers.disk.lmdb_value import find_value
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta


def _truth(tier: DiskTier, metas) -> list[bool]:
    """What reads find, block by block (a read validates the stored value)."""
    return [read_back(tier, meta) is not None for meta in metas]


def test_own_puts_prunes_deletes_and_rejections_keep_lookups_in_memory(tmp_path):
    metas, payloads = make_blocks(LARGE, seed=1, num_blocks=30)
    budget = 10 * record_size(LARGE, metas[0])  # ten blocks: the rest prune the oldest
    with DiskTier(tmp_path, LARGE, budget) as tier:
        assert tier.keys_in_memory(wait=10)  # an empty directory loads at once
        for start in range(0, 30, 6):
            tier.put(metas[start:start + 6], payloads[start:start + 6])
            # Each commit moved the copy along: no reload was needed to answer.
            assert tier.keys_in_memory()
            assert tier.contains([m.block_hash for m in metas]) == _truth(tier, metas)
        stored = [m for m, hit in zip(metas, _truth(tier, metas)) if hit]
        assert len(stored) == 10
        assert tier.delete([stored[0].block_hash, stored[3].block_hash]) == 2
        assert tier.keys_in_memory()
        found = tier.contains([m.block_hash for m in metas])
        assert found == _truth(tier, metas) and sum(found) == 8
        # A value stored under a hash with other token ids is rejected by the read and
        # deleted: the copy forgets it in the same commit.
        last = metas[-1]
        wrong = BlockMeta(last.block_hash, last.parent_hash,
                          last.token_ids[:-1] + (last.token_ids[-1] + 1,))
        assert tier.contains([wrong.block_hash]) == [True]
        assert read_back(tier, wrong) is None
        assert tier.keys_in_memory()
        assert tier.contains([wrong.block_hash]) == [False]


def test_a_reopened_directory_loads_its_hashes(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=2, num_blocks=40)
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        assert sum(tier.put(metas[:25], payloads[:25])) == 25
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        assert tier.keys_in_memory(wait=10)
        assert tier.contains([m.block_hash for m in metas]) == [True] * 25 + [False] * 15


_CHILD = """
import sys
sys.path[:0] = {paths!r}
from disk_cases import SMALL, make_blocks
from kvtier.tiers.disk.tier import DiskTier
metas, payloads = make_blocks(SMALL, seed=3, num_blocks=12)
with DiskTier({path!r}, SMALL, 1 << 30) as tier:
    assert sum(tier.put(metas[6:], payloads[6:])) == 6
    assert tier.delete([metas[0].block_hash]) == 1
"""


def test_another_processes_writes_are_seen_and_the_copy_reloads(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=3, num_blocks=12)
    hashes = [m.block_hash for m in metas]
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        assert sum(tier.put(metas[:6], payloads[:6])) == 6
        assert tier.keys_in_memory(wait=10)
        here = Path(__file__).parent
        paths = [str(here), str(here.parent.parent)]
        subprocess.run([sys.executable, "-c", _CHILD.format(paths=paths, path=str(tmp_path))],
                       check=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
        # The copy is behind: LMDB answers until it has loaded again.
        expected = [False] + [True] * 11
        assert tier.contains(hashes) == expected
        assert tier.keys_in_memory(wait=10)
        assert tier.contains(hashes) == expected == _truth(tier, metas)


def test_lookups_soon_after_a_current_one_answer_from_memory(tmp_path):
    """Within `keys_fresh_s` of a lookup that found the copy current, lookups answer from it
    without reading LMDB: this process's commits show at once, another process's only once
    the window has passed; a stale answer costs a miss at read, never a wrong block."""
    metas, payloads = make_blocks(SMALL, seed=3, num_blocks=12)
    hashes = [m.block_hash for m in metas]
    with DiskTier(tmp_path, SMALL, 1 << 30, keys_fresh_s=3600) as tier:
        assert sum(tier.put(metas[:6], payloads[:6])) == 6
        assert tier.keys_in_memory(wait=10)
        assert tier.contains(hashes) == [True] * 6 + [False] * 6  # found the copy current
        assert sum(tier.put(metas[6:8], payloads[6:8])) == 2
        assert tier.contains(hashes) == [True] * 8 + [False] * 4
        here = Path(__file__).parent
        paths = [str(here), str(here.parent.parent)]
        subprocess.run([sys.executable, "-c", _CHILD.format(paths=paths, path=str(tmp_path))],
                       check=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
        # The child deleted block 0 and stored 8..11: still the copy's answer.
        assert tier.contains(hashes) == [True] * 8 + [False] * 4
        assert read_back(tier, metas[0]) is None
        tier.keys_fresh_s = 0.0
        assert tier.contains(hashes) == [False] + [True] * 11 == _truth(tier, metas)


def test_commits_while_the_copy_loads_are_replayed(tmp_path):
    """Enough inline blocks that the load takes many transactions, with this process putting
    and deleting blocks from two threads meanwhile."""
    metas, payloads = make_blocks(SMALL, seed=4, num_blocks=3000)
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        for start in range(0, 2000, 500):
            tier.put(metas[start:start + 500], payloads[start:start + 500])
    hashes = [m.block_hash for m in metas]
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        def put_rest() -> None:
            for start in range(2000, 3000, 50):
                tier.put(metas[start:start + 50], payloads[start:start + 50])

        def delete_some() -> None:
            for start in range(0, 400, 20):
                tier.delete(hashes[start:start + 10])

        threads = [threading.Thread(target=put_rest), threading.Thread(target=delete_some)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tier.keys_in_memory(wait=30)
        deleted = {i for start in range(0, 400, 20) for i in range(start, start + 10)}
        expected = [i not in deleted for i in range(3000)]
        assert tier.contains(hashes) == expected
        assert tier.stats().num_blocks == sum(expected)


def test_closing_while_the_copy_loads_returns(tmp_path):
    metas, payloads = make_blocks(SMALL, seed=5, num_blocks=1500)
    with DiskTier(tmp_path, SMALL, 1 << 30) as tier:
        tier.put(metas, payloads)
    began = time.monotonic()
    for _ in range(5):
        DiskTier(tmp_path, SMALL, 1 << 30).close()
    assert time.monotonic() - began < 30


# ---- the copy's bookkeeping on its own ---------------------------------------------------


def _changes(*steps: tuple[bytes, bool], cleared: bool = False) -> KeyChanges:
    return KeyChanges([(BlockHash(h), 0 if stored else None) for h, stored in steps], cleared)


def test_a_copy_follows_its_own_commits_and_drops_at_a_gap():
    keys = DiskKeySet()
    assert keys.lookup(0, [b"a"]) is None  # not loaded
    assert keys.start_load() and not keys.start_load()  # one load at a time
    assert keys.install(0, [(BlockHash(b"a"), 0)])
    assert keys.lookup(0, [b"a", b"b"]) == [True, False]
    keys.committed(0, 2, _changes((b"b", True), (b"a", False)))
    assert keys.lookup(2, [b"a", b"b"]) == [False, True]
    assert keys.lookup(0, [b"a"]) is None  # asked at another generation
    keys.committed(3, 4, _changes((b"c", True)))  # generation 3 was another process's
    assert keys.generation is None and keys.lookup(4, [b"c"]) is None


def test_a_load_replays_commits_after_its_snapshot_and_refuses_a_gap():
    keys = DiskKeySet()
    assert keys.start_load()
    keys.committed(4, 5, _changes((b"old", True)))  # before the snapshot (at 5) was read
    keys.committed(5, 7, _changes((b"x", True), (b"y", True)))
    keys.committed(7, 8, _changes((b"x", False)))
    assert keys.install(5, [(BlockHash(b"old"), 0)])
    assert keys.lookup(8, [b"old", b"x", b"y"]) == [True, False, True]
    keys.committed(8, 9, _changes(cleared=True))
    assert keys.lookup(9, [b"old", b"y"]) == [False, False]

    assert keys.start_load()
    keys.committed(12, 13, _changes((b"z", True)))  # 9..12 were another process's
    assert not keys.install(10, [])
    assert keys.generation is None


@pytest.mark.parametrize("layout", [SMALL, LARGE], ids=["inline values", "overflow values"])
def test_the_walk_reads_every_key_in_order(tmp_path, layout):
    """The pread walk of the tree (`kvtier.tiers.disk.lmdb_keys`) in chunks of a few leaves
    returns exactly LMDB's keys, whatever the tree's depth."""
    metas, payloads = make_blocks(layout, seed=6, num_blocks=600)
    with DiskTier(tmp_path, layout, 1 << 30) as tier:
        tier.put(metas, payloads)
    env = lmdb.open(str(tmp_path), readonly=True, max_dbs=8, lock=False)
    fd = os.open(tmp_path / "data.mdb", os.O_RDONLY)
    try:
        with env.begin() as txn:
            record = txn.get(b"blocks")
            page_size = env.stat()["psize"]
            found, after, done, num_calls = [], None, False, 0
            while not done:
                chunk, done = read_keys(fd, page_size, record, after, 2)
                found += chunk
                after = found[-1][0] if found else None
                num_calls += 1
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(buffers=True) as txn, txn.cursor(db=blocks) as cursor:
            spots = [find_value(cursor, key) for key, _, _ in found]
    finally:
        os.close(fd)
        env.close()
    assert [key for key, _, _ in found] == sorted(m.block_hash for m in metas)
    assert num_calls > 3  # resumed after a key, more than once
    # Each value's place as LMDB's own cursor finds it: overflow pages, or in the leaf.
    assert [(page, size) for _, page, size in found] == [(s.page, s.size) for s in spots]
    assert all(page is not None for _, page, _ in found) == (layout is LARGE)


# ---- reads where the copy saw the values ------------------------------------------------


def _count_tree_lookups(monkeypatch) -> list[bytes]:
    """Record the keys the read path looks up in LMDB's tree (the real lookup still runs)."""
    looked_up: list[bytes] = []

    def recording(cursor, key):
        looked_up.append(bytes(key))
        return lmdb_value.find_value(cursor, key)
    monkeypatch.setattr(disk_read, "find_value", recording)
    return looked_up


def test_reads_go_where_the_copy_saw_each_value(tmp_path, monkeypatch):
    """After a load, a read takes each record's place from the copy: no tree lookup (after
    a dropped page cache, each is a disk read made holding the GIL)."""
    metas, payloads = make_blocks(LARGE, seed=7, num_blocks=20)
    with DiskTier(tmp_path, LARGE, 1 << 30) as tier:
        tier.put(metas[:12], payloads[:12])
    with DiskTier(tmp_path, LARGE, 1 << 30) as tier:
        assert tier.keys_in_memory(wait=10)
        tier.put(metas[12:], payloads[12:])  # this process's puts note their places too
        looked_up = _count_tree_lookups(monkeypatch)
        for meta, payload in zip(metas, payloads):
            assert same_bytes(read_back(tier, meta), payload)
        assert looked_up == []


_FOREIGN_WRITER = """
import sys
sys.path[:0] = {paths!r}
from disk_cases import LARGE, make_blocks
from kvtier.tiers.disk.tier import DiskTier
old, _ = make_blocks(LARGE, seed=8, num_blocks=20)
new, payloads = make_blocks(LARGE, seed=9, num_blocks=30)
with DiskTier({path!r}, LARGE, 1 << 30) as tier:
    assert tier.delete([m.block_hash for m in old[:10]]) == 10
    # Commits of their own, three times the blocks freed: LMDB takes freed pages before
    # growing the file, so the deleted blocks' pages hold other records afterwards.
    for meta, payload in zip(new, payloads):
        assert sum(tier.put([meta], [payload])) == 1
"""


def test_a_place_another_process_changed_is_looked_up_again(tmp_path, monkeypatch):
    """Another process deletes blocks and writes others, likely into the freed pages: the
    copy's places for the deleted ones are stale. Reads there find other records, look the
    block up afresh and miss; nothing is counted as rejected or deleted, and the new blocks
    read back exactly."""
    old, old_payloads = make_blocks(LARGE, seed=8, num_blocks=20)
    new, new_payloads = make_blocks(LARGE, seed=9, num_blocks=30)
    with DiskTier(tmp_path, LARGE, 1 << 30) as tier:
        tier.put(old, old_payloads)
    with DiskTier(tmp_path, LARGE, 1 << 30) as tier:
        assert tier.keys_in_memory(wait=10)
        here = Path(__file__).parent
        paths = [str(here), str(here.parent.parent)]
        subprocess.run([sys.executable, "-c", _FOREIGN_WRITER.format(paths=paths,
                                                                      path=str(tmp_path))],
                       check=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
        looked_up = _count_tree_lookups(monkeypatch)
        assert [read_back(tier, meta) for meta in old[:10]] == [None] * 10
        assert looked_up == [m.block_hash for m in old[:10]]  # each stale place, again
        for meta, payload in zip(old[10:] + new, old_payloads[10:] + new_payloads):
            assert same_bytes(read_back(tier, meta), payload)
        assert tier.stats().rejected == 0
        assert tier.stats().num_blocks == 40
