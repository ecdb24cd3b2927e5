"""Which blocks a tier given every block (`WritePolicy.EVERY_BLOCK`, the shared remote store)
has already been offered, and the host slots queued for its next write.

Every block that lands in the host is offered once: a hash is remembered when it is offered,
written, or read from that tier (a block just read from the store need not go back to it).
The writes themselves are the store path's (`kvtier.stores`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.hashing import BlockHash
from kvtier.tiers.host import SlotId
from kvtier.transfer import chunks

if TYPE_CHECKING:
    from kvtier.tiers.base import LowerTier

#: Hashes remembered as offered (oldest forgotten first): 256K blocks is far more KV than one
#: engine computes between two visits to the same prefix.
MAX_REMEMBERED = 1 << 18


class WriteOnce:
    """Blocks offered to `tier`: each hash once (within the last `max_remembered`), host slots
    queued until the next `take`. Owned by the engine thread."""

    def __init__(self, tier: LowerTier, max_remembered: int = MAX_REMEMBERED) -> None:
        self.tier = tier
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
        """Never offer these (e.g. blocks just read from the tier)."""
        for block_hash in block_hashes:
            self._seen[block_hash] = None
            self._seen.move_to_end(block_hash)
        while len(self._seen) > self._max_remembered:
            self._seen.popitem(last=False)

    def take(self) -> list[list[SlotId]]:
        """The pending slots in batches of at most the tier's `write_batch`; the queue is
        emptied."""
        slots, self.pending = self.pending, []
        return chunks(slots, self.tier.write_batch)
