"""What the tier manager hands the I/O pool for the remote tier, and which blocks it has
already offered to it.

  * `remote_read_job`: REMOTE_TO_HOST, one pipelined read of a load's remote hits into their
    host slots (optionally kept on the local disk tier too, in the same job).
  * `remote_write_job`: HOST_TO_REMOTE, one pipelined write of a batch of host slots.
  * `RemoteOffers`: the hashes already sent (or received), so every block goes to the
    remote tier once, and the host slots queued for the next batch.
  * `RemoteWrites`: the tier manager's write-back to the remote tier, built on the above.

Imports no redis: the jobs only call the `RemoteTier` they are given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.hashing import BlockHash
from kvtier.stats import Direction, TierCounters
from kvtier.tiers.host import HostTier, SlotId
from kvtier.tiers.record import BlockBuffer, BlockMeta
from kvtier.transfer import IOJob, JobId

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.remote import RemoteTier

#: Hashes remembered as offered to the remote tier (oldest forgotten first): 256K blocks is
#: far more KV than one engine computes between two visits to the same prefix.
MAX_REMEMBERED = 1 << 18


def remote_read_job(remote: RemoteTier, metas: Sequence[BlockMeta],
                    dests: Sequence[BlockBuffer], bytes_per_block: int,
                    disk: DiskTier | None = None) -> tuple[IOJob, list[bool]]:
    """A REMOTE_TO_HOST job reading `metas` into `dests` (uint8 `[bytes_per_block]` views of
    host slots) with one pipeline per node. The returned list receives each block's outcome
    (True: verified hit) once the job ran; it stays empty if the job raised. With `disk`,
    the verified blocks are also stored on it before the job finishes."""
    results: list[bool] = []

    def run() -> int:
        results.extend(remote.get_many_into(metas, dests))
        hits = [i for i, ok in enumerate(results) if ok]
        if disk is not None and hits:
            disk.put([metas[i] for i in hits], [dests[i] for i in hits])
        return len(hits) * bytes_per_block

    return IOJob(Direction.REMOTE_TO_HOST, run), results


def remote_write_job(remote: RemoteTier, metas: Sequence[BlockMeta],
                     payloads: Sequence[BlockBuffer],
                     bytes_per_block: int) -> tuple[IOJob, list[bool]]:
    """A HOST_TO_REMOTE job storing blocks (uint8 `[bytes_per_block]` views of host slots)
    the store does not hold yet. The returned list receives, per block, whether the store
    holds it afterwards (False: refused or unreachable); it stays empty if the job raised."""
    stored: list[bool] = []

    def run() -> int:
        stored.extend(remote.put(metas, payloads))
        return sum(stored) * bytes_per_block

    return IOJob(Direction.HOST_TO_REMOTE, run), stored


class RemoteOffers:
    """Blocks offered to the remote tier: each hash once (within the last `max_remembered`),
    host slots batched until the next flush. Owned by the engine thread."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()
        self._max_remembered = max_remembered
        self.pending: list[SlotId] = []

    def is_new(self, block_hash: BlockHash) -> bool:
        """True the first time a hash is asked about; it is remembered from then on."""
        if block_hash in self._seen:
            return False
        self.remember([block_hash])
        return True

    def remember(self, block_hashes: Sequence[BlockHash]) -> None:
        """Never offer these (e.g. blocks just read from the remote tier)."""
        for block_hash in block_hashes:
            self._seen[block_hash] = None
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self._max_remembered:
            self._seen.popitem(last=False)

    def take(self, batch: int) -> list[list[SlotId]]:
        """The pending slots in batches of at most `batch`; the queue is emptied."""
        slots, self.pending = self.pending, []
        return [slots[i:i + batch] for i in range(0, len(slots), batch)]


class RemoteWrites:
    """Write-back from host slots to the remote tier, for the tier manager (engine thread).

    `offer` queues a newly cached host block once per hash and pins its slot; `send` writes
    the queue in batches of `write_batch` on the I/O pool (through `submit`, the manager's
    job submission) and unpins each slot once its batch is done, whatever the outcome: a
    refused or lost block is counted in `counters` and dropped, never retried.
    """

    def __init__(self, remote: RemoteTier, host: HostTier, bytes_per_block: int,
                 write_batch: int, submit: Callable[[IOJob, Callable[[bool], None]], JobId],
                 counters: TierCounters) -> None:
        self.remote, self.host = remote, host
        self.offers = RemoteOffers()
        self._bytes_per_block, self._write_batch = bytes_per_block, write_batch
        self._submit, self._counters = submit, counters

    def offer(self, slot: SlotId) -> None:
        if self.offers.is_new(self.host.meta(slot).block_hash):
            self.host.pin(slot)
            self.offers.pending.append(slot)

    def send(self) -> None:
        for chunk in self.offers.take(self._write_batch):
            self.write(chunk, lambda c=chunk: [self.host.unpin(slot) for slot in c])

    def write(self, slots: list[SlotId], then: Callable[[], object]) -> None:
        """Store host slots (pinned or reserved by the caller) in the remote tier; `then()`
        runs once the job finished."""
        metas = [self.host.meta(slot) for slot in slots]
        self.offers.remember([meta.block_hash for meta in metas])
        job, stored = remote_write_job(self.remote, metas,
                                       [self.host.slot_array(slot) for slot in slots],
                                       self._bytes_per_block)

        def finish(ok: bool) -> None:  # `stored` is empty when the job raised
            self._counters.rejected += stored.count(False)
            self._counters.failures += len(slots) - len(stored)
            then()

        self._submit(job, finish)
