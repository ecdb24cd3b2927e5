"""The records of prefix lookups and loads in progress, shared by the tier manager's methods."""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import NewType

from kvtier.free_queue import KVCacheBlock
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier
from kvtier.tiers.host import SlotId
from kvtier.tiers.record import BlockMeta
from kvtier.transfer import JobId

LoadId = NewType("LoadId", int)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest prefix of the looked-up hashes that some tier holds.

    `locations[i]` is the fastest tier holding block i (None: no tier does, a gap the
    caller computes; only from a lookup asked for gaps, never the last block); `gpu_blocks[i]`
    is its pool block for GPU hits and None otherwise. Both lists have the prefix's length
    (0: nothing hit).
    """

    locations: list[Tier | None]
    gpu_blocks: list[KVCacheBlock | None]

    @property
    def num_blocks(self) -> int:
        return len(self.locations)


class LoadState(enum.Enum):
    """Where one block of a load stands."""

    #: On its way to the GPU copy: waiting for a host slot, being read into one, or landed
    #: in the host and waiting for its copy job.
    PENDING = "pending"
    COPYING = "copying"  # its host -> GPU copy is submitted (`LoadBlock.copy_job`)
    ARRIVED = "arrived"  # the copy finished: the GPU block holds the bytes
    FAILED = "failed"  # a miss: no tier held it, its read or copy failed, or it was cancelled


@dataclass(slots=True)
class LoadBlock:
    """One block of a load: where it goes, where it comes from, the host slot carrying it and
    how far it got."""

    meta: BlockMeta
    gpu_block: KVCacheBlock
    state: LoadState = LoadState.PENDING
    slot: SlotId | None = None
    copy_job: JobId | None = None  # its host -> GPU copy, once submitted
    source: LowerTier | None = None  # the tier below the host it is read from (None: host)


@dataclass(slots=True)
class Load:
    """A load in progress: its blocks in prefix order and the transfer jobs it waits on.

    `split_reads`: its disk hits are spread over the I/O threads (else one read job per
    batch of slots). `cancelled` is set by `TierManager.cancel_load` on the engine thread and
    read by the I/O thread about to run one of its reads.
    """

    blocks: list[LoadBlock]
    split_reads: bool = True
    waiting: deque[LoadBlock] = field(default_factory=deque)  # hits below, no slot yet
    job_ids: set[JobId] = field(default_factory=set)
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: (start, end) on `time.monotonic` of each disk or remote read job of this load that
    #: ran, appended by the I/O threads: how long the tier took, not when it was noticed.
    read_spans: list[tuple[float, float]] = field(default_factory=list)
    #: Blocks whose disk or remote read succeeded, used or not (a cancelled load's too):
    #: what the tier delivered in `read_spans`.
    read_blocks: int = 0
    #: On CUDA, an event recorded on the compute stream when the load took its GPU blocks:
    #: the work that may still use them is queued before it, so its copies wait for that
    #: work alone, not for the model's steps queued since.
    blocks_free: object | None = None
