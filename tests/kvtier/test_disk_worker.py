"""The disk tier in a worker process (`DiskWorkerTier`): blocks travel as offsets into the
host slab both processes map, or as bytes for any other buffer; what it stores outlives it;
a worker that dies leaves a tier that misses and refuses, never one that hangs or raises;
opening errors come back as the in-process tier's.

Real worker processes on real LMDB files in temp dirs, and a real shared slab.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from manager_cases import chain, config, random_blocks, small_layout, write

from kvtier.manager import TierManager
from kvtier.shared_host_memory import SharedHostMemory, map_shared
from kvtier.tiers.disk.key_changes import KeyChanges
from kvtier.tiers.disk.key_replica import KeyReplica
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shard_layout import shard_of
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.disk.worker_tier import DiskWorkerTier, WorkerCalls
from kvtier.tiers.host import HostTier

LAYOUT = small_layout(torch.bfloat16)
BUDGET = 1 << 24


@pytest.fixture
def host() -> Iterator[HostTier]:
    tier = HostTier(LAYOUT, 8, pin_memory=False, shared=True)
    yield tier
    tier.close()


def start(path: Path, host: HostTier, **options: object) -> DiskWorkerTier:
    tier, recovery = DiskWorkerTier.start(path, LAYOUT, BUDGET, shared=host.shared_memory,
                                          **options)
    assert tier is not None and recovery is None
    return tier


def rows(host: HostTier, slots: range) -> list[np.ndarray]:
    return [host.slot_array(slot) for slot in slots]


def test_blocks_go_through_the_shared_slab_and_outlive_the_worker(tmp_path: Path,
                                                                  host: HostTier) -> None:
    metas, data = chain(LAYOUT, "doc", 6), random_blocks(LAYOUT, 6, seed=3)
    host.slab[:6] = data
    tier = start(tmp_path / "kv", host)
    try:
        assert tier.put(metas, rows(host, range(6))) == [True] * 6
        host.slab[:6] = 0
        hashes = [meta.block_hash for meta in metas]
        assert tier.contains(hashes + [b"x" * 16]) == [True] * 6 + [False]
        # Read back into other slots: the worker wrote the slab's bytes.
        assert tier.get_many_into(metas[:4], rows(host, range(4, 8))) == [True] * 4
        assert torch.equal(host.slab[4:8].view(torch.uint8), data[:4].view(torch.uint8))
        assert tier.delete(hashes[:1]) == 1
        stats = tier.stats()
        assert stats.num_blocks == 5 and stats.puts == 6 and stats.hits == 4
        calls = tier.calls()  # the round trips the caller waited for, per verb
        counts = {verb: c.calls for verb, c in calls.items()}
        # The lookup went to the worker, or to the replica once the worker found it current.
        assert counts.pop("contains", 0) + counts.pop("contains_replica", 0) == 1
        assert counts == {"put": 1, "get": 1, "delete": 1, "stats": 1}
        assert all(c.seconds > 0 for c in calls.values())
    finally:
        tier.close()
    tier.close()  # idempotent
    # The in-process tier finds what the worker stored.
    disk, _ = open_disk_tier(tmp_path / "kv", LAYOUT, BUDGET)
    assert disk is not None
    with disk:
        assert disk.contains(hashes) == [False] + [True] * 5
        dest = torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8)
        assert disk.get_into(metas[5], dest)
        assert torch.equal(dest, data[5].reshape(-1).view(torch.uint8))


def wait_for_replica(tier: DiskWorkerTier, hashes: list[bytes], expected: list[bool]) -> None:
    """Until the tier answers `expected` from its replica, not the worker (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if tier._replica.lookup(hashes) == expected:
            return
        time.sleep(0.02)
    raise AssertionError(f"the replica did not answer {expected} within 10 s")


@pytest.mark.parametrize("shards", [1, 3])
def test_lookups_come_from_the_replica_and_see_every_write(tmp_path: Path, host: HostTier,
                                                           shards: int) -> None:
    """Once the worker found its copy current, lookups are answered in this process; a
    write or delete is in the replica by the time it returns; another process's writes to
    the directory reach it within a few of the worker's checks."""
    metas, data = chain(LAYOUT, "replica", 6), random_blocks(LAYOUT, 6, seed=9)
    hashes = [meta.block_hash for meta in metas]
    host.slab[:6] = data
    tier = start(tmp_path / "kv", host, shards=shards)
    try:
        wait_for_replica(tier, hashes, [False] * 6)
        assert tier.put(metas[:4], rows(host, range(4))) == [True] * 4
        assert tier.contains(hashes) == [True] * 4 + [False] * 2  # no waiting
        assert tier.delete(hashes[:1]) == 1
        assert tier.contains(hashes) == [False] + [True] * 3 + [False] * 2
        asked = tier.calls().get("contains", WorkerCalls()).calls
        # Another process (the in-process tier here) writes the last two blocks.
        other, _ = open_disk_tier(tmp_path / "kv", LAYOUT, BUDGET, shards=shards)
        assert other is not None
        with other:
            assert other.put(metas[4:], [host.slot_array(i) for i in (4, 5)]) == [True] * 2
        wait_for_replica(tier, hashes, [False] + [True] * 5)
        assert tier.contains(hashes) == [False] + [True] * 5
        assert tier.calls()["contains_replica"].calls >= 2
        assert tier.calls().get("contains", WorkerCalls()).calls == asked
    finally:
        tier.close()


def test_the_replica_replays_the_copys_events() -> None:
    h = [bytes([i]) * 16 for i in range(4)]
    replica = KeyReplica(num_shards=2, fresh_s=60.0)
    assert replica.lookup(h) is None  # nothing loaded
    for shard in (0, 1):
        replica.apply(shard, ("loaded", [x for x in h[:2] if shard_of(x, 2) == shard]))
    assert replica.lookup(h) is None  # loaded, not yet found current
    replica.apply(0, ("current", None))
    replica.apply(1, ("current", None))
    assert replica.lookup(h) == [True, True, False, False]
    changes = KeyChanges()
    changes.added(h[2])
    changes.removed(h[0])
    for shard in (0, 1):  # each shard's copy is told its own commit's changes
        mine = KeyChanges([step for step in changes.steps if shard_of(step[0], 2) == shard])
        replica.apply(shard, ("changed", mine))
    assert replica.lookup(h) == [False, True, True, False]
    replica.apply(1, ("dropped", None))  # one shard's copy dropped: ask the worker
    assert replica.lookup(h) is None
    replica.apply(1, ("loaded", []))
    replica.apply(1, ("current", None))
    assert replica.lookup([h[3]]) == [False]
    replica.clear()
    assert replica.lookup(h) is None


def test_buffers_outside_the_slab_travel_as_bytes(tmp_path: Path, host: HostTier) -> None:
    metas, data = chain(LAYOUT, "bytes", 3), random_blocks(LAYOUT, 3, seed=4)
    tier = start(tmp_path / "kv", host)
    try:
        assert tier.put(metas, [data[i].clone() for i in range(3)]) == [True] * 3
        dests = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8) for _ in range(3)]
        hits = tier.get_many_into(metas + [chain(LAYOUT, "absent", 1)[0]],
                                  dests + [torch.empty_like(dests[0])])
        assert hits == [True] * 3 + [False]
        for dest, block in zip(dests, data):
            assert torch.equal(dest, block.reshape(-1).view(torch.uint8))
        with pytest.raises(ValueError, match="bytes"):  # checked before anything is sent
            tier.put(metas[:1], [b"short"])
        assert tier.stats().puts == 3
    finally:
        tier.close()


def test_a_dead_worker_leaves_a_tier_that_misses_and_refuses(tmp_path: Path,
                                                             host: HostTier) -> None:
    metas, data = chain(LAYOUT, "dead", 2), random_blocks(LAYOUT, 2, seed=5)
    host.slab[:2] = data
    tier = start(tmp_path / "kv", host)
    assert tier.put(metas, rows(host, range(2))) == [True, True]
    before = tier.stats()
    os.kill(tier._process.pid, signal.SIGKILL)
    tier._process.wait()
    tier._receiver.join(timeout=10)
    assert tier.unavailable is not None and "exited" in tier.unavailable
    hashes = [meta.block_hash for meta in metas]
    assert tier.contains(hashes) == [False, False]
    assert tier.get_many_into(metas, rows(host, range(2, 4))) == [False, False]
    assert tier.put(metas, rows(host, range(2))) == [False, False]
    assert tier.delete(hashes) == 0
    assert tier.stats() == before  # the last counters it told
    tier.sync()
    tier.close()


def test_the_worker_outlives_signals_and_ends_when_the_engine_goes(tmp_path: Path,
                                                                  host: HostTier) -> None:
    """Ctrl-C and SIGTERM reach the whole process group; the engine's shutdown flushes
    through the worker after them. The engine's socket closing (its process gone) ends it."""
    metas, data = chain(LAYOUT, "signals", 2), random_blocks(LAYOUT, 2, seed=6)
    host.slab[:2] = data
    tier = start(tmp_path / "kv", host)
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(tier._process.pid, signum)
        assert tier.put(metas, rows(host, range(2))) == [True, True]
        assert tier.unavailable is None and tier._process.poll() is None
    finally:
        tier.close()
    # An engine process killed while its worker runs: the worker closes its tier and exits.
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(tmp_path / "kv")],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(engine.stdout.readline())
        engine.kill()
        engine.wait()
        deadline = time.monotonic() + 30
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), "the worker outlived its engine"
    finally:
        engine.kill()
    disk, _ = open_disk_tier(tmp_path / "kv", LAYOUT, BUDGET)
    assert disk is not None
    with disk:
        assert disk.contains([meta.block_hash for meta in metas]) == [True, True]


#: An engine's process in miniature: a shared slab and a worker; prints the worker's pid.
ENGINE = textwrap.dedent("""
    import sys, time, torch
    from kvtier.layout import KVLayout
    from kvtier.tiers.disk.worker_tier import DiskWorkerTier
    from kvtier.tiers.host import HostTier
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                      dtype=torch.bfloat16)  # LAYOUT
    host = HostTier(layout, 4, pin_memory=False, shared=True)
    tier, _ = DiskWorkerTier.start(sys.argv[1], layout, 1 << 24,
                                   shared=host.shared_memory)
    print(tier._process.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, whose parent is gone, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("interpreter", ["/bin/false", "/nonexistent/python3"])
def test_a_worker_that_cannot_start_leaves_the_tier_in_the_engines_process(
        tmp_path: Path, managers: list, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, interpreter: str) -> None:
    """A machine where the worker cannot run (its interpreter exits at once, or is not
    there): the manager serves the disk tier itself, over the shared slab, and says so."""
    monkeypatch.setattr(sys, "executable", interpreter)
    m = TierManager(LAYOUT, config(LAYOUT, tmp_path, gpu=4, host=2, disk_worker=True))
    managers.append(m)
    assert not m.uses_disk_worker and isinstance(m.disk, DiskTier)
    assert "runs in the engine's process instead" in caplog.text
    metas, data = chain(LAYOUT, "fallback", 4), random_blocks(LAYOUT, 4, seed=8)
    write(m, metas, data)
    m.flush()
    assert m.disk.contains([meta.block_hash for meta in metas]) == [True] * 4


def test_opening_errors_are_those_of_the_in_process_tier(tmp_path: Path,
                                                         host: HostTier) -> None:
    with pytest.raises(ValueError, match="budget"):
        DiskWorkerTier.start(tmp_path / "kv", LAYOUT, 0, shared=host.shared_memory)
    with pytest.raises(ValueError, match="budget"):
        open_disk_tier(tmp_path / "kv2", LAYOUT, 0)


def test_a_damaged_directory_is_moved_aside_as_in_process(tmp_path: Path,
                                                          host: HostTier) -> None:
    """What recovery did comes back from the worker."""
    (tmp_path / "kv").mkdir(mode=0o700)
    (tmp_path / "kv" / "data.mdb").write_bytes(b"not an LMDB file" * 1024)
    tier, recovery = DiskWorkerTier.start(tmp_path / "kv", LAYOUT, BUDGET,
                                          shared=host.shared_memory)
    assert tier is not None
    try:
        assert recovery is not None and recovery.moved_to is not None
        assert tier.stats().num_blocks == 0
    finally:
        tier.close()


def test_shared_memory_maps_the_same_bytes_in_another_mapping() -> None:
    memory = SharedHostMemory(4096, pin=False)
    try:
        mapped = map_shared(memory.path, 4096)
        memory.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert bytes(mapped[:4]) == b"\x01\x02\x03\x04"
        mapped[4:6] = b"\x07\x08"
        assert memory.data[4:6].tolist() == [7, 8]
        assert memory.offset_of(memory.base_address + 100, 8) == 100
        assert memory.offset_of(memory.base_address + 4090, 8) is None
        with pytest.raises(OSError, match="fewer"):
            map_shared(memory.path, 8192)
        mapped.close()
    finally:
        memory.close()
    with pytest.raises(ValueError, match="positive"):
        SharedHostMemory(0, pin=False)
