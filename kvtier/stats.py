"""Counters of the tiers and of the transfers between them, and their frozen snapshots.

The vocabulary is shared by the transfer engine and the tier manager: a `Tier` is where a
block's bytes can live, a `Direction` is one hop between two tiers. Counters are mutable and
owned by one object; `snapshot()` gives the frozen record that crosses the API boundary.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.block_pool import PoolStats


class Tier(enum.Enum):
    """Where a block's bytes live, fastest first."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # a shared store below the disk (kvtier.tiers.remote)

    @property
    def is_slow(self) -> bool:
        """A tier whose loads go through the I/O pool (disk, remote): slow enough that a
        restore is worth overlapping with recomputing the head of the prefix."""
        return self in (Tier.DISK, Tier.REMOTE)


class Direction(enum.Enum):
    """One hop of a block's bytes between two tiers."""

    GPU_TO_HOST = "gpu->host"
    HOST_TO_GPU = "host->gpu"
    HOST_TO_DISK = "host->disk"
    DISK_TO_HOST = "disk->host"
    HOST_TO_REMOTE = "host->remote"
    REMOTE_TO_HOST = "remote->host"

    @property
    def src(self) -> Tier:
        return Tier(self.value.split("->")[0])

    @property
    def dst(self) -> Tier:
        return Tier(self.value.split("->")[1])


@dataclass(frozen=True, slots=True)
class TransferStats:
    """One direction: jobs finished, bytes moved, seconds spent moving them, failed jobs."""

    num_jobs: int
    num_bytes: int
    seconds: float
    failures: int

    @property
    def gb_per_s(self) -> float:
        """Average bandwidth in GB/s (1e9 bytes), 0.0 before anything was timed."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class TransferCounters:
    num_jobs: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    def add(self, num_bytes: int, seconds: float, ok: bool) -> None:
        self.num_jobs += 1
        self.seconds += seconds
        if ok:
            self.num_bytes += num_bytes
        else:
            self.failures += 1

    def snapshot(self) -> TransferStats:
        return TransferStats(self.num_jobs, self.num_bytes, self.seconds, self.failures)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier, in blocks.

    hits / misses: lookups that found / did not find a block in this tier, counted per
        `lookup` call for every hash that reached this tier (a GPU miss goes on to the host).
    failures: blocks whose transfer out of or into this tier failed (the block is a miss).
    rejected: blocks this tier could not take: no host slot for a write-through (deferred:
        copied later if the GPU still holds the block then) or a load (a miss), no room on
        disk.
    """

    hits: int
    misses: int
    failures: int
    rejected: int


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    failures: int = 0
    rejected: int = 0

    def snapshot(self) -> TierStats:
        return TierStats(self.hits, self.misses, self.failures, self.rejected)


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Everything the tier manager counts (see `TierManager.stats`).

    tiers: per `Tier`, in blocks; transfers: per `Direction`; pool: the GPU block pool.
    host_slots / host_free_slots / host_cached / host_dirty: the host tier in slots (all 0
    when it is off). disk: the disk tier's own stats (None when it is off or closed).
    num_loads_in_flight / num_jobs_in_flight: work not completed yet.
    remote: the remote tier's own stats (None when it is off or closed).
    lower_tiers: every open tier below the host's own stats, under its name (`disk` and
    `remote` among them).
    stores: where the blocks offered to the write-back tier went (`kvtier.store_ledger`);
    None without a write-back tier.
    """

    tiers: dict[Tier, TierStats]
    transfers: dict[Direction, TransferStats]
    pool: PoolStats
    host_slots: int
    host_free_slots: int
    host_cached: int
    host_dirty: int
    disk: Any
    num_loads_in_flight: int
    num_jobs_in_flight: int
    remote: Any = None
    lower_tiers: dict[str, Any] = field(default_factory=dict)
    stores: Any = None

    def bytes_moved(self, direction: Direction) -> int:
        return self.transfers[direction].num_bytes


def count_lookup(counters: dict[Tier, TierCounters], search_order: list[Tier],
                 found: Tier | None, num_blocks: int = 1) -> None:
    """Count `num_blocks` looked-up blocks found in `found`: a miss each in every tier
    searched before it, a hit there (`found` None: a miss everywhere)."""
    for tier in search_order:
        if tier is found:
            counters[tier].hits += num_blocks
            return
        counters[tier].misses += num_blocks


def new_tier_counters() -> dict[Tier, TierCounters]:
    return {tier: TierCounters() for tier in Tier}


def new_transfer_counters() -> dict[Direction, TransferCounters]:
    return {direction: TransferCounters() for direction in Direction}


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) `spans`: how long a tier was
    reading or writing, however many of its transfers ran at once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
