"""A disk tier split by block hash over several LMDB environments, written in parallel.

LMDB runs one write transaction at a time per environment, and py-lmdb copies every value
into pages of its own before the commit writes them, so one environment takes blocks more
slowly than the page cache would and than a large model's prefill makes them
(docs/BENCHMARKS.md, "The disk tier's writers"). Several environments commit side by side
(py-lmdb releases the GIL while LMDB copies and writes), so a directory of `n` shards takes
a batch `n` commits at a time.

Each shard is a whole `DiskTier` directory (its own data.mdb, lock.mdb, budget of
`budget / n`, access order and pruning), laid out as `kvtier.tiers.disk.shard_layout` says.
A block lives in shard `shard_of(hash, n)`: block hashes are uniform, so the shards fill
evenly, and a block's shard never changes while `n` does not.

`ShardedDiskTier` is the tier the manager sees: the same verbs as `DiskTier`, each batch
split per shard; writes run on one thread per shard (each shard's commits stay in order),
reads on the caller's thread, one shard after another (reads are already spread over the
manager's I/O threads); lookups that a shard cannot answer from memory go to all such
shards at once, so a stalled disk costs one lookup deadline, not one per shard.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvtier.hashing import BlockHash
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.disk.shard_layout import shard_of
from kvtier.tiers.disk.tier import DiskStats, DiskTier
from kvtier.tiers.record import BlockBuffer, BlockMeta

T = TypeVar("T")


class ShardedDiskTier(LowerTier):
    """The `DiskTier`s of one sharded directory as one tier (see the module docstring).

    shards: the open tiers, in shard order (block `h` in `shards[shard_of(h, n)]`); this
    object owns them (closes them). path: the directory holding them. Thread-safe as each
    shard is.
    """

    name = "disk"
    kind = Tier.DISK
    write_policy = WritePolicy.WRITE_BACK
    lookup_is_local = True
    #: Write jobs of several I/O threads queue their shards' parts on the writer threads,
    #: which keep each shard's commits in order.
    serial_writes = False

    def __init__(self, path: str | os.PathLike[str], shards: Sequence[DiskTier]) -> None:
        if len(shards) < 2:
            raise ValueError("a sharded disk tier needs at least two shards; use the DiskTier")
        layouts = {shard.layout for shard in shards}
        if len(layouts) != 1:
            raise ValueError("every shard of a disk tier stores one layout")
        self.path = Path(path)
        self.shards = list(shards)
        self.layout = self.shards[0].layout
        self.durable = self.shards[0].durable
        self.budget_bytes = sum(shard.budget_bytes for shard in self.shards)
        #: A batch of this many blocks gives each shard about one shard's batch.
        self.write_batch = self.shards[0].write_batch * len(self.shards)
        self._writers = [ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-disk-write-{i}")
                         for i in range(len(self.shards))]
        # Lookups of shards that cannot answer from memory, side by side (`contains`).
        self._lookups = ThreadPoolExecutor(len(self.shards),
                                           thread_name_prefix="kvtier-disk-shard-lookup")
        self._closed = False

    # ---- routing -------------------------------------------------------------------------

    def _split(self, block_hashes: Sequence[BlockHash]) -> list[list[int]]:
        """Per shard, the positions of `block_hashes` it holds."""
        positions: list[list[int]] = [[] for _ in self.shards]
        count = len(self.shards)
        for position, block_hash in enumerate(block_hashes):
            positions[shard_of(block_hash, count)].append(position)
        return positions

    def _per_shard(self, block_hashes: Sequence[BlockHash],
                   call: Callable[[DiskTier, list[int]], list[T] | Future[list[T]]],
                   fill: T) -> list[T]:
        """`call(shard, positions)` for each shard given some of `block_hashes`, one after
        another; its per-position answers (or a future of them, waited for once every call
        was made) put back in the order of `block_hashes`."""
        answers: list[T] = [fill] * len(block_hashes)
        results = [(positions, call(shard, positions))
                   for shard, positions in zip(self.shards, self._split(block_hashes))
                   if positions]
        for positions, result in results:
            found = result.result() if isinstance(result, Future) else result
            for position, answer in zip(positions, found):
                answers[position] = answer
        return answers

    # ---- LowerTier -----------------------------------------------------------------------

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, whether its shard holds it now (see `DiskTier.contains`). Shards that
        cannot answer from memory are asked side by side, so a stalled disk costs one
        lookup deadline, not one per shard. Raises ValueError once closed."""
        if self._closed:
            raise ValueError(f"disk cache {self.path} is closed")

        def ask(shard: DiskTier, positions: list[int]) -> list[bool] | Future[list[bool]]:
            asked = [block_hashes[i] for i in positions]
            found = shard.contains_from_memory(asked)
            return found if found is not None else self._lookups.submit(shard.contains, asked)

        return self._per_shard(block_hashes, ask, False)

    def get_into(self, meta: BlockMeta, dest: BlockBuffer) -> bool:
        """`DiskTier.get_into` from the block's shard."""
        return self.get_many_into([meta], [dest])[0]

    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        """`DiskTier.get_many_into`, each shard's blocks in one read transaction of its own."""
        if len(metas) != len(dests):
            raise ValueError(f"{len(metas)} metas but {len(dests)} destinations")
        return self._per_shard([meta.block_hash for meta in metas],
                               lambda shard, at: shard.get_many_into(
                                   [metas[i] for i in at], [dests[i] for i in at]), False)

    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        """`DiskTier.put`, the shards' transactions side by side."""
        return self.put_counted(metas, payloads)[0]

    def put_counted(self, metas: Sequence[BlockMeta], payloads: Sequence[object]
                    ) -> tuple[list[bool], int]:
        """`DiskTier.put_counted`: each shard's blocks in its own write transaction, on that
        shard's writer thread, all shards at once; returns when every one has committed.
        Raises ValueError for mismatched arguments or a bad payload (from its shard)."""
        if len(metas) != len(payloads):
            raise ValueError(f"{len(metas)} metas but {len(payloads)} payloads")
        if self._closed:
            raise ValueError(f"disk cache {self.path} is closed")
        present: list[bool] = [False] * len(metas)
        split = self._split([meta.block_hash for meta in metas])
        futures = [(positions, writer.submit(shard.put_counted, [metas[i] for i in positions],
                                             [payloads[i] for i in positions]))
                   for shard, writer, positions in zip(self.shards, self._writers, split)
                   if positions]
        num_written, failure = 0, None
        for positions, future in futures:  # every shard's commit ends before this returns
            try:
                stored, written = future.result()
            except BaseException as exc:  # noqa: BLE001 (raised once all have ended)
                failure = failure or exc
                continue
            num_written += written
            for position, ok in zip(positions, stored):
                present[position] = ok
        if failure is not None:
            raise failure
        return present, num_written

    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        """Remove blocks; how many were present. Raises ValueError when read-only."""
        return sum(shard.delete([block_hashes[i] for i in positions])
                   for shard, positions in zip(self.shards, self._split(block_hashes))
                   if positions)

    def touch(self, block_hashes: Sequence[BlockHash]) -> None:
        """Mark blocks as just used (see `DiskTier.touch`)."""
        for shard, positions in zip(self.shards, self._split(block_hashes)):
            if positions:
                shard.touch([block_hashes[i] for i in positions])

    def sync(self) -> None:
        """Every shard's `sync`, side by side on the writer threads."""
        for future in [writer.submit(shard.sync)
                       for shard, writer in zip(self.shards, self._writers)]:
            future.result()

    def close(self) -> None:
        """Let the writes under way end, then close every shard (each syncs). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown(wait=True)
        for writer in self._writers:
            writer.shutdown(wait=True)
        failure = None
        for shard in self.shards:  # every shard closes, whatever another raised
            try:
                shard.close()
            except BaseException as exc:  # noqa: BLE001 (raised once all are closed)
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> ShardedDiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- queries -------------------------------------------------------------------------

    def stats(self) -> DiskStats:
        """The shards' counters added up (`durable` as the shards are)."""
        totals = [shard.stats() for shard in self.shards]
        summed = {field.name: sum(getattr(s, field.name) for s in totals)
                  for field in dataclasses.fields(DiskStats) if field.name != "durable"}
        return DiskStats(**summed, durable=self.durable)

    @property
    def unavailable(self) -> str | None:
        """Why some shard serves nothing now (see `DiskTier.unavailable`); None while all
        serve. The others go on serving their blocks."""
        for shard in self.shards:
            reason = shard.unavailable
            if reason is not None:
                return f"{shard.path.name}: {reason}"
        return None

    @property
    def format_reset(self) -> bool:
        """Whether some shard was cleared on open for another disk format."""
        return any(shard.format_reset for shard in self.shards)

    @property
    def num_syncs(self) -> int:
        """Syncs the shards ran, in all."""
        return sum(shard.num_syncs for shard in self.shards)

    def keys_in_memory(self, wait: float = 0.0) -> bool:
        """Whether every shard answers lookups from memory now (each waits up to `wait`)."""
        return all([shard.keys_in_memory(wait) for shard in self.shards])
