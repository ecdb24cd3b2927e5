"""Where every computed block went on its way to the write-back tier (the disk).

Each full block the engine computed and cached is offered to the store path once
(`StorePath.write_through`). From then on it is, at any moment, in exactly one of these:

  * pending: queued, deferred (no host slot yet, still cached on the GPU), being copied to
    the host, dirty on the host, or being written;
  * written: the write-back tier holds it (written now, or found there already);
  * duplicate: another copy of the same hash was stored or being stored (it is counted
    under that one);
  * skipped, with the policy that skipped it (`SkipReason`).

So `offered == written + duplicate + skipped + pending` always, and `lost`, what the ledger
cannot place, must stay 0 (`StoreLedgerStats.lost`, counted from the store path's own queues,
not derived from the other counters). The ledger is kept only when a write-back tier exists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SkipReason(enum.Enum):
    """Why a computed block did not reach the write-back tier."""

    #: The GPU pool reused the block before a host slot came free for it: blocks came
    #: faster than the host and the disk behind it took them, and the GPU is never held for
    #: the disk (the lowest placement priority goes first, see `StorePath`).
    GPU_REUSED = "gpu_reused"
    #: The tier refused it (its budget is full of blocks the same batch needs, or the
    #: record does not fit).
    REFUSED = "refused"
    #: A copy or a write failed (an I/O error): the block is recomputed when needed.
    FAILED = "failed"
    #: Closing ran out of its time (`flush(timeout_s=...)`) before the block was written.
    FLUSH_TIMEOUT = "flush_timeout"


@dataclass(frozen=True, slots=True)
class StoreLedgerStats:
    """Blocks offered to the write-back tier and where they went (see the module
    docstring). `skipped` has every `SkipReason`'s value as a key. `write_busy_s`: seconds at
    least one write to that tier was running (its GB/s is the bytes it wrote over these)."""

    offered: int
    written: int
    duplicate: int
    skipped: dict[str, int]
    pending: int
    write_busy_s: float = 0.0

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def lost(self) -> int:
        """Offered blocks that are neither written, duplicates, skipped nor pending: 0 unless
        a path dropped a block without counting it."""
        return self.offered - self.written - self.duplicate - self.num_skipped - self.pending

    def as_dict(self) -> dict[str, object]:
        return {"offered": self.offered, "written": self.written, "duplicate": self.duplicate,
                "skipped": dict(self.skipped), "pending": self.pending, "lost": self.lost,
                "write_busy_s": self.write_busy_s}


@dataclass(slots=True)
class StoreLedger:
    """The mutable counters behind `StoreLedgerStats`; `pending` is given at snapshot time."""

    offered: int = 0
    written: int = 0
    duplicate: int = 0
    skipped: dict[SkipReason, int] = field(
        default_factory=lambda: {reason: 0 for reason in SkipReason})

    def skip(self, reason: SkipReason, num_blocks: int = 1) -> None:
        self.skipped[reason] += num_blocks

    def snapshot(self, pending: int, write_busy_s: float = 0.0) -> StoreLedgerStats:
        return StoreLedgerStats(self.offered, self.written, self.duplicate,
                                {reason.value: n for reason, n in self.skipped.items()},
                                pending, write_busy_s)
