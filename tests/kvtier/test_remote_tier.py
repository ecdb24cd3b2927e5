"""RemoteTier against real Redis: a standalone server and a 3-master cluster.

Every stored value is a disk-tier record, so each way a value can go bad (flipped bytes,
another layout or block, truncation) must read as a miss, never as the block.
"""

from __future__ import annotations

import time

import pytest
import redis
import torch

from kvtier.tiers.record import encode_record
from kvtier.tiers.remote.config import RemoteConfig, redact
from kvtier.tiers.remote.tier import RemoteTier
from tests.kvtier.disk_cases import LARGE, SMALL, make_blocks, same_bytes

TOPOLOGIES = ["redis_server", "redis_cluster"]


@pytest.fixture(params=TOPOLOGIES)
def store(request: pytest.FixtureRequest):
    """(url, a raw redis-py client of the same store) for each topology."""
    target = request.getfixturevalue(request.param)
    if request.param == "redis_cluster":
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=target.nodes[0].port)
    else:
        client = redis.Redis(port=target.port)
    yield target.url, client
    client.close()


def _prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test alone (tests share the servers of the test run)."""
    return "t" + format(abs(hash(request.node.nodeid)) % 10**12, "d") + str(time.time_ns())


def _tier(url: str, request: pytest.FixtureRequest, layout=SMALL, **kwargs) -> RemoteTier:
    tier = RemoteTier(RemoteConfig(url, key_prefix=_prefix(request), **kwargs), layout)
    request.addfinalizer(tier.close)
    return tier


def _read(tier: RemoteTier, metas) -> list[torch.Tensor | None]:
    dests = [torch.empty(tier.layout.block_shape, dtype=tier.layout.dtype) for _ in metas]
    oks = tier.get_many_into(metas, dests)
    return [d if ok else None for d, ok in zip(dests, oks)]


def test_round_trip_is_byte_exact(store, request) -> None:
    url, _ = store
    tier = _tier(url, request, layout=LARGE)
    metas, payloads = make_blocks(LARGE, seed=1, num_blocks=12)
    # Nothing stored yet: misses.
    assert tier.contains([m.block_hash for m in metas]) == [False] * 12
    assert tier.put(metas[:8], payloads[:8]) == [True] * 8
    assert tier.contains([m.block_hash for m in metas]) == [True] * 8 + [False] * 4
    got = _read(tier, metas)
    for i in range(8):
        assert got[i] is not None and same_bytes(got[i], payloads[i])
    assert got[8:] == [None] * 4
    # A second put finds them present and writes nothing.
    assert tier.put(metas[:2], payloads[:2]) == [True, True]
    stats = tier.stats()
    assert (stats.stored, stats.present, stats.hits, stats.misses) == (8, 2, 8, 4)
    assert stats.rejected == stats.refused == stats.unreachable == 0


def test_cluster_spreads_keys_over_all_masters(redis_cluster, request) -> None:
    tier = _tier(redis_cluster.url, request)
    metas, payloads = make_blocks(SMALL, seed=2, num_blocks=60)
    assert all(tier.put(metas, payloads))
    assert tier.nodes.is_cluster
    counts = [int(node.cli("DBSIZE") or 0) for node in redis_cluster.nodes]
    assert all(count > 0 for count in counts), counts
    assert sorted(tier.iter_keys()) == sorted(tier.key(m.block_hash) for m in metas)


def test_plain_url_to_a_cluster_node_is_probed_as_a_cluster(redis_cluster, request) -> None:
    url = f"redis://127.0.0.1:{redis_cluster.nodes[1].port}/0"
    tier = _tier(url, request)
    metas, payloads = make_blocks(SMALL, seed=3, num_blocks=20)
    assert all(tier.put(metas, payloads))
    assert tier.nodes.is_cluster
    assert all(x is not None for x in _read(tier, metas))


def test_cluster_scheme_against_one_server_says_what_to_use(redis_server, request) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_server.port}"
    tier = _tier(url, request)
    with pytest.raises(ValueError, match="not a Redis Cluster"):
        tier.contains([b"x" * 16])


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate",
                                    "other_layout", "other_block", "garbage"])
def test_a_bad_value_is_a_miss_and_is_deleted(store, request, damage: str) -> None:
    url, client = store
    tier = _tier(url, request)
    metas, payloads = make_blocks(SMALL, seed=4, num_blocks=3)
    assert all(tier.put(metas, payloads))
    key = tier.key(metas[1].block_hash)
    value = client.get(key)
    if damage == "flip_payload":  # SETRANGE over the last bytes, as redis-cli would
        client.setrange(key, len(value) - 5, bytes(b ^ 0xFF for b in value[-5:]))
    elif damage == "flip_header":
        client.setrange(key, 30, bytes([value[30] ^ 0x01]))
    elif damage == "truncate":
        client.set(key, value[:-100])
    elif damage == "other_layout":
        other = make_blocks(LARGE, seed=4, num_blocks=3)
        client.set(key, encode_record(metas[1], LARGE, other[1][1].numpy().tobytes()))
    elif damage == "other_block":  # a valid record of another block under this key
        raw = payloads[2].view(torch.uint8).numpy().tobytes()
        client.set(key, encode_record(metas[2], SMALL, raw))
    else:
        client.set(key, b"not a kv block")
    got = _read(tier, metas)
    assert got[0] is not None and same_bytes(got[0], payloads[0])
    assert got[1] is None
    assert got[2] is not None and same_bytes(got[2], payloads[2])
    assert tier.stats().rejected == 1
    assert client.exists(key) == 0  # the bad value is gone; a later put can store it again
    assert tier.put(metas[1:2], payloads[1:2]) == [True]
    assert same_bytes(_read(tier, metas[1:2])[0], payloads[1])


def test_full_store_refuses_writes_and_they_are_counted(redis_factory, request) -> None:
    server = redis_factory.server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    tier = _tier(server.url, request, layout=LARGE)
    metas, payloads = make_blocks(LARGE, seed=5, num_blocks=200)  # 6.4 MiB of blocks
    stored = []
    for i in range(0, 200, 20):
        stored += tier.put(metas[i:i + 20], payloads[i:i + 20])
    num_stored = sum(stored)
    assert 0 < num_stored < 200
    stats = tier.stats()
    assert stats.refused == 200 - num_stored and stats.stored == num_stored
    got = _read(tier, metas)
    for ok, data, payload in zip(stored, got, payloads):
        assert (data is not None) == ok
        assert data is None or same_bytes(data, payload)


def test_ttl_expires_blocks(redis_server, request) -> None:
    tier = _tier(redis_server.url, request, ttl_s=1)
    metas, payloads = make_blocks(SMALL, seed=6, num_blocks=2)
    assert all(tier.put(metas, payloads))
    ttl = redis.Redis(port=redis_server.port).ttl(tier.key(metas[0].block_hash))
    assert 0 < ttl <= 1
    deadline = time.monotonic() + 10
    while any(tier.contains([m.block_hash for m in metas])):
        assert time.monotonic() < deadline, "blocks did not expire"
        time.sleep(0.2)


def test_unreachable_store_is_misses_then_back_off(redis_factory, request) -> None:
    server = redis_factory.server()
    tier = _tier(server.url, request, timeout_s=0.2, backoff_s=0.5)
    metas, payloads = make_blocks(SMALL, seed=7, num_blocks=4)
    assert all(tier.put(metas, payloads))
    server.kill()
    started = time.monotonic()
    assert tier.contains([m.block_hash for m in metas]) == [False] * 4
    assert _read(tier, metas) == [None] * 4
    assert tier.put(metas, payloads) == [False] * 4
    assert time.monotonic() - started < 2.0
    stats = tier.stats()
    assert stats.backoffs >= 1 and stats.nodes_down == 1 and stats.unreachable >= 8
    # Restarted on the same port: used again once the back-off ran out.
    server.start()
    time.sleep(0.6)
    assert tier.put(metas, payloads) == [True] * 4
    assert tier.contains([m.block_hash for m in metas]) == [True] * 4


def test_store_down_at_start_is_misses(request) -> None:
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tier = _tier(f"redis://127.0.0.1:{port}/0", request, timeout_s=0.2)
    metas, _ = make_blocks(SMALL, seed=8, num_blocks=2)
    assert tier.contains([m.block_hash for m in metas]) == [False, False]
    assert tier.stats().backoffs == 1


def test_password_comes_from_the_url(redis_factory, request) -> None:
    server = redis_factory.server("--requirepass", "s3cret")
    good = _tier(f"redis://:s3cret@127.0.0.1:{server.port}/0", request)
    metas, payloads = make_blocks(SMALL, seed=9, num_blocks=2)
    assert good.put(metas, payloads) == [True, True]
    bad = _tier(f"redis://:wrong@127.0.0.1:{server.port}/0", request)
    assert bad.contains([m.block_hash for m in metas]) == [False, False]
    assert bad.stats().backoffs == 1


@pytest.mark.parametrize("url, message", [
    ("http://host:1", "scheme must be one of"),
    ("redis://", "names no host"),
    ("redis://host:notaport", "port"),
    ("", "non-empty"),
])
def test_bad_urls_say_what_a_good_one_is(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RemoteConfig(url)


def test_passwords_are_redacted() -> None:
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"


def test_an_acl_user_limited_to_its_prefix_is_enough(redis_factory, request) -> None:
    """The ACL docs/RELIABILITY.md recommends: kvtier works with it, and cannot touch keys
    outside its prefix."""
    from kvtier.tiers.remote.admin import remote_clear, remote_stats, remote_verify

    server = redis_factory.server()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "kvtier", "on", ">pw", "~tenant1:*", "+get",
                          "+set", "+exists", "+del", "+scan", "+strlen", "+info", "+ttl",
                          "+object", "+ping")
    admin.set("other:secret", b"x")
    config = RemoteConfig(f"redis://kvtier:pw@127.0.0.1:{server.port}/0", key_prefix="tenant1")
    tier = RemoteTier(config, SMALL)
    request.addfinalizer(tier.close)
    metas, payloads = make_blocks(SMALL, seed=10, num_blocks=3)
    assert tier.put(metas, payloads) == [True] * 3
    assert all(x is not None for x in _read(tier, metas))
    assert tier.stats().backoffs == 0
    assert remote_stats(config)["num_blocks"] == 3
    assert remote_verify(config).ok
    assert remote_clear(config) == 3
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis(port=server.port, username="kvtier", password="pw").get("other:secret")


def test_tls_and_its_options_come_from_the_url(redis_factory, tmp_path, request) -> None:
    import shutil
    import subprocess

    from tests.redis_servers import _free_port
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    tls_port = _free_port()
    redis_factory.server("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                         "--tls-auth-clients", "no")
    metas, payloads = make_blocks(SMALL, seed=11, num_blocks=3)
    trusting = _tier(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}", request)
    assert trusting.put(metas, payloads) == [True] * 3
    assert all(x is not None for x in _read(trusting, metas))
    # Without the CA the certificate is not trusted: a store in back-off, never an error.
    untrusting = _tier(f"rediss://127.0.0.1:{tls_port}/0", request, timeout_s=1.0)
    assert untrusting.contains([m.block_hash for m in metas]) == [False] * 3
    assert untrusting.stats().backoffs == 1
