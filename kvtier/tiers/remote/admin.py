"""Looking after the blocks a remote tier holds (`kvtier cache ... --remote URL`): stats,
inspect, verify, clear. Keys are listed with SCAN on every primary, never KEYS, and values
are read in pipelined batches; every layout under the key prefix is covered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis

from kvtier.tiers.record import CorruptRecord, decode_record
from kvtier.tiers.remote.config import RemoteConfig, redact
from kvtier.tiers.remote.nodes import RemoteNodes

_BATCH = 64
_SCAN_COUNT = 1000


@dataclass(slots=True)
class RemoteVerifyReport:
    """num_checked values; bad: (key, reason) of those failing a check; num_removed: bad
    values deleted (with repair)."""

    num_checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    num_removed: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad


def _open(config: RemoteConfig) -> RemoteNodes:
    nodes = RemoteNodes(config)
    if not nodes.primaries():
        nodes.close()
        raise OSError(f"cannot reach the remote cache at {redact(config.url)}; check the "
                      "URL, the password and that the server runs")
    return nodes


def _keys(nodes: RemoteNodes, config: RemoteConfig) -> Iterator[tuple[redis.Redis, bytes]]:
    for _, client in nodes.primaries():
        for key in client.scan_iter(match=f"{config.key_prefix}:*", count=_SCAN_COUNT):
            yield client, key


def _batches(nodes: RemoteNodes, config: RemoteConfig
             ) -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """Keys in batches, each batch from one node (so one pipeline reads it)."""
    batch: list[bytes] = []
    current = None
    for client, key in _keys(nodes, config):
        if batch and (client is not current or len(batch) == _BATCH):
            yield current, batch
            batch = []
        current = client
        batch.append(key)
    if batch:
        yield current, batch


def _layout_of(key: bytes, config: RemoteConfig) -> str:
    parts = key.decode(errors="replace").split(":")
    return parts[1] if len(parts) == 3 and parts[0] == config.key_prefix else "?"


def remote_stats(config: RemoteConfig) -> dict:
    """Blocks and record bytes per layout fingerprint, and each primary's memory settings.
    Raises OSError when no node answers."""
    nodes = _open(config)
    try:
        blocks: Counter[str] = Counter()
        num_bytes: Counter[str] = Counter()
        for client, keys in _batches(nodes, config):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(key)
            for key, length in zip(keys, pipe.execute()):
                blocks[_layout_of(key, config)] += 1
                num_bytes[_layout_of(key, config)] += int(length)
        servers = []
        for name, client in nodes.primaries():
            memory = client.info("memory")  # maxmemory_policy is there since Redis 7
            policy = memory.get("maxmemory_policy", "?")
            servers.append({"node": name, "used_memory": memory.get("used_memory"),
                            "maxmemory": memory.get("maxmemory"), "policy": policy})
        return {"url": redact(config.url), "key_prefix": config.key_prefix,
                "cluster": nodes.is_cluster, "num_blocks": sum(blocks.values()),
                "bytes_used": sum(num_bytes.values()),
                "layouts": [{"fingerprint": fp, "num_blocks": blocks[fp],
                             "bytes": num_bytes[fp]} for fp in sorted(blocks)],
                "servers": servers}
    finally:
        nodes.close()


def remote_inspect(config: RemoteConfig, limit: int) -> list[dict]:
    """Up to `limit` blocks (in SCAN order): hash, layout, tokens, bytes, seconds since last
    access, TTL, and whether the header decodes. Raises OSError when no node answers."""
    nodes = _open(config)
    rows: list[dict] = []
    try:
        for client, keys in _batches(nodes, config):
            keys = keys[:limit - len(rows)]
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.object("idletime", key)
                pipe.ttl(key)
            replies = pipe.execute(raise_on_error=False)
            for i, key in enumerate(keys):
                value, idle, ttl = replies[3 * i:3 * i + 3]
                status, num_tokens = "ok", None
                try:
                    header, _ = decode_record(value or b"")
                    num_tokens = header.num_tokens
                except CorruptRecord as exc:
                    status = exc.reason
                rows.append({"hash": key.decode(errors="replace").rsplit(":", 1)[-1],
                             "layout": _layout_of(key, config), "num_tokens": num_tokens,
                             "bytes": len(value or b""),
                             "idle_s": idle if isinstance(idle, int) else None,
                             "ttl_s": ttl if isinstance(ttl, int) and ttl >= 0 else None,
                             "status": status})
            if len(rows) >= limit:
                break
        return rows
    finally:
        nodes.close()


def remote_verify(config: RemoteConfig, repair: bool = False) -> RemoteVerifyReport:
    """Decode every value (magic, version, header checksum, payload length and checksum);
    with `repair`, delete the bad ones. Raises OSError when no node answers."""
    nodes = _open(config)
    report = RemoteVerifyReport()
    try:
        for client, keys in _batches(nodes, config):
            values = _get_all(client, keys)
            bad = []
            for key, value in zip(keys, values):
                if value is None:  # expired or evicted meanwhile
                    continue
                report.num_checked += 1
                try:
                    decode_record(value)
                except CorruptRecord as exc:
                    bad.append(key)
                    report.bad.append((key.decode(errors="replace"), exc.reason))
            if repair and bad:
                report.num_removed += sum(_delete(client, bad))
        return report
    finally:
        nodes.close()


def remote_clear(config: RemoteConfig) -> int:
    """Delete every block under the key prefix (all layouts); how many were deleted.
    Raises OSError when no node answers."""
    nodes = _open(config)
    try:
        return sum(sum(_delete(client, keys)) for client, keys in _batches(nodes, config))
    finally:
        nodes.close()


def _get_all(client: redis.Redis, keys: list[bytes]) -> list[bytes | None]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe.execute()


def _delete(client: redis.Redis, keys: list[bytes]) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.delete(key)
    return pipe.execute()
