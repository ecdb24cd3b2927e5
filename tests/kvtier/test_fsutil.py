"""Private cache directories: created owner-only, and refused when others could plant files."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.fsutil import ensure_private_dir, private_file_mode

NOBODY = 65534
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_creates_missing_parents_owner_only(tmp_path, umask_022):
    target = tmp_path / "a" / "b" / "cache"
    assert ensure_private_dir(target) == target
    for directory in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert mode(directory) == 0o700
    # Existing and fine: used as is, mode untouched.
    (tmp_path / "mine").mkdir(mode=0o755)
    assert ensure_private_dir(tmp_path / "mine") == tmp_path / "mine"
    assert mode(tmp_path / "mine") == 0o755


def test_relative_and_user_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ensure_private_dir("rel") == tmp_path / "rel"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ensure_private_dir("~/home-cache") == tmp_path / "home-cache"


def test_missing_without_create(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ensure_private_dir(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()


def test_refuses_a_file_or_a_file_parent(tmp_path):
    file_path = tmp_path / "plain"
    file_path.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        ensure_private_dir(file_path)
    with pytest.raises(NotADirectoryError, match="is a file"):
        ensure_private_dir(file_path / "below")


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o702])
def test_refuses_group_or_world_writable(tmp_path, bits):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(bits)
    with pytest.raises(PermissionError, match="chmod go-w"):
        ensure_private_dir(shared)


@pytest.mark.skipif(not IS_ROOT, reason="only root can give a directory to another user")
def test_refuses_a_directory_owned_by_someone_else(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        ensure_private_dir(theirs)


def test_refuses_a_directory_it_cannot_write(tmp_path):
    if not IS_ROOT:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(PermissionError, match="not writable"):
                ensure_private_dir(locked)
        finally:
            locked.chmod(0o700)
        return
    # Root writes anywhere, so check as an ordinary user that owns a read-only directory.
    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o500)
        os.chown(locked, NOBODY, NOBODY)
        # The child loads fsutil.py alone (it needs only the standard library), not the
        # kvtier package, which would import torch.
        fsutil_file = Path(__file__).resolve().parents[2] / "kvtier" / "fsutil.py"
        probe = ("import importlib.util, sys\n"
                 "spec = importlib.util.spec_from_file_location('fsutil', sys.argv[2])\n"
                 "fsutil = importlib.util.module_from_spec(spec)\n"
                 "spec.loader.exec_module(fsutil)\n"
                 "try:\n    fsutil.ensure_private_dir(sys.argv[1])\n"
                 "except PermissionError as exc:\n    print('refused:', exc)\n")
        result = None
        # The test's interpreter may live where the unprivileged user cannot go.
        for python in (sys.executable, "/usr/bin/python3"):
            try:
                result = subprocess.run([python, "-I", "-c", probe, str(locked),
                                         str(fsutil_file)], user=NOBODY, capture_output=True,
                                        text=True, timeout=60, cwd=base, check=False)
            except (PermissionError, FileNotFoundError):
                continue
            if "Permission denied" not in result.stderr:
                break
        if result is None or "Permission denied" in result.stderr:
            pytest.skip("no Python interpreter or checkout the unprivileged user can read")
        assert result.returncode == 0, result.stderr
        assert "refused:" in result.stdout and "not writable" in result.stdout
    finally:
        for path in (base / "locked", base):
            path.chmod(0o700)
            path.rmdir()


def test_private_file_mode(tmp_path, umask_022):
    file_path = tmp_path / "export.bin"
    file_path.write_bytes(b"kv")
    assert mode(file_path) == 0o644
    private_file_mode(file_path)
    assert mode(file_path) == 0o600
    with pytest.raises(FileNotFoundError):
        private_file_mode(tmp_path / "missing")


def test_a_read_only_filesystem_is_named_as_such(tmp_path):
    # Root may write any directory, so only the filesystem refuses: the error must say that,
    # not blame the directory's mode.
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs",
                              str(mount_point)], capture_output=True, text=True) \
        if IS_ROOT else None
    if mounted is None or mounted.returncode != 0:
        pytest.skip("needs root and a tmpfs mount to make a read-only filesystem")
    try:
        with pytest.raises(PermissionError, match="read-only filesystem") as raised:
            ensure_private_dir(mount_point)
        assert raised.value.errno == errno.EROFS
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
