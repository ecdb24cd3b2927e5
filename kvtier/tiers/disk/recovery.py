"""Keep serving when a disk tier's files are damaged: move them aside, start afresh.

A disk tier is a cache, so a damaged one must not stop the engine. `open_disk_tier` opens
the tier; when its files cannot be opened or fail their check (`kvtier.tiers.disk.check`),
it moves them aside, never deleting them (the user may want them), creates a fresh tier in
their place and logs a warning saying what was wrong and where the old files went. When
even that fails (a read-only or full filesystem), the engine runs without the disk tier
and says so. `kvtier cache verify --repair` uses the same `move_aside`.

Errors of configuration, not of the files (a budget that is not positive, a cache directory
owned by another user or writable by others, a file where the directory should be), are
still raised: they are the caller's to fix, and guessing would hide them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvtier.fsutil import PRIVATE_DIR_MODE, ensure_private_dir
from kvtier.layout import KVLayout
from kvtier.tiers.disk.check import DATA_FILE, LOCK_FILE
from kvtier.tiers.disk.index import is_disk_full
from kvtier.tiers.disk.shard_layout import check_shard_count, existing_shards, shard_dirs
from kvtier.tiers.disk.shards import ShardedDiskTier
from kvtier.tiers.disk.tier import DiskTier

logger = logging.getLogger(__name__)

# Failures that say nothing about the files: moving them aside would not help.
_NOT_THE_FILES = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENOMEM, errno.EMFILE,
                  errno.ENFILE)


@dataclass(frozen=True, slots=True)
class DiskRecovery:
    """What `open_disk_tier` did about a disk tier it could not open as it was.

    path: the disk tier directory. problem: what was wrong (a sentence). moved_to: where
    the old files went (None when they could not be or need not be moved). disk_off: the
    disk tier is off for this run. message: the warning that was logged.
    """

    path: Path
    problem: str
    moved_to: Path | None
    disk_off: bool
    message: str


def open_disk_tier(path: str | os.PathLike[str], layout: KVLayout, budget_bytes: int, *,
                   shards: int = 1, tier_class: type[DiskTier] = DiskTier, **options: object
                   ) -> tuple[DiskTier | ShardedDiskTier | None, DiskRecovery | None]:
    """The disk tier in `path` (see `DiskTier` for `options`), recovering from damaged files.
    `tier_class` builds it, or each of its shards (DiskTier or a subclass). `shards`: how
    many LMDB environments a new directory is split over (`kvtier.tiers.disk.shards`); an
    existing directory keeps the count it was written with. Each shard recovers on its own
    (its files moved aside, the others kept); when one cannot be opened at all, the disk
    tier is off.

    Returns (tier, None) when the files opened as they were; (a fresh tier, recovery)
    when they were moved aside (for shards, the first shard's; each one's is logged);
    (None, recovery) when the disk tier had to be turned off.
    Raises ValueError for a bad budget or shard count and for a directory of mixed or
    incomplete shards, and the errors of `ensure_private_dir` for a directory that is not
    safe to use (another owner, writable by others, a file).
    """
    root = Path(path).expanduser().absolute()
    check_shard_count(shards)
    try:
        ensure_private_dir(root)
    except OSError as exc:
        if not _cannot_write(root, exc):
            raise
        return None, _turn_off(root, str(exc).split(";")[0], "nothing can be written there")
    count = existing_shards(root) or shards
    if count == 1:
        return _open_one(root, layout, budget_bytes, tier_class, options)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
            or budget_bytes < count:
        raise ValueError(f"budget_bytes must be an integer of at least one byte per shard "
                         f"({count}), got {budget_bytes!r}")
    opened: list[DiskTier] = []
    recoveries: list[DiskRecovery] = []
    try:
        for shard_dir in shard_dirs(root, count):
            tier, recovery = open_disk_tier(shard_dir, layout, budget_bytes // count,
                                            tier_class=tier_class, **options)
            recoveries += [recovery] if recovery is not None else []
            if tier is None:
                for done in opened:
                    done.close()
                return None, recovery
            opened.append(tier)
    except BaseException:
        for done in opened:
            done.close()
        raise
    return ShardedDiskTier(root, opened), (recoveries[0] if recoveries else None)


def _open_one(root: Path, layout: KVLayout, budget_bytes: int, tier_class: type[DiskTier],
              options: dict[str, object]) -> tuple[DiskTier | None, DiskRecovery | None]:
    """`open_disk_tier` for one environment in `root` (which exists)."""
    try:
        return tier_class(root, layout, budget_bytes, **options), None
    except (OSError, lmdb.Error) as exc:
        problem = _sentence(exc)
        lmdb_error = exc if isinstance(exc, lmdb.Error) else exc.__cause__
        if _errno(exc) in _NOT_THE_FILES or (isinstance(lmdb_error, lmdb.Error)
                                             and is_disk_full(lmdb_error)):
            code = _errno(exc)
            why = os.strerror(code).lower() if code else "the disk is full or failing"
            return None, _turn_off(root, problem, why)
    try:
        moved_to = move_aside(root)
    except OSError as exc:
        return None, _turn_off(root, problem, f"moving them aside failed: {_sentence(exc)}")
    try:
        tier = tier_class(root, layout, budget_bytes, **options)
    except (OSError, lmdb.Error) as exc:
        return None, _turn_off(root, problem, f"the files were moved to {moved_to}, but a "
                                              f"fresh cache could not be created: "
                                              f"{_sentence(exc)}", moved_to)
    message = (f"disk cache {root} was damaged: {problem}. kvtier moved its files to "
               f"{moved_to} (kept, not deleted: remove them when you no longer need them) "
               "and started an empty disk cache in its place")
    logger.warning(message)
    return tier, DiskRecovery(root, problem, moved_to, False, message)


def move_aside(path: str | os.PathLike[str]) -> Path:
    """Move a disk tier's files out of the way, deleting nothing; where they went.

    The directory is renamed to `<path>.damaged-<UTC time>` next to it, and an empty
    private directory made in its place. When the parent directory cannot take the rename
    (not writable, or `path` is a mount point), `data.mdb` and `lock.mdb` are moved into
    `<path>/damaged-<UTC time>/` instead. Raises OSError when neither works.
    """
    root = Path(path).expanduser().absolute()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = _free_name(root.with_name(f"{root.name}.damaged-{stamp}"))
    try:
        os.rename(root, target)
    except OSError as rename_error:
        inner = _free_name(root / f"damaged-{stamp}")
        try:
            os.mkdir(inner, PRIVATE_DIR_MODE)
            for name in (DATA_FILE, LOCK_FILE):
                if os.path.lexists(root / name):
                    os.rename(root / name, inner / name)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot rename {root} ({rename_error.strerror}) nor "
                                     f"move its files into {inner} ({exc.strerror})") from exc
        return inner
    ensure_private_dir(root)
    return target


def _free_name(candidate: Path) -> Path:
    for suffix in range(1000):
        name = candidate if suffix == 0 else candidate.with_name(f"{candidate.name}-{suffix}")
        if not os.path.lexists(name):
            return name
    raise OSError(errno.EEXIST, f"{candidate} and 999 numbered names beside it exist")


def _turn_off(root: Path, problem: str, why: str,
              moved_to: Path | None = None) -> DiskRecovery:
    message = (f"disk cache {root} cannot be used: {problem}. It could not be replaced "
               f"with a fresh one ({why}); the disk tier is off for this run (the GPU and "
               "host tiers still work)")
    logger.warning(message)
    return DiskRecovery(root, problem, moved_to, True, message)


def _errno(exc: BaseException) -> int | None:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        if isinstance(exc, lmdb.Error) and len(exc.args) > 1 and isinstance(exc.args[1], int):
            return exc.args[1]
        exc = exc.__cause__
    return None


def _sentence(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc)
    return text.rstrip(".")


def _cannot_write(path: Path, exc: OSError) -> bool:
    """Whether `exc` (from `ensure_private_dir`) only says that nothing can be written: a
    read-only filesystem, or a safe directory of ours that refuses writes (its mode, an
    immutable flag). A directory that is unsafe (another owner, writable by others) or not
    a directory is a configuration error instead."""
    if exc.errno == errno.EROFS:
        return True
    existing = path
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    try:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return True
        info = os.stat(existing)
    except OSError:
        return False
    return (existing == path and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            and not os.access(path, os.W_OK | os.X_OK))
