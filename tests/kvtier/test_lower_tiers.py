"""The interface every tier below the host implements (`kvtier.tiers.base.LowerTier`), checked
against each real tier alike: the disk (LMDB), the directory of files and the remote store
(Redis). Each verb must mean the same on all of them, and the jobs a tier builds must report
their outcomes the same way.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.stats import Direction
from kvtier.tiers.base import LowerTier
from kvtier.tiers.directory.tier import DirectoryTier
from kvtier.tiers.disk.tier import DiskTier
from tests.kvtier.disk_cases import BIG_BUDGET, SMALL, make_blocks, same_bytes

TIERS = ["disk", "directory", "remote"]


@pytest.fixture(params=TIERS)
def tier(request: pytest.FixtureRequest, tmp_path) -> LowerTier:
    if request.param == "disk":
        made: LowerTier = DiskTier(tmp_path, SMALL, BIG_BUDGET)
    elif request.param == "directory":
        made = DirectoryTier(tmp_path, SMALL)
    else:
        from kvtier.tiers.remote.config import RemoteConfig
        from kvtier.tiers.remote.tier import RemoteTier
        server = request.getfixturevalue("redis_server")
        made = RemoteTier(RemoteConfig(server.url, key_prefix=f"contract{time.time_ns()}"),
                          SMALL)
    yield made
    made.close()


def slots(num_blocks: int) -> list:
    """Host-slot-like destinations: uint8 views `[bytes_per_block]`."""
    return [torch.zeros(SMALL.bytes_per_block, dtype=torch.uint8).numpy()
            for _ in range(num_blocks)]


def test_every_verb_means_the_same_on_every_tier(tier) -> None:
    metas, payloads = make_blocks(SMALL, seed=21, num_blocks=4)
    hashes = [meta.block_hash for meta in metas]
    assert isinstance(tier, LowerTier) and tier.name in TIERS
    assert tier.contains(hashes) == [False] * 4
    assert tier.put(metas[:2], payloads[:2]) == [True, True]
    assert tier.put(metas[1:3], payloads[1:3]) == [True, True]  # one held already
    assert tier.contains(hashes) == [True, True, True, False]
    dests = slots(4)
    assert tier.get_many_into(metas, dests) == [True, True, True, False]
    for dest, payload in zip(dests[:3], payloads[:3]):
        assert same_bytes(torch.from_numpy(dest), payload)
    assert tier.delete(hashes) == 3
    assert tier.contains(hashes) == [False] * 4
    assert tier.stats() is not None


def test_the_jobs_a_tier_builds_report_per_block(tier) -> None:
    metas, payloads = make_blocks(SMALL, seed=22, num_blocks=3)
    sources = [payload.view(torch.uint8).view(-1).numpy() for payload in payloads]
    job, stored = tier.write_job(metas, sources)
    assert job.direction is tier.writes is Direction(f"host->{tier.kind.value}")
    assert stored == []  # filled when the job runs
    assert job.run() == 3 * SMALL.bytes_per_block
    assert stored == [True] * 3
    dests = slots(3)
    job, results = tier.read_job(metas, dests)
    assert job.direction is tier.reads
    assert job.run() == 3 * SMALL.bytes_per_block and results == [True] * 3
    for dest, payload in zip(dests, payloads):
        assert same_bytes(torch.from_numpy(dest), payload)
