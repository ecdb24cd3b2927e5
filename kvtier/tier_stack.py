"""The tiers of one manager as one record (`TierStack`): what its lookup, load and store paths
are given, instead of each tier by hand.

`LowerTiers` is the list of tiers below the host, fastest first, with the roles they declare
(`kvtier.tiers.base.WritePolicy`). Their own stats read LMDB or a network store, so they may
be taken on any thread (a metrics scrape's worker rather than the engine's), and closing the
tiers waits for a read under way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvtier.block_pool import BlockPool
from kvtier.stats import Tier, TierCounters
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.host import HostTier
from kvtier.transfer import JobId
from kvtier.write_once import WriteOnce

#: submit(job, on_done, *loads): start a transfer job; `on_done(ok)` runs in the `poll` that
#: sees it finish, and `loads` wait for it.
Submit = Callable[..., JobId]

#: (the disk tier's stats, the remote tier's), each None when that tier is off or closed.
LowerTierStats = tuple[object | None, object | None]


class LowerTiers:
    """The tiers below the host of one manager, fastest first, closed once.

    write_back: the tier the host's dirty blocks are written back to (None: blocks leave the
        host without being written anywhere). every_block: the tiers given every block once.
    Raises ValueError, closing the tiers, for two write-back tiers (the host marks a block
    dirty once).
    """

    def __init__(self, tiers: Sequence[LowerTier]) -> None:
        self._tiers = list(tiers)
        write_back = [t for t in self._tiers if t.write_policy is WritePolicy.WRITE_BACK]
        if len(write_back) > 1:
            for tier in self._tiers:
                tier.close()
            raise ValueError(f"tiers {[t.name for t in write_back]} all want the host's "
                             "write-backs; turn all but one of them off")
        self.write_back: LowerTier | None = write_back[0] if write_back else None
        self.every_block = [t for t in self._tiers if t.write_policy is WritePolicy.EVERY_BLOCK]
        self._closed = False
        self._lock = threading.Lock()  # orders stats reads before the close

    def __iter__(self) -> Iterator[LowerTier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def named(self, name: str) -> LowerTier | None:
        """The tier called `name`, or None."""
        return next((t for t in self._tiers if t.name == name), None)

    def keeper_of(self, tier: LowerTier) -> LowerTier | None:
        """Where blocks read from `tier` are kept too: the write-back tier above it when
        `tier` asks for that, else None."""
        keeper = self.write_back
        if not tier.keeps_reads_above or keeper is None:
            return None
        return keeper if self._tiers.index(keeper) < self._tiers.index(tier) else None

    def staging_order(self) -> list[LowerTier]:
        """The tiers a block on a staging slab is written to, in turn: those taking every
        block, then the write-back tier."""
        return self.every_block + [self.write_back] * (self.write_back is not None)

    def stats(self) -> LowerTierStats:
        """(the disk tier's stats, the remote tier's), each None when that tier is off, both
        None once closed. Safe on any thread."""
        by_name = self.stats_by_name()
        return by_name.get("disk"), by_name.get("remote")

    def stats_by_name(self) -> dict[str, object]:
        """Every open tier's own stats under its name (empty once closed). Safe on any
        thread."""
        with self._lock:
            if self._closed:
                return {}
            return {tier.name: tier.stats() for tier in self._tiers}

    def sync(self) -> None:
        """Put what every open tier has written on its storage (`LowerTier.sync`). Called
        from the thread that closes the tiers; not under the lock, so stats reads meanwhile
        do not wait for the disk."""
        if self._closed:
            return
        for tier in self._tiers:
            tier.sync()

    def close(self) -> None:
        """Close every tier, after any stats read under way. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for tier in self._tiers:
                tier.close()
            self._closed = True


@dataclass(slots=True)
class TierStack:
    """Everything a manager's lookup, load and store paths work on.

    kv_cache: [num_gpu_blocks, *layout.block_shape], the blocks `pool` hands out.
    host: the host slab (caching, or only staging for the tiers below: `HostTier.caches`);
        None when no tier sits below the GPU. lower: the tiers below the host. counters: per
    `Tier` kind, in blocks. submit: starts a transfer job (see `Submit`). offers: per tier
    given every block, the blocks already offered to it.
    """

    pool: BlockPool
    kv_cache: torch.Tensor
    host: HostTier | None
    lower: LowerTiers
    counters: dict[Tier, TierCounters]
    submit: Submit
    offers: list[WriteOnce]

    @property
    def caching_host(self) -> HostTier | None:
        """The host tier when it caches blocks (a lookup may hit it), else None."""
        return self.host if self.host is not None and self.host.caches else None

    def lookup_order(self) -> list[Tier]:
        """The tier kinds a lookup asks, fastest first (for counting hits and misses)."""
        fast = [Tier.GPU] + [Tier.HOST] * (self.caching_host is not None)
        return fast + [tier.kind for tier in self.lower]

    def offers_to(self, tier: LowerTier) -> WriteOnce | None:
        """The record of blocks offered to `tier`, None unless it takes every block."""
        return next((offers for offers in self.offers if offers.tier is tier), None)
