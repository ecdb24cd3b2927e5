"""The tier manager with a remote tier below the disk, against a real Redis server/cluster.

Two managers stand for two engines: A computes blocks (write-through to its host tier,
write-back to the remote tier), B has fresh host and disk tiers and restores them from the
remote tier.
"""

from __future__ import annotations

import time

import pytest
import redis

from kvtier.stats import Direction, Tier
from kvtier.tiers.record import BlockMeta
from kvtier.tiers.remote.config import RemoteConfig
from kvtier.tiers.remote.tier import RemoteTier
from tests.kvtier.manager_cases import (
    chain,
    check_idle,
    config,
    evict_gpu,
    load,
    random_blocks,
    same_bytes,
    small_layout,
    write,
)

LAYOUT = small_layout()


def _remote(url: str, request: pytest.FixtureRequest, **kwargs) -> RemoteConfig:
    prefix = f"m{time.time_ns()}"
    return RemoteConfig(url, key_prefix=prefix, **kwargs)


def _manager(managers, remote: RemoteConfig, tmp_path=None, gpu=24, host=16, **kwargs):
    from kvtier.manager import TierManager
    m = TierManager(LAYOUT, config(LAYOUT, tmp_path, gpu=gpu, host=host, remote=remote,
                                   **kwargs))
    managers.append(m)
    return m


def _restore_check(m, metas: list[BlockMeta], data) -> None:
    """Every block of `metas` restores byte-exact into fresh GPU blocks of `m`."""
    num_ok, blocks = load(m, metas)
    assert num_ok == len(metas)
    for block, expected in zip(blocks, data):
        assert same_bytes(m.kv_cache[block.block_id], expected)
    m.free(blocks)


@pytest.mark.parametrize("topology", ["redis_server", "redis_cluster"])
def test_second_manager_restores_from_the_remote_tier(managers, tmp_path, request,
                                                      topology: str) -> None:
    url = request.getfixturevalue(topology).url
    remote = _remote(url, request)
    a = _manager(managers, remote)
    metas, data = chain(LAYOUT, "doc", 10), random_blocks(LAYOUT, 10, seed=1)
    write(a, metas, data)
    a.flush()  # write-backs are asynchronous; flush waits for them
    assert a.stats().remote.stored == 10
    assert a.stats().transfers[Direction.HOST_TO_REMOTE].num_bytes == 10 * LAYOUT.bytes_per_block

    b = _manager(managers, remote, tmp_path=tmp_path / "b")
    hit = b.lookup([meta.block_hash for meta in metas] + [b"\x00" * 16])
    assert hit.locations == [Tier.REMOTE] * 10
    _restore_check(b, metas, data)
    stats = b.stats()
    assert stats.tiers[Tier.REMOTE].hits == 10 and stats.tiers[Tier.REMOTE].misses == 1
    assert stats.transfers[Direction.REMOTE_TO_HOST].num_bytes == 10 * LAYOUT.bytes_per_block
    # B's host tier holds them now; nothing goes back to the remote tier.
    b.flush()
    assert b.stats().remote.stored == 0 and b.stats().remote.present == 0
    evict_gpu(b)
    assert b.lookup([meta.block_hash for meta in metas]).locations == [Tier.HOST] * 10
    check_idle(b)


def test_lookup_asks_the_remote_tier_only_for_blocks_no_local_tier_has(
        managers, tmp_path, redis_factory, request) -> None:
    server = redis_factory.server()
    remote = _remote(server.url, request)
    metas, data = chain(LAYOUT, "doc", 12), random_blocks(LAYOUT, 12, seed=2)
    a = _manager(managers, remote)
    write(a, metas, data)
    a.flush()
    b = _manager(managers, remote, tmp_path=tmp_path, host=0)  # disk only, then remote
    write(b, metas[:5], data[:5])
    b.flush()
    evict_gpu(b)
    client = redis.Redis(port=server.port)
    client.config_resetstat()
    hit = b.lookup([meta.block_hash for meta in metas])
    assert hit.locations == [Tier.DISK] * 5 + [Tier.REMOTE] * 7
    calls = client.info("commandstats")["cmdstat_exists"]["calls"]
    assert calls == 7  # one EXISTS per block below the disk, in one pipeline
    _restore_check(b, metas, data)


def test_a_bad_remote_block_ends_the_restored_prefix(managers, redis_server, request) -> None:
    remote = _remote(redis_server.url, request)
    metas, data = chain(LAYOUT, "doc", 6), random_blocks(LAYOUT, 6, seed=3)
    a = _manager(managers, remote)
    write(a, metas, data)
    a.flush()
    tier = RemoteTier(remote, LAYOUT)
    key = tier.key(metas[3].block_hash)
    tier.close()
    client = redis.Redis(port=redis_server.port)
    value = client.get(key)
    client.setrange(key, len(value) - 1, bytes([value[-1] ^ 0x10]))

    b = _manager(managers, remote)
    assert b.lookup([m.block_hash for m in metas]).locations == [Tier.REMOTE] * 6
    num_ok, blocks = load(b, metas)
    assert num_ok == 3  # blocks 3.. are recomputed by the caller
    for block, expected in zip(blocks[:3], data[:3]):
        assert same_bytes(b.kv_cache[block.block_id], expected)
    b.free(blocks)
    assert b.stats().tiers[Tier.REMOTE].failures == 1
    assert b.stats().remote.rejected == 1
    check_idle(b)


def test_remote_hits_can_be_kept_on_the_local_disk(managers, tmp_path, redis_server,
                                                   request) -> None:
    remote = _remote(redis_server.url, request, write_to_disk=True)
    metas, data = chain(LAYOUT, "doc", 8), random_blocks(LAYOUT, 8, seed=4)
    a = _manager(managers, remote)
    write(a, metas, data)
    a.flush()
    for host in (4, 0):  # with the host tier (write-back) and without (in the read job)
        b = _manager(managers, remote, tmp_path=tmp_path / f"host{host}", host=host)
        _restore_check(b, metas, data)
        b.flush()
        assert b.disk.contains([m.block_hash for m in metas]) == [True] * 8
        check_idle(b)


def test_without_host_tier_blocks_are_staged_to_remote_and_disk(managers, tmp_path,
                                                                 redis_server, request) -> None:
    remote = _remote(redis_server.url, request)
    metas, data = chain(LAYOUT, "doc", 20), random_blocks(LAYOUT, 20, seed=5)
    a = _manager(managers, remote, tmp_path=tmp_path, host=0, staging_slots=4)
    for i in range(0, 20, 4):  # (a write-through finding no free staging slot is skipped)
        write(a, metas[i:i + 4], data[i:i + 4])
        a.flush()
    assert a.stats().remote.stored == 20
    assert a.disk.contains([m.block_hash for m in metas]) == [True] * 20
    check_idle(a)
    b = _manager(managers, remote, host=0, staging_slots=4)  # no disk: remote via staging
    _restore_check(b, metas, data)
    check_idle(b)


def test_each_block_is_written_to_the_remote_tier_once(managers, redis_server,
                                                       request) -> None:
    remote = _remote(redis_server.url, request)
    metas, data = chain(LAYOUT, "doc", 4), random_blocks(LAYOUT, 4, seed=6)
    a = _manager(managers, remote, gpu=8, host=2)  # host evicts: the blocks come back
    for _ in range(3):
        write(a, metas, data)
        a.flush()
        evict_gpu(a)
    writes = a.stats().transfers[Direction.HOST_TO_REMOTE]
    assert a.stats().remote.stored == 4 and a.stats().remote.present == 0
    assert writes.num_bytes == 4 * LAYOUT.bytes_per_block


def test_a_dead_store_makes_misses_not_errors(managers, redis_factory, request) -> None:
    server = redis_factory.server()
    remote = _remote(server.url, request, timeout_s=0.2, backoff_s=30)
    metas, data = chain(LAYOUT, "doc", 5), random_blocks(LAYOUT, 5, seed=7)
    a = _manager(managers, remote)
    write(a, metas, data)
    a.flush()
    b = _manager(managers, remote)
    assert b.lookup([m.block_hash for m in metas]).locations == [Tier.REMOTE] * 5
    server.kill()
    # The lookup said REMOTE; the store died before the load: every block is a miss.
    num_ok, blocks = load(b, metas)
    assert num_ok == 0
    b.free(blocks)
    started = time.monotonic()
    assert b.lookup([m.block_hash for m in metas]).num_blocks == 0
    write(b, chain(LAYOUT, "other", 3), random_blocks(LAYOUT, 3, seed=8))
    b.flush()  # the write-back to a dead store is dropped, counted
    assert time.monotonic() - started < 1.0  # in back-off: no timeout waited for
    stats = b.stats()
    assert stats.tiers[Tier.REMOTE].failures == 5
    assert stats.tiers[Tier.REMOTE].rejected == 3
    assert stats.remote.unreachable > 0 and stats.remote.nodes_down == 1
    check_idle(b)


def test_roundtrip_bench_remote_smoke_run(redis_cluster) -> None:
    from kvtier.cli.bench.roundtrip import run_roundtrip_bench

    result = run_roundtrip_bench(total_mib=1, repeats=2, num_layers=2, num_kv_heads=2,
                                 head_dim=64, block_size=16, disk=False, device="cpu",
                                 remote_cache=redis_cluster.url)
    remote = result["remote"]
    assert remote["verified"] and remote["cluster"]
    assert remote["plain_get_bytes"] > result["bytes_each_way"]  # records carry a header
    assert remote["restore_gbps"] > 0 and remote["vs_plain_get"] > 0
    # The run's keys are gone afterwards.
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    assert not any(key.startswith(b"bench") for key in client.scan_iter(target_nodes="all"))
    client.close()


def test_a_block_evicted_between_lookup_and_load_ends_the_prefix(managers, redis_server,
                                                                 request) -> None:
    remote = _remote(redis_server.url, request)
    metas, data = chain(LAYOUT, "doc", 6), random_blocks(LAYOUT, 6, seed=9)
    a = _manager(managers, remote)
    write(a, metas, data)
    a.flush()
    b = _manager(managers, remote)
    assert b.lookup([m.block_hash for m in metas]).locations == [Tier.REMOTE] * 6
    a.remote.delete([metas[4].block_hash])  # the store evicts it (LRU, TTL) meanwhile
    num_ok, blocks = load(b, metas)
    assert num_ok == 4
    for block, expected in zip(blocks[:4], data[:4]):
        assert same_bytes(b.kv_cache[block.block_id], expected)
    b.free(blocks)
    assert b.stats().remote.misses == 1 and b.stats().remote.rejected == 0
    check_idle(b)


def test_without_a_remote_tier_redis_is_not_imported() -> None:
    import subprocess
    import sys

    from tests.kvtier.manager_cases import REPO_ROOT
    code = ("import sys; from kvtier.engine import LLM; from kvtier.manager import TierManager; "
            "from kvtier.config import TierConfig; from tests.kvtier.manager_cases import "
            "small_layout; m = TierManager(small_layout(), TierConfig(num_gpu_blocks=4, "
            "host_capacity_bytes=1 << 20)); m.close(); import kvtier.cli.main; "
            "print(sorted(n for n in sys.modules if n == 'redis' or n.startswith('redis.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
