"""What one write transaction did to a disk tier's stored hashes (`KeyChanges`), recorded by
`LmdbIndex` as it adds and removes blocks and applied by `kvtier.tiers.disk.keys` to its
in-memory copy once the transaction commits; and a value's place packed into one int."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.hashing import BlockHash
from kvtier.tiers.disk.lmdb_value import ValueSpot


@dataclass(slots=True)
class KeyChanges:
    """What one write transaction did to the stored hashes, in order: `cleared`, it first
    removed every block; then each `(hash, spot)` in `steps` added a block whose value lies
    at `spot` (`pack_spot`; 0: not known) or, with `spot` None, removed one."""

    steps: list[tuple[BlockHash, int | None]] = field(default_factory=list)
    cleared: bool = False

    def added(self, block_hash: bytes, spot: ValueSpot | None = None) -> None:
        self.steps.append((BlockHash(bytes(block_hash)),
                           0 if spot is None or spot.page is None else
                           pack_spot(spot.page, spot.size)))

    def removed(self, block_hash: bytes) -> None:
        self.steps.append((BlockHash(bytes(block_hash)), None))

    def clear(self) -> None:
        self.steps.clear()
        self.cleared = True

    def apply_to(self, keys: dict[BlockHash, int]) -> None:
        """Apply the changes to hash -> packed spot."""
        if self.cleared:
            keys.clear()
        for block_hash, spot in self.steps:
            if spot is None:
                keys.pop(block_hash, None)
            else:
                keys[block_hash] = spot


def pack_spot(page: int, size: int) -> int:
    """A value's first overflow page and length as one int (0 stands for "not known")."""
    assert 0 < page and 0 <= size < 1 << 32, "an overflow value's page and length"
    return page << 32 | size


def unpack_spot(packed: int) -> ValueSpot | None:
    return None if not packed else ValueSpot(packed & 0xFFFFFFFF, packed >> 32)
