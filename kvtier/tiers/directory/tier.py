"""The directory tier: KV blocks as files of a plain directory, one per block.

A file is named by its block hash and holds the block's record, the same self-checking
format as the disk and remote tiers' (`kvtier.tiers.record`: magic, version, layout
fingerprint, parent hash, token ids, checksum), validated the same way on every read: a
file that fails any check is a miss, counted, and deleted. A file appears whole or not at
all (written beside its final name, then renamed), so a crash leaves no half-written block.

It has no budget and no eviction: it is the smallest real tier, the example of what a tier
below the host takes (docs/ARCHITECTURE.md, "Adding a tier"), and a store for tests and for
directories that something else cleans. Several processes may share the directory.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.fsutil import PRIVATE_FILE_MODE, ensure_private_dir
from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.record import (
    BlockBuffer,
    BlockMeta,
    CorruptRecord,
    assemble_record,
    dest_array,
    payload_view,
    read_record_into,
    record_size,
)

logger = logging.getLogger(__name__)

#: The suffix of a block's file (a file being written has `.tmp` after it).
SUFFIX = ".kvblock"


@dataclass(frozen=True, slots=True)
class DirectoryStats:
    """Counters of one DirectoryTier: files in the directory (any process's), and this
    object's verified reads, misses (`rejected` among them: files that failed validation and
    were deleted), blocks written and blocks it could not write."""

    num_blocks: int
    hits: int
    misses: int
    rejected: int
    puts: int
    refused: int


class DirectoryTier(LowerTier):
    """Blocks of one `layout` as files in `path` (created with mode 0o700 when missing).

    As a `LowerTier`: a local store the host writes back to, looked up with one file system
    call per block. Thread-safe. Raises the errors of `kvtier.fsutil.ensure_private_dir` for
    a directory that is not safe to use, and ValueError for a payload of the wrong size.
    """

    name = "directory"
    kind = Tier.DISK
    write_policy = WritePolicy.WRITE_BACK
    lookup_is_local = True

    def __init__(self, path: str | os.PathLike[str], layout: KVLayout) -> None:
        self.path = ensure_private_dir(path)
        self.layout = layout
        self._fingerprint = layout.fingerprint()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("hits", "misses", "rejected", "puts", "refused"), 0)

    def file_of(self, block_hash: BlockHash) -> Path:
        """The file that holds `block_hash`'s record."""
        return self.path / (block_hash.hex() + SUFFIX)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        return [self.file_of(block_hash).is_file() for block_hash in block_hashes]

    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        if len(metas) != len(dests):
            raise ValueError(f"{len(metas)} metas but {len(dests)} destinations")
        results = [self._read_into(meta, dest_array(dest, self.layout.bytes_per_block))
                   for meta, dest in zip(metas, dests)]
        num_hits = sum(results)
        self._count(hits=num_hits, misses=len(metas) - num_hits)
        return results

    def _read_into(self, meta: BlockMeta, array) -> bool:
        file = self.file_of(meta.block_hash)
        try:
            record = file.read_bytes()
        except OSError:  # missing (deleted meanwhile) or unreadable: a miss
            return False
        try:
            read_record_into(record, meta, self._fingerprint, array)
        except CorruptRecord as exc:
            logger.info("directory tier: rejecting %s (%s); deleting it", file, exc)
            self._count(rejected=1)
            file.unlink(missing_ok=True)
            return False
        return True

    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        if len(metas) != len(payloads):
            raise ValueError(f"{len(metas)} metas but {len(payloads)} payloads")
        views = [payload_view(p, self.layout.bytes_per_block) for p in payloads]
        return [self._write(meta, view) for meta, view in zip(metas, views)]

    def _write(self, meta: BlockMeta, view: memoryview) -> bool:
        file = self.file_of(meta.block_hash)
        if file.is_file():
            return True
        record = assemble_record(meta, self.layout, view,
                                 bytearray(record_size(meta, view.nbytes)))
        # A name of this thread's own: two writers of one block never share a temp file.
        temp = file.with_name(f"{file.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
            with open(fd, "wb") as out:
                out.write(record)
            os.replace(temp, file)
        except OSError as exc:  # a full or broken disk: the block is not stored
            logger.warning("directory tier: could not write %s: %s", file, exc)
            temp.unlink(missing_ok=True)
            self._count(refused=1)
            return False
        self._count(puts=1)
        return True

    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        num_deleted = 0
        for block_hash in block_hashes:
            try:
                self.file_of(block_hash).unlink()
                num_deleted += 1
            except FileNotFoundError:
                pass
        return num_deleted

    def stats(self) -> DirectoryStats:
        num_blocks = sum(1 for _ in self.path.glob("*" + SUFFIX))
        with self._lock:
            return DirectoryStats(num_blocks=num_blocks, **self._counts)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""
