"""The LMDB schema of a disk tier directory, and the operations that keep it consistent.

    blocks  block hash -> record bytes
    access  block hash -> 8-byte big-endian access sequence number
    lru     sequence || block hash -> b""   (big-endian, so key order is age order)
    meta    b"format_version" u16, b"next_seq" / b"bytes_used" / b"budget_bytes" /
            b"key_generation" u64, b"layout:" + fingerprint -> the layout's describe() string

Every `LmdbIndex` method takes the caller's transaction; writes keep three invariants
together: a hash is in `access` iff it is in `blocks`; `lru` holds exactly one key per entry
of `access`; `bytes_used` is the sum of the lengths of the values in `blocks`;
`key_generation` grows in every transaction that adds or removes a block (processes keeping
the hashes in memory compare it, see `kvtier.tiers.disk.keys`). `DiskTier` and
the `disk_admin` functions both use this class, so the schema is written down once.
`GuardedEnv` lets threads share the environment while its map grows.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import lmdb

from kvtier.hashing import BlockHash
from kvtier.tiers.disk.check import check_disk_files
from kvtier.tiers.disk.key_changes import KeyChanges
from kvtier.tiers.disk.lmdb_value import ValueSpot, find_value

_logger = logging.getLogger(__name__)

#: Bump when the schema or the meaning of stored values changes: a directory written with
#: another version is cleared by a writer and served as empty to a reader.
DISK_FORMAT_VERSION = 1

_SEQ = struct.Struct(">Q")
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_LAYOUT_PREFIX = b"layout:"
# LMDB reports a short write at commit (what a full disk often gives) as EIO.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO)


@dataclass(slots=True)
class LmdbIndex:
    """An open LMDB environment of a disk tier and its four named databases."""

    env: lmdb.Environment
    blocks: object
    access: object
    lru: object
    meta: object

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, readonly: bool, durable: bool,
             map_size: int, mode: int, max_readers: int = 256,
             readahead: bool = True) -> LmdbIndex:
        """Open (creating unless `readonly`) the environment in directory `path`.

        No writemap (a sparse file the size of the map is a surprise on some filesystems);
        with `durable`, data pages are fsynced at commit and the meta page with the next one.
        Without `readahead` the map is advised random access: a page fault reads its page
        and nothing around it, which is what tree lookups want when values are read with
        pread (with the kernel's read-around, cold lookups faulted in pages of the values
        around their keys and took ten times as long). The files are checked first
        (`kvtier.tiers.disk.check`): LMDB itself would follow damaged pages and kill the
        process. Raises DamagedDiskFiles (an OSError) when they
        are not LMDB's or are damaged, OSError naming the file when LMDB cannot open them,
        lmdb.Error subclasses for other LMDB failures, and FileNotFoundError when a
        read-only open finds no disk tier databases.
        """
        check_disk_files(path, readonly=readonly, max_readers=max_readers)
        try:
            env = lmdb.open(os.fspath(path), map_size=map_size, subdir=True,
                            readonly=readonly, create=not readonly, lock=True, max_dbs=8,
                            max_readers=max_readers, sync=durable, metasync=False,
                            writemap=False, readahead=readahead, mode=mode)
        except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError) as exc:
            raise OSError(_damaged_message(path, str(exc))) from exc
        except lmdb.Error as exc:
            raise OSError(open_error_message(path, exc)) from exc
        try:
            _check_not_truncated(env, path)
            env.reader_check()  # drop reader slots left behind by dead processes
            dbs = _open_dbs(env, readonly)
        except lmdb.NotFoundError as exc:
            env.close()
            raise FileNotFoundError(f"{path} is an LMDB environment without kvtier's "
                                    "databases; check the path") from exc
        except BaseException:
            env.close()
            raise
        return cls(env, *dbs)

    # ---- reads ---------------------------------------------------------------------------

    def get(self, txn: lmdb.Transaction, block_hash: bytes) -> memoryview | bytes | None:
        return txn.get(block_hash, db=self.blocks)

    def has_many(self, txn: lmdb.Transaction, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is stored; reads the tree's pages, never the values (a lookup
        of a 32K-token prefix would otherwise read 4 GiB of an 8B model's KV)."""
        with txn.cursor(db=self.blocks) as cursor:
            return [cursor.set_key(h) for h in block_hashes]

    def has(self, txn: lmdb.Transaction, block_hash: bytes) -> bool:
        return self.has_many(txn, [block_hash])[0]

    def value_size(self, txn: lmdb.Transaction, block_hash: bytes) -> int | None:
        """The length of a block's stored value (None: not stored), without reading it."""
        with txn.cursor(db=self.blocks) as cursor:
            try:
                spot = find_value(cursor, block_hash)
            except ValueError:
                value = txn.get(block_hash, db=self.blocks)
                return None if value is None else len(value)
        return None if spot is None else spot.size

    def blocks_record(self, txn: lmdb.Transaction) -> bytes:
        """The `blocks` database's record in the main database (root page, depth, counts):
        where `kvtier.tiers.disk.lmdb_keys` starts a walk of its keys."""
        return bytes(txn.get(b"blocks"))

    def key_generation(self, txn: lmdb.Transaction) -> int:
        """A count that grows with every commit that adds or removes a block."""
        return self.counter(txn, "key_generation")

    def num_blocks(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self.blocks)["entries"]

    def counter(self, txn: lmdb.Transaction, name: str) -> int:
        value = txn.get(name.encode(), db=self.meta)
        return 0 if value is None else _U64.unpack(value)[0]

    def format_version(self, txn: lmdb.Transaction) -> int | None:
        value = txn.get(b"format_version", db=self.meta)
        return None if value is None or len(value) != _U16.size else _U16.unpack(value)[0]

    def layout_names(self, txn: lmdb.Transaction) -> dict[bytes, str]:
        """Layout fingerprint -> describe() string, for every layout that opened the tier."""
        names = {}
        with txn.cursor(db=self.meta) as cursor:
            if cursor.set_range(_LAYOUT_PREFIX):
                for key, value in cursor:
                    key = bytes(key)
                    if not key.startswith(_LAYOUT_PREFIX):
                        break
                    names[key[len(_LAYOUT_PREFIX):]] = bytes(value).decode()
        return names

    def access_seq(self, txn: lmdb.Transaction, block_hash: bytes) -> int | None:
        value = txn.get(block_hash, db=self.access)
        return None if value is None else _SEQ.unpack(value)[0]

    def lru_order(self, txn: lmdb.Transaction, newest_first: bool = False
                  ) -> Iterator[tuple[int, BlockHash]]:
        """(access sequence, block hash), oldest first unless `newest_first`."""
        with txn.cursor(db=self.lru) as cursor:
            items = cursor.iterprev(values=False) if newest_first else \
                cursor.iternext(values=False)
            for key in items:
                key = bytes(key)
                yield _SEQ.unpack_from(key)[0], BlockHash(key[_SEQ.size:])

    # ---- writes --------------------------------------------------------------------------

    def set_counter(self, txn: lmdb.Transaction, name: str, value: int) -> None:
        txn.put(name.encode(), _U64.pack(value), db=self.meta)

    def set_format_version(self, txn: lmdb.Transaction, version: int) -> None:
        txn.put(b"format_version", _U16.pack(version), db=self.meta)

    def set_layout_name(self, txn: lmdb.Transaction, fingerprint: bytes, name: str) -> None:
        txn.put(_LAYOUT_PREFIX + fingerprint, name.encode(), db=self.meta)

    def insert(self, txn: lmdb.Transaction, block_hash: bytes, value,
               changes: KeyChanges | None = None) -> bool:
        """Store a new value as the most recently used; False (nothing done) if present.
        `changes` records the hash when it is added."""
        return self.insert_many(txn, [(block_hash, value)], changes)[0]

    def insert_many(self, txn: lmdb.Transaction, items: Iterable[tuple[bytes, object]],
                    changes: KeyChanges | None = None,
                    seqs: Sequence[int] | None = None) -> list[bool]:
        """`insert` for (hash, value) pairs, newest last; per pair, whether it was added.
        The counters (sequence, bytes used, key generation) are read and written once for
        the whole batch, not once per value. `seqs`: each pair's access sequence number
        (increasing; an import spread over shards keeps one order across them), instead of
        the next ones."""
        added: list[bool] = []
        new: list[tuple[bytes, int, int]] = []  # (hash, value bytes, position) of those added
        for position, (block_hash, value) in enumerate(items):  # one by one: a value may be
            added.append(bool(txn.put(block_hash, value, overwrite=False,  # built just now
                                      db=self.blocks)))
            if added[-1]:
                new.append((block_hash, len(memoryview(value)), position))
        if not new:
            return added
        if seqs is None:
            first = self._next_seqs(txn, len(new))
            placed = [(block_hash, first + k) for k, (block_hash, _, _) in enumerate(new)]
        else:
            placed = [(block_hash, seqs[position]) for block_hash, _, position in new]
            self.set_counter(txn, "next_seq", max(self.counter(txn, "next_seq"),
                                                  placed[-1][1] + 1))
        for block_hash, seq in placed:
            self._set_seq(txn, block_hash, seq)
        self._add_bytes(txn, sum(size for _, size, _ in new))
        self._keys_changed(txn)
        if changes is not None:
            with txn.cursor(db=self.blocks) as cursor:
                for block_hash, _, _ in new:
                    changes.added(block_hash, _find_spot(cursor, block_hash))
        return added

    def remove(self, txn: lmdb.Transaction, block_hash: bytes,
               changes: KeyChanges | None = None) -> bool:
        """Delete a block and its access entries; False if it was not stored. `changes`
        records the hash when it is removed."""
        size = self.value_size(txn, block_hash)
        self._drop_seq(txn, block_hash)
        if size is None:
            return False
        txn.delete(block_hash, db=self.blocks)
        self._add_bytes(txn, -size)
        self._keys_changed(txn)
        if changes is not None:
            changes.removed(block_hash)
        return True

    def touch(self, txn: lmdb.Transaction, block_hashes: Sequence[bytes]) -> None:
        """Make stored blocks the most recently used, in the given order (last = newest)."""
        if not block_hashes:
            return
        first = self._next_seqs(txn, len(block_hashes))
        for offset, block_hash in enumerate(block_hashes):
            self._drop_seq(txn, block_hash)
            self._set_seq(txn, block_hash, first + offset)

    def evict(self, txn: lmdb.Transaction, num_bytes: int,
              keep: frozenset[bytes] = frozenset(),
              changes: KeyChanges | None = None) -> tuple[int, int]:
        """Remove least-recently-used blocks, except those in `keep`, until `num_bytes` are
        freed or none is left (recorded in `changes`). Returns (blocks removed, bytes freed).
        """
        victims, freed = [], 0
        with txn.cursor(db=self.lru) as cursor:
            for key in cursor.iternext(values=False):
                if freed >= num_bytes:
                    break
                block_hash = bytes(key)[_SEQ.size:]
                if block_hash in keep:
                    continue
                freed += self.value_size(txn, block_hash) or 0
                victims.append(block_hash)
        num_removed = sum(self.remove(txn, block_hash, changes) for block_hash in victims)
        return num_removed, freed

    def recount_bytes(self, txn: lmdb.Transaction) -> int:
        """Set `bytes_used` to the sum of the stored values' lengths (a scan of the blocks
        database: for repairs) and return it."""
        total = sum(len(value) for _, value in txn.cursor(db=self.blocks))
        self.set_counter(txn, "bytes_used", total)
        return total

    def reset(self, txn: lmdb.Transaction, changes: KeyChanges | None = None) -> None:
        """Delete every block and access entry; keep layout names and the sequence."""
        for db in (self.blocks, self.access, self.lru):
            txn.drop(db, delete=False)
        self.set_counter(txn, "bytes_used", 0)
        self._keys_changed(txn)
        if changes is not None:
            changes.clear()

    # ---- helpers -------------------------------------------------------------------------

    def _next_seqs(self, txn: lmdb.Transaction, count: int) -> int:
        # Sequence numbers are the wall clock in microseconds where it is ahead of the
        # counter, so that a block's last access can be shown as a time (`access_time`);
        # they still only grow, whatever the clock does.
        first = max(1, self.counter(txn, "next_seq"), time.time_ns() // 1000)
        self.set_counter(txn, "next_seq", first + count)
        return first

    def _set_seq(self, txn: lmdb.Transaction, block_hash: bytes, seq: int) -> None:
        packed = _SEQ.pack(seq)
        txn.put(block_hash, packed, db=self.access)
        txn.put(packed + block_hash, b"", db=self.lru)

    def _drop_seq(self, txn: lmdb.Transaction, block_hash: bytes) -> None:
        old = txn.get(block_hash, db=self.access)
        if old is not None:
            txn.delete(bytes(old) + block_hash, db=self.lru)
            txn.delete(block_hash, db=self.access)

    def _keys_changed(self, txn: lmdb.Transaction) -> None:
        self.set_counter(txn, "key_generation", self.key_generation(txn) + 1)

    def _add_bytes(self, txn: lmdb.Transaction, delta: int) -> None:
        total = self.counter(txn, "bytes_used") + delta
        if total < 0:
            # Only values changed outside kvtier (another program, a damaged file) make the
            # counter disagree with them: count them again instead of failing every write.
            self.recount_bytes(txn)
            return
        self.set_counter(txn, "bytes_used", total)


#: Access sequence numbers from this value up are microseconds since the epoch (2001 on).
_FIRST_TIMED_SEQ = 10**15


def access_time(seq: int) -> float | None:
    """The time (seconds since the epoch) of an access sequence number, or None for one
    written before sequence numbers were times."""
    return seq / 1e6 if seq >= _FIRST_TIMED_SEQ else None


class _ResizeGate:
    """Many transactions at once, or one map resize alone (waiting resizes go first).

    LMDB may only resize the map while no transaction of this process is open.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_active = 0
        self._num_waiting = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing or self._num_waiting:
                self._cond.wait()
            self._num_active += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_active -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._num_waiting += 1
            while self._resizing or self._num_active:
                self._cond.wait()
            self._num_waiting -= 1
            self._resizing = True
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


class DiskFilesGone(OSError):
    """data.mdb was removed, replaced or cut short while the tier had it open: the tier is
    set aside (LMDB following its map past the end of a shorter file would be a SIGBUS)."""


class DataFileWatch:
    """Notices data.mdb removed, replaced or cut short under an open environment.

    LMDB never shrinks its data file, and every page it reads lies below the end the file
    had when the page was written; so while the file keeps its inode and is no shorter
    than the largest size seen, no read of the map can fault past its end. `check` costs
    two stat calls. The window between a check and the reads that follow it is not closed
    (a cut in that window still faults): a check runs before every transaction.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        info = os.fstat(self._fd)
        self._identity = (info.st_dev, info.st_ino)
        self._size = info.st_size
        # Checks run on several threads while writers grow the file: a size read before
        # another thread recorded a larger one would look like a cut. Under the lock each
        # check reads a size no smaller than every size recorded before it.
        self._lock = threading.Lock()

    def check(self) -> str | None:
        """None while the file is intact, else what happened to it (a sentence fragment).
        Thread-safe."""
        with self._lock:
            return self._check()

    def _check(self) -> str | None:
        info = os.fstat(self._fd)
        if info.st_nlink == 0:
            return "data.mdb was removed"
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return "data.mdb was removed"
        except OSError:
            named = info  # the directory cannot be searched now: judge by the open file
        if (named.st_dev, named.st_ino) != self._identity:
            return "data.mdb was replaced by another file"
        if info.st_size < self._size:
            return f"data.mdb was cut from {self._size} to {info.st_size} bytes"
        self._size = max(self._size, info.st_size)
        return None

    def close(self) -> None:
        os.close(self._fd)


class GuardedEnv:
    """An LMDB environment whose map grows on demand while threads use it.

    LMDB may only resize the map while no transaction of this process is open, so every
    transaction is taken through `txn()` inside a gate that a resize closes. `map_limit`
    caps growth (bytes). With a `watch` on data.mdb, every transaction and resize is
    preceded by its check; once it fails, `gone` says why and every later call raises
    DiskFilesGone without touching the map.
    """

    def __init__(self, env: lmdb.Environment, map_limit: int,
                 watch: DataFileWatch | None = None) -> None:
        self.env = env
        self.map_limit = map_limit
        self.closed = False
        self.gone: str | None = None
        self._watch = watch
        self._path = env.path()
        self._gate = _ResizeGate()
        self._page_size = env.stat()["psize"]

    def check_files(self) -> None:
        """Raise DiskFilesGone if data.mdb was removed, replaced or cut short."""
        if self.gone is None and self._watch is not None:
            problem = self._watch.check()
            if problem is not None and self.gone is None:
                self.gone = problem
                _logger.warning("disk cache %s: %s while in use; the disk tier is set aside "
                                "for this run (requests go on without it; a restart opens "
                                "a fresh one)", self._path, problem)
        if self.gone is not None:
            raise DiskFilesGone(errno.ENOENT, f"disk cache {self._path}: {self.gone}")

    @contextmanager
    def txn(self, write: bool = False) -> Iterator[lmdb.Transaction]:
        """A transaction (buffers=True); adopts a map grown by another process. Raises
        ValueError once closed, DiskFilesGone once data.mdb is gone."""
        for _ in range(8):
            with self._gate.shared():
                if self.closed:
                    raise ValueError(f"disk cache {self._path} is closed")
                self.check_files()
                try:
                    txn = self.env.begin(write=write, buffers=True)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            with self._gate.exclusive():
                self.env.set_mapsize(0)
        raise OSError(f"disk cache {self._path}: the LMDB map keeps being resized by "
                      "another process; retry later")

    def sync(self) -> None:
        """Put every transaction committed before the call on the disk (`mdb_env_sync`,
        forced: one fdatasync of data.mdb, whatever `sync` the environment was opened with).

        Safe beside write transactions: mdb_env_sync takes none of LMDB's locks, and the
        answer to "Correct use of mdb_env_sync" on the openldap-technical list (2015-12)
        describes it as a plain fsync of the data file that does not interact with
        transactions and may run concurrently with itself; what was committed before it
        began is on the disk when it returns, a commit during it by this sync or the next.
        py-lmdb's C extension (what kvtier runs) releases the GIL and takes no lock of its
        own around the call: commits of other threads went on during a sync when checked
        with py-lmdb 3.0. Its cffi fallback instead holds a per-environment lock that its
        transactions take too, so there a writer would wait for the sync. It runs inside
        the gate all the same: it reads the meta pages through the map to
        choose the one in use, so neither a resize (a remap) nor `close` may run meanwhile.
        A resize that waits for it holds up new transactions until it returns; resizes
        double the map, so that happens a few times in a tier's life. Raises ValueError
        once closed, DiskFilesGone once data.mdb is gone, lmdb.Error when the flush fails.
        """
        with self._gate.shared():
            if self.closed:
                raise ValueError(f"disk cache {self._path} is closed")
            self.check_files()
            self.env.sync(True)

    @property
    def map_size(self) -> int:
        """The map's size in bytes now."""
        self.check_files()
        return self.env.info()["map_size"]

    def grow(self, num_bytes: int, full: bool = False, failed_at: int | None = None) -> bool:
        """Grow the map (doubling, up to its limit) when it is `full` or has less than twice
        `num_bytes` left past the last used page: growing before a write transaction is
        cheaper than aborting it. `failed_at`: the map size a transaction that ran out of
        map saw; when another thread has grown the map since, it is not grown again (retry
        the write). False when the map cannot grow."""
        self.check_files()  # `info` reads the meta pages through the map
        info = self.env.info()
        room = info["map_size"] - (info["last_pgno"] + 1) * self._page_size
        if not full and room >= 2 * num_bytes:
            return True
        with self._gate.exclusive():
            self.check_files()
            current = self.env.info()["map_size"]
            if failed_at is not None and current > failed_at:
                # Writers that failed together must not each double the map, or the last
                # of them finds it at its limit and prunes blocks that had room.
                return True
            if current >= self.map_limit:
                return False
            target = max(current * 2, current - room + 2 * num_bytes)
            self.env.set_mapsize(min(self.map_limit, target))
            return True

    def close(self) -> None:
        """Close the environment once no transaction is open. Safe to call twice."""
        with self._gate.exclusive():
            if not self.closed:
                self.closed = True
                self.env.close()
                if self._watch is not None:
                    self._watch.close()


def _damaged_message(path: str | os.PathLike[str], detail: str) -> str:
    return (f"{path} is not a kvtier disk cache or its files are damaged ({detail}); "
            "remove the directory (its blocks are only a cache) or choose another one")


def open_error_message(path: str | os.PathLike[str], exc: lmdb.Error) -> str:
    """A sentence for an LMDB failure to open the files in `path`: which file, and the
    operating system's reason without LMDB's "path: " prefix."""
    reason = str(exc)
    prefix = os.fspath(path)
    for candidate in (os.path.join(prefix, "data.mdb"), os.path.join(prefix, "lock.mdb"),
                      prefix):
        if reason.startswith(candidate + ":"):
            reason = reason[len(candidate) + 1:].strip()
            break
    return (f"LMDB cannot open the disk cache files in {path} ({reason}); check that "
            "data.mdb and lock.mdb there are kvtier's, readable and writable")


def _check_not_truncated(env: lmdb.Environment, path: str | os.PathLike[str]) -> None:
    """LMDB maps the data file and reads its pages in place: a page past the end of a file
    that was cut short kills the process with SIGBUS. Refuse such a file up front."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = os.stat(os.path.join(os.fspath(path), "data.mdb")).st_size
    if size < needed:
        raise OSError(_damaged_message(path, f"data.mdb has {size} bytes but its pages "
                                             f"need {needed}: the file was cut short"))


def _find_spot(cursor: lmdb.Cursor, block_hash: bytes) -> ValueSpot | None:
    """Where a value just put lies (its overflow pages are numbered at the put); None when
    the node is not LMDB's layout."""
    try:
        return find_value(cursor, block_hash)
    except ValueError:
        return None


def is_disk_full(exc: lmdb.Error) -> bool:
    """Whether an LMDB error is a failed write to the disk: full, over a size limit or a
    short write (ENOSPC, EFBIG, EDQUOT, EIO). The commit is then rolled back."""
    code = exc.args[1] if len(exc.args) > 1 else None
    return code in _DISK_FULL_ERRNOS or any(os.strerror(e) in str(exc)
                                            for e in _DISK_FULL_ERRNOS)


def _open_dbs(env: lmdb.Environment, readonly: bool) -> list:
    """kvtier's named databases. Another process may grow the map between our open and
    this first transaction (MDB_MAP_RESIZED): adopt its size and try again."""
    for _ in range(8):
        try:
            return [env.open_db(name, create=not readonly)
                    for name in (b"blocks", b"access", b"lru", b"meta")]
        except lmdb.MapResizedError:
            env.set_mapsize(0)
    raise OSError("the LMDB map keeps being resized by another process; retry later")
