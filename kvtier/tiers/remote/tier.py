"""The remote tier: KV blocks shared by many engines through a Redis server or Redis Cluster.

Values are the disk tier's records (`kvtier.tiers.record`: magic, version, layout
fingerprint, parent hash, token ids, checksums), so a remote block is validated exactly like
a disk block; a value that fails any check is a miss, counted, and deleted from the store.
Keys are `<prefix>:<layout fingerprint hex>:<block hash hex>`; the block hash already chains
the namespace hash (model, layout, hash algorithm, cache salt), and the layout fingerprint
in the key lets `kvtier cache` tools pick one layout's blocks.

Every call is one pipeline per node (see `kvtier.tiers.remote.nodes`), sent to all nodes
before any reply is read (one round trip per call), under the socket timeout of
`RemoteConfig.timeout_s`; a node that fails or times out answers misses for
`backoff_s`. Nothing here raises for a store that misbehaves: failures are misses (reads)
or dropped blocks (writes), and counted. Eviction is the store's own (`maxmemory` with an
LRU policy, optional TTL); a write the store refuses (OOM under `noeviction`) is counted
and dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import redis

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.record import (
    BlockBuffer,
    BlockMeta,
    CorruptRecord,
    RecordHeader,
    assemble_record,
    decode_record,
    dest_array,
    payload_view,
    read_record_into,
    record_size,
)
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.nodes import RemoteNodes

logger = logging.getLogger(__name__)

#: Keys per SCAN reply when listing the store.
_SCAN_COUNT = 1000


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """The remote tier's counters, in blocks unless named otherwise.

    hits / misses: blocks read (verified) / not found. rejected: stored values that failed
    validation (a miss, and deleted). stored: blocks written. present: blocks a write found
    already stored (by this or another engine). refused: writes the store refused (OOM).
    unreachable: blocks asked for or offered while their node failed or was in back-off.
    backoffs: times a node (or the whole store) went into back-off. nodes_down: in back-off
    now. bytes_read / bytes_written: record bytes moved.
    """

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    stored: int = 0
    present: int = 0
    refused: int = 0
    unreachable: int = 0
    backoffs: int = 0
    nodes_down: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


_COUNTERS = tuple(f.name for f in fields(RemoteStats) if f.name not in ("backoffs",
                                                                          "nodes_down"))


class RemoteTier(LowerTier):
    """Blocks of one `layout` in a Redis server or cluster (see the module docstring).

    Thread-safe: lookups run on the engine thread, reads and writes on I/O threads. Raises
    ValueError for a bad config or payload; never for the store's failures.

    As a `LowerTier`: a store shared with other engines, given every block once; a lookup is
    a round trip, so a load trusts it.
    """

    name = "remote"
    kind = Tier.REMOTE
    write_policy = WritePolicy.EVERY_BLOCK
    lookup_is_local = False

    def __init__(self, config: RemoteConfig, layout: KVLayout) -> None:
        self.config, self.layout = config, layout
        self.write_batch = config.write_batch
        self.keeps_reads_above = config.write_to_disk
        self.nodes = RemoteNodes(config)
        self._fingerprint = layout.fingerprint()
        self._key_head = f"{config.key_prefix}:{self._fingerprint.hex()}:".encode()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)

    def key(self, block_hash: BlockHash) -> bytes:
        """The store key of `block_hash`."""
        return self._key_head + block_hash.hex().encode()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _pipelined(self, keys: Sequence[bytes], command) -> list[object | None]:
        """Run one command per key (`command(index, key)` gives its arguments), pipelined
        per node: the commands go out to every node first and the replies are read
        afterwards, so a call costs one round trip whatever the number of nodes. Returns
        each key's reply, None for keys whose node failed or is in back-off (counted as
        unreachable), or the error of a command the store refused."""
        replies: list[object | None] = [None] * len(keys)
        batches, num_unreachable = self.nodes.route(keys)
        sent = []
        for batch in batches:
            pool = batch.client.connection_pool
            try:
                conn = pool.get_connection()
            except (redis.RedisError, OSError) as exc:
                self.nodes.note_error(batch.name, exc)
                num_unreachable += len(batch.indices)
                continue
            try:
                conn.send_packed_command(conn.pack_commands(
                    [command(i, keys[i]) for i in batch.indices]))
                sent.append((batch, pool, conn))
            except (redis.RedisError, OSError) as exc:
                self._drop(batch, pool, conn, exc)
                num_unreachable += len(batch.indices)
        for batch, pool, conn in sent:
            try:
                for i in batch.indices:
                    replies[i] = self._read_reply(batch.name, conn)
            except (redis.RedisError, OSError) as exc:
                self._drop(batch, pool, conn, exc)
                num_unreachable += len(batch.indices)
                for i in batch.indices:
                    replies[i] = None
                continue
            pool.release(conn)
        if num_unreachable:
            self._count(unreachable=num_unreachable)
        return replies

    def _read_reply(self, node: str, conn) -> object | None:
        """One reply; an error reply is returned (refused) or, for a redirection, noted
        (the slot map is refreshed later) and None."""
        try:
            return conn.read_response()
        except (redis.exceptions.MovedError, redis.exceptions.AskError) as exc:
            self.nodes.note_error(node, exc)
            return None
        except redis.exceptions.ResponseError as exc:
            return exc

    def _drop(self, batch, pool, conn, exc: BaseException) -> None:
        """A node failed mid-call: its connection is closed (its stream is out of step),
        and the node goes into back-off."""
        conn.disconnect()
        pool.release(conn)
        self.nodes.note_error(batch.name, exc)

    # ---- lookups and reads ---------------------------------------------------------------

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Which blocks the store holds (EXISTS, one pipeline per node). An unreachable
        node's blocks are False. Does not refresh the store's LRU order."""
        if not block_hashes:
            return []
        replies = self._pipelined([self.key(h) for h in block_hashes],
                                  lambda _i, key: ("EXISTS", key))
        return [isinstance(r, int) and r > 0 for r in replies]

    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        """Read blocks into `dests` (contiguous CPU tensors of `bytes_per_block` bytes);
        True per verified hit. A value that fails validation (header, layout, length,
        parent hash, token ids, checksum) is a miss, counted as rejected and deleted.
        Raises ValueError for a bad destination or a length mismatch."""
        if len(metas) != len(dests):
            raise ValueError(f"{len(metas)} metas but {len(dests)} destinations")
        arrays = [dest_array(dest, self.layout.bytes_per_block) for dest in dests]
        if not metas:
            return []
        self.nodes.refresh_if_moved()
        keys = [self.key(meta.block_hash) for meta in metas]
        replies = self._pipelined(keys, lambda _i, key: ("GET", key))
        results, bad = [], []
        num_bytes = 0
        for meta, array, reply, key in zip(metas, arrays, replies, keys):
            ok = isinstance(reply, bytes) and self._read_into(reply, meta, array)
            if isinstance(reply, bytes):
                num_bytes += len(reply)
                if not ok:
                    bad.append(key)
            results.append(ok)
        num_hits = sum(results)
        self._count(hits=num_hits, misses=len(metas) - num_hits - len(bad),
                    rejected=len(bad), bytes_read=num_bytes)
        if bad:
            self._pipelined(bad, lambda _i, key: ("DEL", key))
        return results

    def _read_into(self, value: bytes, meta: BlockMeta, array) -> bool:
        try:
            read_record_into(value, meta, self._fingerprint, array)
        except CorruptRecord as exc:
            logger.info("remote cache: rejecting %s (%s)", meta.block_hash.hex(), exc)
            return False
        return True

    # ---- writes --------------------------------------------------------------------------

    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        """Store blocks the store does not hold yet (EXISTS, then SET with the TTL, one
        pipeline per node each); per block, whether the store holds it afterwards as far
        as this call knows (False: refused, or its node unreachable). Payloads are
        `bytes_per_block` bytes as bytes, memoryview, numpy array or contiguous CPU tensor.
        Raises ValueError for a payload of the wrong size or kind."""
        if len(metas) != len(payloads):
            raise ValueError(f"{len(metas)} metas but {len(payloads)} payloads")
        views = [payload_view(p, self.layout.bytes_per_block) for p in payloads]
        if not metas:
            return []
        self.nodes.refresh_if_moved()
        keys = [self.key(meta.block_hash) for meta in metas]
        present = self.contains([meta.block_hash for meta in metas])
        new = [i for i, hit in enumerate(present) if not hit]
        records = {}
        for i in new:
            out = bytearray(record_size(metas[i], views[i].nbytes))
            records[i] = assemble_record(metas[i], self.layout, views[i], out)
        expiry = ("EX", self.config.ttl_s) if self.config.ttl_s is not None else ()
        replies = self._pipelined([keys[i] for i in new],
                                  lambda j, key: ("SET", key, records[new[j]], *expiry))
        stored = list(present)
        num_refused = num_bytes = 0
        for i, reply in zip(new, replies):
            if reply == b"OK":
                stored[i] = True
                num_bytes += records[i].nbytes
            elif isinstance(reply, redis.exceptions.ResponseError):
                num_refused += 1
                logger.info("remote cache refused %s: %s", metas[i].block_hash.hex(), reply)
        self._count(stored=sum(stored) - sum(present), present=sum(present),
                    refused=num_refused, bytes_written=num_bytes)
        return stored

    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        """Delete blocks; how many were stored."""
        replies = self._pipelined([self.key(h) for h in block_hashes],
                                  lambda _i, key: ("DEL", key))
        return sum(r for r in replies if isinstance(r, int))

    # ---- administration ------------------------------------------------------------------

    def iter_keys(self, all_layouts: bool = False) -> Iterator[bytes]:
        """Keys under this tier's prefix and layout (`all_layouts`: every layout) on every
        reachable primary, via SCAN (never KEYS)."""
        pattern = (f"{self.config.key_prefix}:*" if all_layouts
                   else self._key_head.decode() + "*")
        for name, client in self.nodes.primaries():
            try:
                yield from client.scan_iter(match=pattern, count=_SCAN_COUNT)
            except (redis.RedisError, OSError) as exc:
                self.nodes.note_error(name, exc)

    def get_records(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Raw values of `keys` (None: missing or unreachable), one pipeline per node."""
        replies = self._pipelined(keys, lambda _i, key: ("GET", key))
        return [r if isinstance(r, bytes) else None for r in replies]

    def check_record(self, key: bytes, value: bytes) -> RecordHeader:
        """Decode and verify a whole stored value (checksums, layout when the key is this
        layout's, payload length). Raises CorruptRecord naming the reason."""
        same_layout = key.startswith(self._key_head)
        header, _ = decode_record(value, self._fingerprint if same_layout else None,
                                  self.layout.bytes_per_block if same_layout else None)
        return header

    def delete_keys(self, keys: Sequence[bytes]) -> int:
        """Delete raw keys (as listed by `iter_keys`); how many existed."""
        replies = self._pipelined(keys, lambda _i, key: ("DEL", key))
        return sum(r for r in replies if isinstance(r, int))

    def stats(self) -> RemoteStats:
        with self._lock:
            counts = dict(self._counts)
        return RemoteStats(backoffs=self.nodes.num_backoffs, nodes_down=self.nodes.num_down(),
                           **counts)

    def close(self) -> None:
        """Close the connections. Idempotent."""
        self.nodes.close()
