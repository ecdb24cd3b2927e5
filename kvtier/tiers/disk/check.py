"""Checks a disk tier directory's files before LMDB is allowed to open them.

LMDB maps `data.mdb` and follows the page numbers it finds there without checking them: it
keeps no checksums of its own pages. A damaged branch, leaf or meta page, or a file cut
short, can point a read past the end of the file (SIGBUS) or outside the map (SIGSEGV), and
a damaged free list can make a later write overwrite live pages. No Python handler can turn
a signal into an error, so the files are checked first, here, by reading them with plain
`pread` calls (never through a memory map): whatever the bytes are, the worst this code can
do is raise. It checks

  * that `data.mdb` and `lock.mdb` are regular files (not a FIFO, device, directory or
    symbolic link), with `lstat` and `O_NOFOLLOW | O_NONBLOCK`, so nothing blocks;
  * that `lock.mdb` is LMDB's (empty, zeroed, or starting with LMDB's magic number);
  * the whole B-tree of the meta page LMDB will use (`kvtier.tiers.disk.lmdb_tree`): every page
    and offset LMDB would follow, every value's overflow pages, and the free list.

The check runs only while no other process has the environment open (it takes LMDB's own
exclusive lock on `lock.mdb` meanwhile, so other processes wait): a live writer reuses free
pages under the reader's feet, and a process that has the files open already checked them.
It reads the tree pages only (values are checked by their own checksums when read), about
4 KiB per branch or leaf page and 16 bytes per value: figures in `docs/RELIABILITY.md`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.disk.lmdb_tree import MDB_MAGIC, LmdbTreeDamage, check_lmdb_tree

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"

_U32 = struct.Struct("<I")
_LOCK_SLOT_BYTES = 64  # LMDB's reader slot (one cache line); its header takes two more


class DamagedDiskFiles(OSError):
    """A disk tier's file is not what LMDB would write: `file` names it, `problem` says
    what is wrong (a sentence fragment, e.g. "page 3 is not a B-tree page")."""

    def __init__(self, file: Path, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file
        self.problem = problem


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What `check_disk_files` looked at. `checked` is False when another process had the
    environment open (the structure was then not walked); counts are pages and values."""

    checked: bool
    file_bytes: int
    num_tree_pages: int
    num_values: int
    num_free_pages: int


def check_disk_files(path: str | os.PathLike[str], *, readonly: bool = False,
                     max_readers: int = 256) -> CheckReport:
    """Check the LMDB files in directory `path` (see the module docstring).

    Unless `readonly`, the lock file is also given its disk blocks for `max_readers`
    reader slots: LMDB maps it shared and writes to it, and a write to a page the
    filesystem has no room for is a SIGBUS, so a full filesystem must be found here.
    A missing `data.mdb` passes (a new cache). Raises DamagedDiskFiles naming the file and
    the problem, OSError (ENOSPC) when the lock file cannot be allocated, and OSError when
    a file cannot be read at all (e.g. EIO). Never blocks on a FIFO; waits for nothing but
    the other processes' opens of the same directory.
    """
    root = Path(path)
    data_file, lock_file = root / DATA_FILE, root / LOCK_FILE
    for file in (data_file, lock_file):
        _check_kind(file)
    with _exclusive(lock_file, readonly) as (alone, lock_fd):
        if lock_file.exists() and alone:
            _check_lock_file(lock_file)
        if lock_fd is not None and alone and not readonly:
            _allocate(lock_fd, lock_file, _LOCK_SLOT_BYTES * (max_readers + 8))
        if not data_file.exists():
            return CheckReport(alone, 0, 0, 0, 0)
        fd = _open_regular(data_file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not alone:
                return CheckReport(False, size, 0, 0, 0)
            try:
                tree = check_lmdb_tree(fd, size)
            except LmdbTreeDamage as exc:
                raise DamagedDiskFiles(data_file, str(exc)) from None
            return CheckReport(True, size, tree.num_tree_pages, tree.num_values,
                               tree.num_free_pages)
        finally:
            os.close(fd)


# ---- kinds of files ---------------------------------------------------------------------


def _describe_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _check_kind(file: Path) -> None:
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode):
        return
    kind = _describe_kind(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        kind += f" to {os.readlink(file)}" + ("" if file.exists() else " (which is missing)")
    raise DamagedDiskFiles(file, f"it is {kind}, not a regular file (LMDB only "
                                 "ever writes regular files there)")


def _open_regular(file: Path, flags: int) -> int:
    """Open without following a link or blocking on a FIFO; raise unless a regular file."""
    try:
        fd = os.open(file, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise DamagedDiskFiles(file, "it is not a regular file") from exc
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DamagedDiskFiles(file, f"it is {_describe_kind(mode)}, not a regular file")
    return fd


def _allocate(fd: int, file: Path, num_bytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # cannot reserve blocks here; LMDB goes on as it always did
        raise OSError(exc.errno, f"no room for LMDB's lock file {file} ({exc.strerror}): "
                                 "the filesystem is full") from exc


@contextmanager
def _exclusive(lock_file: Path, readonly: bool) -> Iterator[tuple[bool, int | None]]:
    """Hold LMDB's exclusive lock (a write lock on byte 0 of lock.mdb, which every process
    with the environment open holds shared); yield whether we got it, and our descriptor
    (None without one). POSIX locks belong to the process and closing any of its
    descriptors of the file drops them all, so a lock file this process already has open
    is not touched (yields False)."""
    if _open_in_this_process(lock_file):
        # Opening and closing lock.mdb here would drop the locks LMDB holds through its
        # own descriptor: leave it alone. (Opening an environment twice in one process is
        # against LMDB's rules anyway; the LMDB open that follows will say so.)
        yield False, None
        return
    try:
        fd = _open_regular(lock_file, os.O_RDWR | (0 if readonly else os.O_CREAT))
    except (FileNotFoundError, PermissionError):
        # No lock file: nobody has it open; read-only: cannot lock, check anyway.
        yield True, None
        return
    try:
        yield _try_lock(fd), fd
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take the write lock on byte 0; False when another process holds a lock there."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        # A filesystem without POSIX locks: nobody can hold LMDB's lock; check anyway.
    return True


def _open_in_this_process(file: Path) -> bool:
    """Whether a descriptor of this process already refers to `file` (Linux: /proc)."""
    try:
        target = os.stat(file)
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        try:
            info = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def _check_lock_file(lock_file: Path) -> None:
    fd = _open_regular(lock_file, os.O_RDONLY)
    try:
        head = os.pread(fd, _U32.size, 0)
    finally:
        os.close(fd)
    # Empty or zeroed: created but not yet set up (LMDB sets it up on open).
    if len(head) == _U32.size and head != bytes(4) and _U32.unpack(head)[0] != MDB_MAGIC:
        raise DamagedDiskFiles(lock_file, "it does not start with LMDB's magic number, so "
                                          "it is not LMDB's lock file")
