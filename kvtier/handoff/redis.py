"""The Redis store as the fallback handoff transport, through the remote tier.

The decode side offers its store's URL and a key prefix of the handoff's own; the prefill
side writes the blocks there with `RemoteTier.put` (the same records, keys and expiry as the
shared remote tier) and commits; the decode side reads them with `RemoteTier.get_many_into`,
which validates each record like any remote read, and deletes them. Slower than a direct
transport (every byte crosses the store twice), but it needs nothing but a Redis both
instances reach.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    ReceiveChannel,
    SendChannel,
    TransportError,
)
from kvtier.layout import KVLayout
from kvtier.tiers.record import BlockMeta
from kvtier.tiers.remote.config import RemoteConfig


class RedisTransport(HandoffTransport):
    """Handoffs through Redis. url: the store this instance receives through (None: it
    only sends, to the stores decode instances offer). key_prefix: keys of handoff
    records (kept apart from the remote tier's). ttl_s: their expiry, so that records of a
    handoff nobody committed do not stay. batch: blocks per send. Raises ValueError for a
    bad URL or prefix."""

    name = "redis"

    def __init__(self, layout: KVLayout, url: str | None, key_prefix: str = "kvtier-handoff",
                 ttl_s: int = 300, batch: int = 32, timeout_s: float = 5.0) -> None:
        self.layout = layout
        self.url, self.key_prefix, self.ttl_s = url, key_prefix, ttl_s
        self.batch, self.timeout_s = batch, timeout_s
        self._lock = threading.Lock()
        self._tiers: dict[tuple[str, str], object] = {}
        if url is not None:
            self._tier(url, key_prefix)  # a bad URL fails at start, not at the first handoff

    def _tier(self, url: str, key_prefix: str):
        """The remote tier over (url, key_prefix), opened once."""
        from kvtier.tiers.remote.tier import RemoteTier  # imports redis

        with self._lock:
            tier = self._tiers.get((url, key_prefix))
            if tier is None:
                config = RemoteConfig(url, key_prefix=key_prefix, timeout_s=self.timeout_s,
                                      backoff_s=1.0, ttl_s=self.ttl_s, write_batch=self.batch)
                tier = self._tiers[url, key_prefix] = RemoteTier(config, self.layout)
            return tier

    @property
    def ready(self) -> bool:
        return self.url is not None

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        if self.url is None:
            raise TransportError("this instance has no Redis to receive through")
        return _Receive(self, self._tier(self.url, self.key_prefix))

    def open_send(self, offer: Json) -> SendChannel:
        try:
            url, key_prefix = str(offer["url"]), str(offer["key_prefix"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a Redis offer needs url and key_prefix: {exc}") from exc
        return _Send(self, self._tier(url, key_prefix))

    def close(self) -> None:
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for tier in tiers:
            tier.close()


class _Receive(ReceiveChannel):
    def __init__(self, transport: RedisTransport, tier) -> None:
        self.transport, self.tier = transport, tier

    def offer(self) -> Json:
        return {"url": self.transport.url, "key_prefix": self.transport.key_prefix}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        found = self.tier.get_many_into(list(metas), list(dests))  # validates each record
        self.tier.delete([meta.block_hash for meta in metas])
        return found


class _Send(SendChannel):
    def __init__(self, transport: RedisTransport, tier) -> None:
        self.transport, self.tier = transport, tier
        self.capacity = transport.batch

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        stored = self.tier.put([b.meta for b in blocks], [b.host_payload() for b in blocks])
        if blocks and not any(stored):
            raise TransportError(f"the Redis store at {self.tier.config.url} took none"
                                 " of the blocks (unreachable or full)")
        return [{"index": b.index} for b, ok in zip(blocks, stored) if ok]
