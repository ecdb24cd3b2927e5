"""Private directories and files for cached KV blocks.

KV blocks are a readable trace of other users' prompts, so the disk tier lives in a directory
only its owner can write (and, when kvtier creates it, only its owner can read). A directory
someone else owns or can write into is refused: they could plant blocks that we would serve.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def ensure_private_dir(path: str | os.PathLike[str], create: bool = True) -> Path:
    """Return `path` as an absolute Path to a directory that only the caller can write.

    Missing directories (parents included) are created with mode 0o700 when `create` is true.
    An existing directory is used as it is if it passes the checks; its mode is not changed.

    Raises FileNotFoundError when it is missing and `create` is false, NotADirectoryError when
    it (or a parent) is a file, and PermissionError when it is owned by another user, is
    group- or world-writable, or is not writable by the caller. Each message says what to do.
    """
    target = Path(path).expanduser().absolute()
    if not target.exists():
        if target.is_symlink():
            raise FileNotFoundError(f"{target} is a dangling symbolic link; remove it or "
                                    "point it at a directory")
        if not create:
            raise FileNotFoundError(f"{target} does not exist; create it or pass a "
                                    "directory that holds a kvtier disk cache")
        _make_dirs(target)
    check_private_dir(target)
    return target


def check_private_dir(path: Path) -> None:
    """Raise (as `ensure_private_dir` does) unless `path` is a private, writable directory."""
    try:
        info = os.stat(path)
    except NotADirectoryError as exc:
        raise NotADirectoryError(f"{path}: a parent of it is a file, not a directory; "
                                 "choose another cache path") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} is a file, not a directory; pass a directory path "
                                 "for the disk cache (it holds LMDB's data and lock files)")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by you (uid "
                              f"{os.geteuid()}); use a directory you own for the cache")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is writable by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):#o}), so others could plant "
                              f"blocks; run `chmod go-w {path}` or choose another directory")
    if not os.access(path, os.W_OK | os.X_OK):
        if _on_read_only_filesystem(path):
            error = PermissionError(f"{path} is on a read-only filesystem; remount it "
                                    "read-write or choose a directory on a writable one")
            error.errno = errno.EROFS
            raise error
        raise PermissionError(f"{path} is not writable by you (mode "
                              f"{stat.S_IMODE(info.st_mode):#o}); run `chmod u+rwx {path}` "
                              "or choose another directory")


def _on_read_only_filesystem(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def private_file_mode(path: str | os.PathLike[str]) -> None:
    """Set an existing file we own to mode 0o600 (owner read/write only).

    Raises FileNotFoundError if it is missing and PermissionError if another user owns it.
    """
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {info.st_uid}, not by you; "
                              "use a file you own")
    if stat.S_IMODE(info.st_mode) != PRIVATE_FILE_MODE:
        os.chmod(path, PRIVATE_FILE_MODE)


def _make_dirs(target: Path) -> None:
    # os.makedirs applies `mode` to the leaf only; every directory we create must be private.
    missing = []
    current = target
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    if current.exists() and not current.is_dir():
        raise NotADirectoryError(f"{current} is a file, so {target} cannot be created under "
                                 "it; choose another cache path")
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # created concurrently; check_private_dir judges it
        # The umask may have removed bits we want (never added any): set the mode exactly.
        os.chmod(directory, PRIVATE_DIR_MODE)
