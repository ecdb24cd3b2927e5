"""The interface of the tiers below the host: what the tier manager asks of a disk, a shared
remote store, or any later tier, and the jobs such a tier hands the transfer engine.

A lower tier stores validated block records (`kvtier.tiers.record`) under their block hash.
Its verbs are batched, each with one meaning on every tier:

  * `contains(hashes)`: per hash, whether the tier holds it now.
  * `get_many_into(metas, dests)`: read and validate records into host slots; per block,
    True for a verified hit. Anything else (missing, damaged, another model's) is False:
    a block is never served unverified.
  * `put(metas, payloads)`: store blocks; per block, whether the tier holds it afterwards
    (False: refused for room, or unreachable).
  * `delete(hashes)`: how many of them were stored.
  * `sync()`: what was written is on the storage when it returns (for a flush);
    `stats()` (safe on any thread) and `close()`.

It also builds its own I/O jobs (`read_job`, `write_job`), run on the manager's I/O threads:
a tier knows best how to batch its calls and what to count as bytes moved.

How the manager uses a tier is declared by a few attributes rather than by its class:
`kind` (the counters and transfer directions it reports under), `write_policy` (which blocks
it is given), `lookup_is_local`, `write_batch`, `keeps_reads_above` and `serial_writes`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.stats import Direction, Tier
from kvtier.tiers.record import BlockBuffer, BlockMeta
from kvtier.transfer import IOJob


class WritePolicy(enum.Enum):
    """Which blocks a lower tier is given, and when."""

    #: The host's dirty blocks, written before their slots are reused (least recently used
    #: first, ahead of demand): a store that keeps what the host cannot. The host marks a
    #: block dirty once, so one tier of a manager at most has this policy.
    WRITE_BACK = "write-back"
    #: Every block that lands in the host, once, in batches per step: a store shared with
    #: other engines, which may ask for blocks this one never evicted.
    EVERY_BLOCK = "every-block"


class LowerTier(ABC):
    """A tier below the host (see the module docstring). Thread-safe: lookups run on the
    engine thread, jobs on the I/O threads, `stats` on any thread.

    kind: `Tier.DISK` (a local store) or `Tier.REMOTE` (a shared one): the counters and
        the transfer directions the tier's traffic is reported under.
    layout: the KV layout of every block it stores.
    name: how logs and stats name it.
    write_policy: see `WritePolicy`.
    lookup_is_local: `contains` is answered on this machine (memory, one file system call),
        so a load asks again rather than trusting the lookup; else (a network round trip) a
        block the lookup found is read without asking, and one lost meanwhile fails its read.
    write_batch: blocks per write job.
    keeps_reads_above: blocks read from this tier are also stored in the write-back tier
        above it (a remote hit kept on the local disk).
    serial_writes: its write jobs run one at a time (see the attribute).
    """

    layout: KVLayout
    name: str = "tier"
    kind: Tier = Tier.DISK
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    lookup_is_local: bool = True
    write_batch: int = 32
    keeps_reads_above: bool = False
    #: Its write jobs run while no other serial write does (`IOJob.serial`): one LMDB
    #: environment runs one write transaction at a time.
    serial_writes: bool = False

    @abstractmethod
    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, whether the tier holds it now."""

    @abstractmethod
    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        """Read the records `metas` names into `dests` (uint8 `[bytes_per_block]` views);
        per block, True for a verified hit. Never raises for a missing or damaged record."""

    @abstractmethod
    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        """Store blocks (payloads of `bytes_per_block` bytes); per block, whether the tier
        holds it afterwards. Raises ValueError for a payload of the wrong size or kind."""

    @abstractmethod
    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        """Remove blocks; how many of them were stored."""

    @abstractmethod
    def stats(self) -> object:
        """The tier's own counters, as a frozen record. Safe on any thread."""

    @abstractmethod
    def close(self) -> None:
        """Release files and connections, after `sync`. Idempotent."""

    def sync(self) -> None:
        """Put what the tier has written so far on its storage, where it leaves writing back
        to the operating system (the disk tier when not durable). Never raises for a
        failure of the storage (logged: the tier is a cache). Default: nothing to do."""
        return None

    @property
    def reads(self) -> Direction:
        """The transfer direction of reads from this tier into the host."""
        return Direction(f"{self.kind.value}->{Tier.HOST.value}")

    @property
    def writes(self) -> Direction:
        """The transfer direction of writes from the host into this tier."""
        return Direction(f"{Tier.HOST.value}->{self.kind.value}")

    def read_job(self, metas: Sequence[BlockMeta],
                 dests: Sequence[BlockBuffer]) -> tuple[IOJob, list[bool]]:
        """A job reading `metas` into `dests` (uint8 `[bytes_per_block]` views of host
        slots). The returned list receives each block's outcome (True: verified hit) once
        the job ran; it stays empty if the job raised."""
        results: list[bool] = []

        def run() -> int:
            results.extend(self.get_many_into(metas, dests))
            return sum(results) * self.layout.bytes_per_block

        return IOJob(self.reads, run), results

    def put_counted(self, metas: Sequence[BlockMeta], payloads: Sequence[object]
                    ) -> tuple[list[bool], int]:
        """`put`, and how many blocks the call wrote (the bytes a write job reports as
        moved). Default: every block held afterwards counts; a tier that can tell the ones
        it held already says fewer."""
        stored = self.put(metas, payloads)
        return stored, sum(stored)

    def write_job(self, metas: Sequence[BlockMeta],
                  payloads: Sequence[BlockBuffer]) -> tuple[IOJob, list[bool]]:
        """A job storing blocks (uint8 `[bytes_per_block]` views of host slots). The returned
        list receives, per block, whether the tier holds it afterwards; it stays empty if
        the job raised. It moves the bytes of the blocks `put_counted` wrote, and is
        `serial_writes`."""
        stored: list[bool] = []

        def run() -> int:
            present, num_written = self.put_counted(metas, payloads)
            stored.extend(present)
            return num_written * self.layout.bytes_per_block

        return IOJob(self.writes, run, serial=self.serial_writes), stored

