"""RemoteConfig: where the shared remote tier lives and how patiently it is asked.

Kept apart from `kvtier.tiers.remote` so that configuring (and checking) a remote tier does
not import redis-py; only a tier manager that really opens one does.

URL forms (passwords, ACL users, TLS and its options pass through to redis-py):

    redis://[user:password@]host:port[/db]      one server, or a cluster node (probed)
    rediss://...                                the same over TLS
    redis+cluster://[user:password@]host:port   a Redis Cluster, any node as the seed
    rediss+cluster://...                        a Redis Cluster over TLS

A plain `redis://` URL is probed once with `INFO cluster`: a node with `cluster_enabled:1`
is opened as a cluster, so pointing kvtier at any node of a cluster just works. The
`+cluster` schemes skip the probe and fail clearly when the server is not a cluster.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Schemes accepted in a remote URL, and whether each names a cluster outright.
REMOTE_SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True,
                  "rediss+cluster": True}
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The remote tier's knobs.

    url: see the module docstring.
    key_prefix: first part of every key (`<prefix>:<layout fingerprint>:<block hash>`), so
        several deployments can share one store; letters, digits, `_.-`, up to 64.
    timeout_s: socket timeout of every call, and of connecting, in seconds. A call that
        takes longer makes its node a miss for `backoff_s`.
    backoff_s: seconds a node that failed or timed out is skipped (its blocks are misses).
    ttl_s: expiry of stored blocks in seconds (None: none; the store's maxmemory policy
        evicts). write_to_disk: a block loaded from the remote tier is also kept on the
        local disk tier (when there is one).
    write_batch: blocks per pipelined write.

    Raises ValueError naming the field for a bad value or URL.
    """

    url: str
    key_prefix: str = "kvtier"
    timeout_s: float = 0.5
    backoff_s: float = 5.0
    ttl_s: int | None = None
    write_to_disk: bool = False
    write_batch: int = 32

    def __post_init__(self) -> None:
        check_remote_url(self.url)
        if not isinstance(self.key_prefix, str) or not _PREFIX_RE.match(self.key_prefix):
            raise ValueError("RemoteConfig.key_prefix must be 1-64 letters, digits or '_.-', "
                             f"got {self.key_prefix!r}")
        for field in ("timeout_s", "backoff_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RemoteConfig.{field} must be a positive number of seconds, "
                                 f"got {value!r}")
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool)
                                       or not isinstance(self.ttl_s, int) or self.ttl_s <= 0):
            raise ValueError(f"RemoteConfig.ttl_s must be a positive integer or None, "
                             f"got {self.ttl_s!r}")
        if isinstance(self.write_batch, bool) or not isinstance(self.write_batch, int) \
                or self.write_batch <= 0:
            raise ValueError(f"RemoteConfig.write_batch must be a positive integer, "
                             f"got {self.write_batch!r}")

    @property
    def names_cluster(self) -> bool:
        """True when the URL's scheme says "cluster" (no probe needed)."""
        return REMOTE_SCHEMES[urlsplit(self.url).scheme]

    @property
    def redis_url(self) -> str:
        """The URL as redis-py reads it (the `+cluster` part dropped)."""
        return self.url.replace("+cluster://", "://", 1)


def check_remote_url(url: object) -> None:
    """Raise ValueError, saying what a good URL looks like, unless `url` is one."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"a remote cache URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in REMOTE_SCHEMES:
        raise ValueError(f"remote cache URL {redact(url)!r}: scheme must be one of "
                         f"{sorted(REMOTE_SCHEMES)}, e.g. redis://host:6379/0 or "
                         "redis+cluster://host:7000")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"remote cache URL {redact(url)!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"remote cache URL {redact(url)!r} names no host; "
                         "e.g. redis://127.0.0.1:6379/0")
    del port


def redact(url: str) -> str:
    """`url` with its password replaced by `***` (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
