"""Damaged LMDB files of a disk tier never crash the process: they are found by the check
before LMDB maps them, moved aside (never deleted), and a fresh tier takes their place.

One disk tier of 600 small blocks (enough keys for branch pages) is filled once per module
and compacted, so every page of its file is live; each case damages a copy of it. Opening a
damaged copy runs in a forked child: if the check let damage through and LMDB crashed, the
test fails with the child's signal instead of killing the test run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from disk_cases import SMALL, make_blocks, read_back, run_in_children, same_bytes
from kvtier.cli.bench.damage_cases import (
    DAMAGES,
    HARMLESS,
    P_BRANCH,
    P_LEAF,
    copy_cache,
    damage_random_pages,
    page_kinds,
)

from kvtier.tiers.disk.check import DamagedDiskFiles, check_disk_files
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.tier import DiskTier

NUM_BLOCKS = 600
BUDGET = 1 << 26


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A compacted disk tier holding NUM_BLOCKS blocks of SMALL (seed 1)."""
    filled = tmp_path_factory.mktemp("filled")
    metas, payloads = make_blocks(SMALL, 1, NUM_BLOCKS)
    with DiskTier(filled, SMALL, BUDGET) as tier:
        for start in range(0, NUM_BLOCKS, 50):
            assert sum(tier.put(metas[start:start + 50], payloads[start:start + 50])) == 50
    compact = tmp_path_factory.mktemp("compact")
    env = lmdb.open(str(filled), max_dbs=8, readonly=True)
    try:
        env.copy(str(compact), compact=True)
    finally:
        env.close()
    os.chmod(compact, 0o700)
    kinds = page_kinds(compact / "data.mdb")
    assert kinds[P_BRANCH] and kinds[P_LEAF], "test setup: the tree needs branch pages"
    return compact


def damaged_copy(pristine: Path, tmp_path: Path, case: str) -> Path:
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    DAMAGES[case](directory, random.Random(case))
    return directory


def open_and_use(path: str) -> dict:
    """In a child: open the tier as the engine does, then read every block and write one."""
    tier, recovery = open_disk_tier(path, SMALL, BUDGET)
    assert tier is not None
    with tier:
        metas, payloads = make_blocks(SMALL, 1, NUM_BLOCKS)
        num_hits = sum(read_back(tier, meta) is not None for meta in metas)
        new_metas, new_payloads = make_blocks(SMALL, 2, 3)
        assert sum(tier.put(new_metas, new_payloads)) == 3
        assert all(same_bytes(read_back(tier, m), p) for m, p in zip(new_metas, new_payloads))
    return {"num_hits": num_hits, "moved_to": None if recovery is None else
            str(recovery.moved_to), "message": None if recovery is None else recovery.message}


def test_the_undamaged_cache_passes_and_serves_every_block(pristine, tmp_path):
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    report = check_disk_files(directory)
    assert report.checked and report.num_values >= 3 * NUM_BLOCKS  # blocks, access, lru
    (result,) = run_in_children((open_and_use, str(directory)))
    assert result == {"num_hits": NUM_BLOCKS, "moved_to": None, "message": None}


@pytest.mark.parametrize("case", list(HARMLESS))
def test_what_interrupted_commits_leave_past_the_end_is_not_damage(pristine, tmp_path, case):
    """LMDB never reads past its last page; leftovers there, however they overlap, keep the
    tier as it is."""
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    size = (directory / "data.mdb").stat().st_size
    HARMLESS[case](directory, random.Random(case))
    assert (directory / "data.mdb").stat().st_size > size
    check_disk_files(directory)
    (result,) = run_in_children((open_and_use, str(directory)))
    assert result == {"num_hits": NUM_BLOCKS, "moved_to": None, "message": None}
    check_disk_files(directory)  # and after LMDB wrote over some of them


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damage_is_found_before_lmdb_opens_the_file(pristine, tmp_path, case):
    directory = damaged_copy(pristine, tmp_path, case)
    file = "lock.mdb" if case.startswith("lock") else "data.mdb"
    with pytest.raises(DamagedDiskFiles) as caught:
        check_disk_files(directory)
    assert caught.value.file == directory / file
    assert str(caught.value).startswith(f"{directory / file}: ")


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_tier_is_moved_aside_and_replaced(pristine, tmp_path, case):
    directory = damaged_copy(pristine, tmp_path, case)
    name = "lock.mdb" if case.startswith("lock") else "data.mdb"
    damaged = directory / name
    kind = os.lstat(damaged).st_mode & 0o170000
    content = damaged.read_bytes() if damaged.is_file() and not damaged.is_symlink() else None
    (result,) = run_in_children((open_and_use, str(directory)))
    assert result["num_hits"] == 0, "a fresh tier starts empty"
    moved_to = Path(result["moved_to"])
    assert moved_to.name.startswith("kv.damaged-") and moved_to.parent == tmp_path
    assert os.lstat(moved_to / name).st_mode & 0o170000 == kind, "the old file is kept"
    if content is not None:
        assert (moved_to / name).read_bytes() == content
    assert f"{directory} was damaged" in result["message"] and str(moved_to) in \
        result["message"]
    check_disk_files(directory)  # the fresh tier is sound


def test_random_page_damage_never_crashes_lmdb(pristine, tmp_path):
    """Seeded rounds of one to three damaged pages: either the check refuses the file, or
    LMDB opens it in a child that reads every block, writes, deletes and prunes without
    dying; the blocks it serves are byte-exact (the checksums turn damaged values into
    misses)."""
    outcomes = {"refused": 0, "opened": 0}
    rng = random.Random(18)
    for round_index in range(24):
        directory = tmp_path / f"round-{round_index}"
        copy_cache(pristine, directory)
        damage_random_pages(directory, rng, rng.randrange(1, 4))
        try:
            check_disk_files(directory)
        except DamagedDiskFiles:
            outcomes["refused"] += 1
            continue
        run_in_children((use_hard, str(directory)))
        outcomes["opened"] += 1
    assert outcomes["refused"] and outcomes["opened"], outcomes


def use_hard(path: str) -> None:
    metas, payloads = make_blocks(SMALL, 1, NUM_BLOCKS)
    with DiskTier(path, SMALL, 300 * 1200) as tier:  # a budget that prunes on the next put
        for meta, payload in zip(metas, payloads):
            got = read_back(tier, meta)
            assert got is None or same_bytes(got, payload)
        tier.delete([meta.block_hash for meta in metas[::7]])
        tier.put(*make_blocks(SMALL, 3, 40))


def test_a_tier_in_use_by_another_process_is_not_walked_and_nothing_blocks(pristine,
                                                                          tmp_path):
    """A live writer reuses free pages under a reader's feet, so the walk needs LMDB's
    exclusive lock; while another process holds the tier open, the check passes it
    unwalked (that process checked it when it opened it)."""
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        report = check_disk_files(directory)
        assert not report.checked
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(30)
    assert check_disk_files(directory).checked


HOLD = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8)
print("open", flush=True)
time.sleep(60)
"""


def _immutable(path: Path) -> bool:
    result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    return result.returncode == 0


def _mutable(*paths: Path) -> None:
    for path in paths:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)


def test_an_immutable_data_file_is_moved_aside(pristine, tmp_path):
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    if not _immutable(directory / "data.mdb"):
        pytest.skip("chattr +i is not available here (needs root and ext4 or similar)")
    try:
        (result,) = run_in_children((open_and_use, str(directory)))
        assert Path(result["moved_to"]).parent == tmp_path
        assert (Path(result["moved_to"]) / "data.mdb").exists()
    finally:
        _mutable(*tmp_path.glob("kv*/data.mdb"))


def test_when_the_parent_refuses_the_rename_the_files_move_inside(pristine, tmp_path):
    """The cache directory's parent cannot be written (here: immutable; in real life often
    root's /var/cache): the damaged files go to a directory inside the cache directory."""
    parent = tmp_path / "locked"
    directory = parent / "kv"
    parent.mkdir()
    copy_cache(pristine, directory)
    DAMAGES["branch page"](directory, random.Random(0))
    if not _immutable(parent):
        pytest.skip("chattr +i is not available here (needs root and ext4 or similar)")
    try:
        (result,) = run_in_children((open_and_use, str(directory)))
    finally:
        _mutable(parent)
    moved_to = Path(result["moved_to"])
    assert moved_to.parent == directory and moved_to.name.startswith("damaged-")
    with pytest.raises(DamagedDiskFiles):
        check_disk_files(moved_to)
    assert check_disk_files(directory).checked


def test_a_directory_nothing_can_be_written_to_turns_the_tier_off(pristine, tmp_path):
    """An immutable cache directory (as a read-only filesystem would be): nothing can be
    moved or created, so the tier is off for the run, with a warning, and the files are
    left as they were."""
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    DAMAGES["branch page"](directory, random.Random(0))
    before = (directory / "data.mdb").read_bytes()
    if not _immutable(directory):
        pytest.skip("chattr +i is not available here (needs root and ext4 or similar)")
    try:
        tier, recovery = open_disk_tier(directory, SMALL, BUDGET)
    finally:
        _mutable(directory)
    assert tier is None and recovery is not None and recovery.disk_off
    assert recovery.moved_to is None
    assert "the disk tier is off for this run" in recovery.message
    assert str(directory) in recovery.message
    assert (directory / "data.mdb").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]


def test_a_full_filesystem_turns_the_tier_off_without_a_crash(tmp_path):
    """On a full filesystem LMDB's first write to its shared, mapped lock file is a SIGBUS.
    The check reserves the lock file's blocks first, so a full disk is an error it can
    report: the tier is off for the run (here in a child, so a crash would show)."""
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                              str(mount_point)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        directory = mount_point / "kv"
        directory.mkdir(mode=0o700)
        with open(mount_point / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(bytes(1 << 16))
                    filler.flush()
            except OSError:
                pass
        (result,) = run_in_children((open_on_full_disk, str(directory)))
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)
    assert result["disk_off"] and result["moved_to"] is None
    assert "the filesystem is full" in result["message"]
    assert "the disk tier is off for this run" in result["message"]


def open_on_full_disk(path: str) -> dict:
    tier, recovery = open_disk_tier(path, SMALL, BUDGET)
    assert tier is None and recovery is not None
    return {"disk_off": recovery.disk_off, "moved_to": recovery.moved_to,
            "message": recovery.message}


def test_configuration_errors_are_still_raised(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        open_disk_tier(shared, SMALL, BUDGET)
    assert list(tmp_path.iterdir()) == [shared] and not list(shared.iterdir()), \
        "nothing was moved or created"
    with pytest.raises(ValueError, match="budget"):
        open_disk_tier(tmp_path / "kv", SMALL, 0)
