"""The nodes behind a remote URL: one Redis server or the primaries of a Redis Cluster, which
keys each one holds, and which are in back-off after failing.

The remote tier talks to every node through that node's own `redis.Redis` client (its
connection pool), one pipeline per node and call, instead of through redis-py's cluster
pipeline: a node that
fails or times out then costs only its own keys (misses) for a back-off period, and no
cluster-level retry or topology refresh runs on the caller's thread with a dead node in the
way. The slot map is refreshed (on the next I/O call) after a node answered MOVED or ASK.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvtier.tiers.remote.config import RemoteConfig, redact

logger = logging.getLogger(__name__)

_STANDALONE = "server"


@dataclass(frozen=True, slots=True)
class NodeBatch:
    """The keys of one call that one node holds: `indices` into the caller's key list."""

    name: str
    client: redis.Redis
    indices: list[int]


class RemoteNodes:
    """A connection to one server or one cluster, with per-node back-off.

    Connecting happens lazily and again after a back-off when it failed, so an unreachable
    store at start-up is a store of misses, not an error. Thread-safe. Raises ValueError
    (on the first call) when a `+cluster` URL names a server that is not a cluster.
    """

    def __init__(self, config: RemoteConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None
        self._down_until: dict[str, float] = {}
        self._needs_refresh = False
        self.num_backoffs = 0

    # ---- connecting ----------------------------------------------------------------------

    def _client_kwargs(self) -> dict:
        timeout = self.config.timeout_s
        return {"socket_timeout": timeout, "socket_connect_timeout": timeout}

    def _connect(self) -> redis.Redis | RedisCluster | None:
        """The client, opened when needed; None while the store is in back-off."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._clock() < self._down_until.get("*", 0.0):
                return None
        client = self._open()
        with self._lock:
            if client is None:
                self._back_off_locked("*")
                return None
            if self._client is None:
                self._client = client
            elif client is not self._client:
                client.close()
            return self._client

    def _open(self) -> redis.Redis | RedisCluster | None:
        url = self.config.redis_url
        try:
            if not self.config.names_cluster:
                server = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0),
                                              **self._client_kwargs())
                if str(server.info("cluster").get("cluster_enabled", 0)) != "1":
                    return server
                server.close()
            return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0),
                                         require_full_coverage=False, **self._client_kwargs())
        except (redis.RedisError, RedisClusterException) as exc:
            if self.config.names_cluster and "cluster mode is not enabled" in str(exc).lower():
                raise ValueError(f"{redact(self.config.url)} is not a Redis Cluster; use a "
                                 "redis:// URL for one server") from None
            logger.warning("remote cache %s unreachable (%s); misses for %.1f s",
                           redact(self.config.url), exc, self.config.backoff_s)
            return None

    @property
    def is_cluster(self) -> bool:
        return isinstance(self._connect(), RedisCluster)

    # ---- routing -------------------------------------------------------------------------

    def route(self, keys: Sequence[bytes]) -> tuple[list[NodeBatch], int]:
        """Group `keys` by the node holding them, leaving out nodes in back-off. Returns the
        batches and how many keys were left out."""
        client = self._connect()
        if client is None:
            return [], len(keys)
        if not isinstance(client, RedisCluster):
            if self._is_down(_STANDALONE):
                return [], len(keys)
            return [NodeBatch(_STANDALONE, client, list(range(len(keys))))], 0
        groups: dict[str, NodeBatch] = {}
        num_skipped = 0
        for i, key in enumerate(keys):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(key))
            except redis.RedisError:  # a slot no node covers: a miss
                num_skipped += 1
                continue
            if self._is_down(node.name):
                num_skipped += 1
                continue
            if node.name not in groups:
                groups[node.name] = NodeBatch(node.name, node.redis_connection, [])
            groups[node.name].indices.append(i)
        return list(groups.values()), num_skipped

    def primaries(self) -> list[tuple[str, redis.Redis]]:
        """(name, client) of every primary that answers, for scans; [] when none does."""
        client = self._connect()
        if client is None:
            return []
        if not isinstance(client, RedisCluster):
            return [(_STANDALONE, client)]
        return [(node.name, node.redis_connection) for node in client.get_primaries()
                if not self._is_down(node.name)]

    def refresh_if_moved(self) -> None:
        """Reload the slot map if a node answered MOVED/ASK since the last refresh (on an
        I/O thread: it asks the seed nodes, which may take a timeout)."""
        with self._lock:
            client, wanted = self._client, self._needs_refresh
            self._needs_refresh = False
        if wanted and isinstance(client, RedisCluster):
            try:
                client.nodes_manager.initialize()
            except redis.RedisError as exc:
                logger.warning("remote cache: refreshing the slot map failed (%s)", exc)

    # ---- health --------------------------------------------------------------------------

    def note_error(self, name: str, exc: BaseException) -> None:
        """A node's pipeline raised: connection errors and timeouts put it in back-off,
        a redirection asks for a slot-map refresh."""
        if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
            with self._lock:
                self._needs_refresh = True
            return
        logger.warning("remote cache node %s failed (%s: %s); misses for %.1f s", name,
                       type(exc).__name__, exc, self.config.backoff_s)
        with self._lock:
            self._back_off_locked(name)

    def _back_off_locked(self, name: str) -> None:
        """Counted once per outage: calls already under way when a node failed (on other
        threads) fail too, but do not start another back-off."""
        now = self._clock()
        if self._down_until.get(name, 0.0) <= now:
            self.num_backoffs += 1
            self._down_until[name] = now + self.config.backoff_s

    def _is_down(self, name: str) -> bool:
        with self._lock:
            until = self._down_until.get(name)
            if until is None:
                return False
            if self._clock() >= until:
                del self._down_until[name]
                return False
            return True

    def num_down(self) -> int:
        """Nodes (or the whole store, as one) in back-off now."""
        with self._lock:
            now = self._clock()
            return sum(until > now for until in self._down_until.values())

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
