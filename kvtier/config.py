"""TierConfig: how many GPU blocks, how big the host and disk tiers are, how bytes move.

Sizes are bytes; a tier is off when its size is 0 (host) or its path is None (disk). The
values are checked once here so the tier manager can trust them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from kvtier.layout import KVLayout
from kvtier.tiers.disk.shard_layout import (
    LARGE_BUDGET_SHARDS,
    MAX_SHARDS,
    SHARDING_BUDGET_BYTES,
)
from kvtier.tiers.disk.tier import LOOKUP_DEADLINE_S
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.validation import CheckedModel

SWAP_METHODS = ("auto", "dma", "staged", "triton")
SwapMethod = Literal["auto", "dma", "staged", "triton"]

#: Slots of the staging slab used for disk traffic when the host tier is off but the disk
#: tier is on (blocks pass through it on their way to and from disk; nothing is cached there).
DEFAULT_STAGING_SLOTS = 16
#: Threads running host <-> disk jobs unless TierConfig says otherwise.
DEFAULT_IO_THREADS = 8
#: Share of the host slots write-throughs leave to reads from the tiers below, unless
#: TierConfig says otherwise (`kvtier.stores.StorePath`; docs/BENCHMARKS.md, "The disk
#: tier behind a small host tier", has the sweep that chose it).
DEFAULT_READ_RESERVE_SHARE = 0.5

PositiveInt = Annotated[int, Field(gt=0)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TierConfig(CheckedModel):
    """Capacities of the three tiers and the knobs of the transfer engine.

    num_gpu_blocks: blocks in the GPU pool (and in the `kv_cache` tensor).
    host_capacity_bytes: size of the pinned host slab in bytes; 0 turns the host tier off.
        It is rounded down to whole blocks (see `num_host_slots`).
    disk_path: directory of the LMDB disk tier; None turns it off.
    disk_budget_bytes: how many bytes the disk tier may hold; required with `disk_path`.
    disk_durable: fsync every write transaction of the disk tier. Off (the default): the OS
        writes blocks back, the tier syncs every GiB written and on flush and close; an OS
        crash or power loss may lose recent blocks, which then miss (see `DiskTier`).
    disk_lookup_deadline_s: seconds a disk lookup may take; past it the disk counts as
        unavailable (every lookup a miss) until that lookup returns (see `DiskTier`).
    disk_shards: LMDB environments a new disk tier directory is split over, written side by
        side (`kvtier.tiers.disk.shards`); None: `shard_layout.default_shards` of the
        budget (4 from 4 GiB, else 1). An existing directory keeps its own count.
    disk_worker: run the disk tier in a worker process of its own, which reads into and
        writes from a host slab both processes map (`kvtier.tiers.disk.worker`): the disk
        tier's Python work then never holds the GIL the engine launches its kernels under.
        None (the default): on a CUDA device, not on the CPU.
    swap_method: how GPU <-> host copies run: "dma" (copy engines), "staged" (a device
        gather/scatter around copy-engine runs), "triton" (a kernel writing through unified
        addressing) or "auto" (the kernels' choice).
    io_threads: threads that run host <-> disk jobs.
    max_pending_io: bound on queued host <-> disk jobs; a full queue blocks the submitter.
    write_depth: write-back batches kept in flight while any dirty host block waits, so the
        disk writes at its own speed whenever there is a backlog (`kvtier.stores`).
    read_reserve_share: share of the host slots that write-throughs leave (free or clean)
        to reads from the tiers below while a write-back tier exists: behind a small host
        tier under load the rest fills with dirty blocks, and a disk read needs a slot.
    staging_slots: slab slots used for disk traffic when the host tier is off.
    remote: the shared remote tier below the disk (`RemoteConfig`); None turns it off.
    directory_path: a directory of one file per block (`kvtier.tiers.directory`), in the
        disk tier's place (the two cannot both be on); None turns it off.

    Fields are checked by their types (one line each, so adding a tier's settings is one
    line more); raises `kvtier.validation.ConfigError` (a ValueError) naming the field when
    a value is out of range or inconsistent.
    """

    num_gpu_blocks: PositiveInt = Field(description="blocks in the GPU pool")
    host_capacity_bytes: Annotated[int, Field(ge=0)] = Field(
        0, description="host tier size in bytes; 0 turns the host tier off")
    disk_path: str | Path | None = Field(
        None, description="disk tier directory; None turns the disk tier off")
    disk_budget_bytes: PositiveInt | None = Field(
        None, description="bytes the disk tier may use; required with disk_path")
    disk_durable: bool = Field(
        False, description="fsync every disk tier write transaction; off: the OS writes "
        "back, an OS crash or power loss may lose recent blocks (they then miss)")
    disk_lookup_deadline_s: Annotated[float, Field(gt=0)] = Field(
        LOOKUP_DEADLINE_S, description="seconds a disk lookup may take before the disk "
        "counts as unavailable until it returns")
    disk_shards: Annotated[int, Field(ge=1, le=MAX_SHARDS)] | None = Field(
        None, description="LMDB environments a new disk tier directory is split over, "
        f"written side by side (None: {LARGE_BUDGET_SHARDS} from a "
        f"{SHARDING_BUDGET_BYTES >> 30} GiB budget, else 1); an existing directory keeps its "
        "own count")
    disk_worker: bool | None = Field(
        None, description="run the disk tier in a worker process of its own (None: on a "
        "CUDA device)")
    swap_method: SwapMethod = Field("auto", description="how GPU <-> host copies run")
    io_threads: PositiveInt = Field(DEFAULT_IO_THREADS,
                                    description="threads running host <-> disk jobs")
    max_pending_io: PositiveInt = Field(1024, description="bound on queued host <-> disk jobs")
    write_depth: PositiveInt = Field(
        2, description="write-back batches kept in flight while dirty host blocks wait")
    read_reserve_share: Annotated[float, Field(ge=0, lt=1)] = Field(
        DEFAULT_READ_RESERVE_SHARE, description="share of the host slots write-throughs "
        "leave to reads from the tiers below, while a write-back tier exists")
    staging_slots: PositiveInt = Field(
        DEFAULT_STAGING_SLOTS, description="slab slots for disk traffic without a host tier")
    remote: RemoteConfig | None = Field(
        None, description="the shared remote tier below the disk; None turns it off")
    directory_path: Path | None = Field(
        None, description="a directory of block files (kvtier.tiers.directory); None: off")

    @model_validator(mode="after")
    def _check_disk(self) -> TierConfig:
        if self.disk_path is not None:
            if not str(self.disk_path):
                raise ValueError("TierConfig.disk_path must name a directory, or be None to "
                                 "turn the disk tier off; got an empty string")
            if self.disk_budget_bytes is None:
                raise ValueError("TierConfig.disk_budget_bytes is required when disk_path is "
                                 "set: say how many bytes the disk tier may use")
        elif self.disk_budget_bytes is not None:
            raise ValueError("TierConfig.disk_budget_bytes is set but disk_path is None; "
                             "set disk_path to turn the disk tier on, or drop the budget")
        return self

    @classmethod
    def from_slots(cls, layout: KVLayout, num_gpu_blocks: int, num_host_slots: int = 0,
                   disk_path: str | Path | None = None, num_disk_blocks: int | None = None,
                   **kwargs: object) -> TierConfig:
        """A config with the host and disk capacities given in blocks of `layout`.

        `num_disk_blocks` is required with `disk_path`. Other keyword arguments are passed
        through. Raises ValueError as the constructor does, or for a negative slot count.
        """
        if not _is_int(num_host_slots) or num_host_slots < 0:
            raise ValueError(f"num_host_slots must be an integer >= 0, got {num_host_slots!r}")
        disk_budget = None
        if num_disk_blocks is not None:
            if not _is_int(num_disk_blocks) or num_disk_blocks <= 0:
                raise ValueError(f"num_disk_blocks must be a positive integer, "
                                 f"got {num_disk_blocks!r}")
            disk_budget = num_disk_blocks * layout.bytes_per_block
        return cls(num_gpu_blocks=num_gpu_blocks,
                   host_capacity_bytes=num_host_slots * layout.bytes_per_block,
                   disk_path=disk_path, disk_budget_bytes=disk_budget, **kwargs)  # type: ignore[arg-type]

    @property
    def host_enabled(self) -> bool:
        return self.host_capacity_bytes > 0

    @property
    def disk_enabled(self) -> bool:
        return self.disk_path is not None

    def num_host_slots(self, layout: KVLayout) -> int:
        """Whole blocks of `layout` that fit in the host tier (0 when it is off).

        Raises ValueError when the host tier is on but smaller than one block.
        """
        if self.host_capacity_bytes == 0:
            return 0
        num_slots = self.host_capacity_bytes // layout.bytes_per_block
        if num_slots == 0:
            raise ValueError(f"host_capacity_bytes={self.host_capacity_bytes} is smaller than "
                             f"one block ({layout.bytes_per_block} bytes for "
                             f"{layout.describe()}); raise it or set 0 to turn the tier off")
        return num_slots
