"""`kvtier bench roundtrip --remote-cache URL`: remote -> host -> GPU restores through the tier
manager, side by side with a plain redis-py pipeline of GETs of the same values.

A writer manager (host tier on, remote tier on) computes `num_blocks` blocks and flushes
them to the store under a key prefix of this run alone. A reader manager with the host tier
off (its staging slab holds every block, so nothing waits for a slot) then restores them:
one `lookup` (one pipelined EXISTS round trip) plus `prepare_load` / `complete_load`
(pipelined GETs on the I/O threads, record validation and checksum, copy into host slots,
host -> GPU copy). The baseline reads the same keys with one pipeline of GETs through
redis-py's own client (`RedisCluster.pipeline()` for a cluster) and does nothing with them.
The two alternate within every repeat; figures are medians. The run's keys are deleted at
the end.
"""

from __future__ import annotations

import statistics
import time

import torch
from kvtier.cli.bench.roundtrip import store_random_blocks

from kvtier.config import TierConfig
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.tiers.record import BlockMeta
from kvtier.tiers.remote.config import RemoteConfig


def _baseline_client(config: RemoteConfig):
    """redis-py's own client for the store (a cluster client when the tier found one)."""
    import redis
    from redis.cluster import RedisCluster

    from kvtier.tiers.remote.nodes import RemoteNodes
    nodes = RemoteNodes(config)
    try:
        cluster = nodes.is_cluster
    finally:
        nodes.close()
    if cluster:
        return RedisCluster.from_url(config.redis_url)
    return redis.Redis.from_url(config.redis_url)


def remote_restores(layout: KVLayout, device: torch.device, metas: list[BlockMeta],
                    url: str, repeats: int, swap_method: str, io_threads: int,
                    seed: int) -> dict:
    """Median seconds of a kvtier restore and of a plain pipeline of GETs of the same
    blocks, and whether every restored byte matched. Raises OSError when the store cannot
    be reached."""
    num_blocks = len(metas)
    config = RemoteConfig(url, key_prefix=f"bench{time.time_ns()}", timeout_s=30.0,
                          write_batch=16)
    writer = TierManager(layout, TierConfig(
        num_gpu_blocks=num_blocks, host_capacity_bytes=num_blocks * layout.bytes_per_block,
        swap_method=swap_method, remote=config), device)
    try:
        expected = store_random_blocks(writer, metas, device, seed)
        writer.flush()
        num_stored = writer.stats().remote.stored
    finally:
        writer.close()
    if num_stored != num_blocks:
        raise OSError(f"the store at {url} took {num_stored} of {num_blocks} blocks; is it "
                      "reachable, with maxmemory room for them?")
    reader = TierManager(layout, TierConfig(
        num_gpu_blocks=num_blocks, swap_method=swap_method, staging_slots=num_blocks,
        io_threads=io_threads, remote=config), device)
    client = _baseline_client(config)
    keys = [reader.remote.key(meta.block_hash) for meta in metas]
    try:
        restore_s, plain_s, verified, plain_bytes = [], [], True, 0
        for _ in range(repeats):
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            values = pipe.execute()
            plain_s.append(time.perf_counter() - started)
            plain_bytes = sum(len(v) for v in values if v is not None)
            del values, pipe

            targets = reader.allocate(num_blocks)  # evicts the previous repeat's blocks
            assert targets is not None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            hit = reader.lookup([meta.block_hash for meta in metas])
            num_ok = reader.complete_load(reader.prepare_load(metas[:hit.num_blocks],
                                                               targets[:hit.num_blocks]))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            restore_s.append(time.perf_counter() - started)
            got = reader.kv_cache.index_select(
                0, torch.tensor([t.block_id for t in targets], device=device))
            verified &= num_ok == num_blocks and torch.equal(
                got.view(torch.uint8), expected.view(torch.uint8))
            reader.free(targets)
            reader.poll()
        return {"restore_s": statistics.median(restore_s), "restore_runs_s": restore_s,
                "plain_get_s": statistics.median(plain_s), "plain_get_runs_s": plain_s,
                "plain_get_bytes": plain_bytes, "verified": bool(verified),
                "io_threads": io_threads, "cluster": reader.remote.nodes.is_cluster}
    finally:
        client.close()
        reader.remote.delete([meta.block_hash for meta in metas])
        reader.close()
