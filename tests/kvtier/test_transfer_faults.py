"""Transfers that fail part-way: the tier manager releases its pins and slots, treats the
blocks as misses, never hangs, and never serves a wrong block.

Faults are injected through real seams of the real manager: a `DiskTier` subclass whose
reads and writes raise on chosen calls (some after doing half of their work, so the disk
holds a half-written batch and the host slots half-read bytes), and the transfer engine's
copy function (`TransferEngine._swap`) replaced by one that raises on chosen calls, some
after copying the first block. Everything else, the manager, the pool, the host tier,
LMDB, the I/O threads, runs as it does in production.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import torch

from kvtier.config import TierConfig
from kvtier.free_queue import KVCacheBlock
from kvtier.hashing import BlockHash, hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Direction, Tier
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import BlockMeta, encode_record, metas_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)


class InjectedFault(OSError):
    """The error the faulty seams raise (an I/O error, as a failing disk gives)."""


class Faults:
    """Which calls of one seam fail: a seeded coin per call, or the listed call numbers.
    A failing call raises before doing anything, or (`partial`) after half of its work."""

    def __init__(self, rate: float = 0.0, seed: int = 0, calls: frozenset[int] = frozenset(),
                 partial_rate: float = 0.5) -> None:
        self.rate, self.calls, self.partial_rate = rate, calls, partial_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # I/O threads call the disk seams concurrently
        self.num_calls = self.num_failed = 0

    def next_call(self) -> tuple[bool, bool]:
        """(fail this call, fail it after half of the work)."""
        with self._lock:
            call = self.num_calls
            self.num_calls += 1
            fail = call in self.calls or self._rng.random() < self.rate
            partial = self._rng.random() < self.partial_rate
            self.num_failed += fail
        return fail, partial


class FaultyDisk(DiskTier):
    """A real disk tier whose batched reads and writes fail as `read_faults` and
    `write_faults` say. A partial read copies the first half of the batch into its
    destinations, then raises; a partial write commits the first half, then raises."""

    read_faults = Faults()
    write_faults = Faults()

    def get_many_into(self, metas, dests):
        fail, partial = self.read_faults.next_call()
        if fail:
            if partial and len(metas) > 1:
                half = len(metas) // 2
                super().get_many_into(metas[:half], dests[:half])
            raise InjectedFault("injected disk read error")
        return super().get_many_into(metas, dests)

    def put_counted(self, metas, payloads):
        fail, partial = self.write_faults.next_call()
        if fail:
            if partial and len(metas) > 1:
                half = len(metas) // 2
                super().put_counted(metas[:half], payloads[:half])
            raise InjectedFault("injected disk write error")
        return super().put_counted(metas, payloads)


def faulty_swap(real: Callable[..., None], faults: Faults) -> Callable[..., None]:
    """The transfer engine's copy function, failing as `faults` says; a partial failure
    copies the first block of the mapping before it raises."""

    def swap(src, dst, block_mapping, **kwargs):
        fail, partial = faults.next_call()
        if fail:
            if partial:
                real(src, dst, block_mapping[:1], **kwargs)
            raise RuntimeError("injected copy error")
        real(src, dst, block_mapping, **kwargs)

    return swap


@pytest.fixture
def faulty_manager(tmp_path, monkeypatch) -> Callable[..., TierManager]:
    """Build managers whose disk tier is a FaultyDisk (patched into the manager module);
    closed at the end of the test."""
    made: list[TierManager] = []

    def build(num_gpu: int, num_host: int, reads: Faults, writes: Faults,
              swaps: Faults | None = None, num_disk: int = 256) -> TierManager:
        disk_class = type("Disk", (FaultyDisk,), {"read_faults": reads, "write_faults": writes})
        monkeypatch.setattr("kvtier.open_tiers.DiskTier", disk_class)
        config = TierConfig.from_slots(LAYOUT, num_gpu, num_host, tmp_path / "kv", num_disk,
                                       io_threads=2)
        m = TierManager(LAYOUT, config)
        made.append(m)
        assert isinstance(m.disk, FaultyDisk)
        if swaps is not None:
            monkeypatch.setattr(m.transfers, "_swap", faulty_swap(m.transfers._swap, swaps))
        return m

    yield build
    monkeypatch.undo()  # close() flushes: let the last writes through
    for m in made:
        m.close()


class Truth:
    """What each block hash must hold: sequences of chained blocks with seeded bytes."""

    def __init__(self) -> None:
        self.data: dict[BlockHash, torch.Tensor] = {}
        self.metas: dict[BlockHash, BlockMeta] = {}

    def sequence(self, name: str, num_blocks: int) -> list[BlockMeta]:
        parent = namespace_hash(name, LAYOUT)
        token_ids = [sum(map(ord, name)) * 7 + i for i in range(num_blocks * LAYOUT.block_size)]
        metas = metas_for(parent, hash_blocks(parent, token_ids, LAYOUT.block_size), token_ids,
                          LAYOUT.block_size)
        for meta in metas:
            if meta.block_hash not in self.data:
                generator = torch.Generator().manual_seed(hash_seed(meta.block_hash))
                raw = torch.randint(0, 256, (LAYOUT.bytes_per_block,), dtype=torch.uint8,
                                    generator=generator)
                self.data[meta.block_hash] = raw.view(LAYOUT.dtype).view(LAYOUT.block_shape)
                self.metas[meta.block_hash] = meta
        return metas

    def holds(self, cache: torch.Tensor, meta: BlockMeta) -> bool:
        return torch.equal(cache.view(torch.uint8), self.data[meta.block_hash].view(torch.uint8))


def hash_seed(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def compute(m: TierManager, truth: Truth, metas: list[BlockMeta]) -> None:
    """What an engine does for blocks it had to compute: write them, cache them, free them."""
    blocks = m.allocate(len(metas))
    if blocks is None:  # blocks still held by transfers in flight: wait for them
        m.drain()
        blocks = m.allocate(len(metas))
    assert blocks is not None, "test setup: not enough free GPU blocks"
    for block, meta in zip(blocks, metas):
        m.kv_cache[block.block_id] = truth.data[meta.block_hash]
    m.cache_full_blocks(blocks, metas)
    m.submit_stores()  # as the engine does while the next step runs
    m.free(blocks)
    m.poll()


def restore(m: TierManager, truth: Truth, metas: list[BlockMeta]) -> int:
    """An engine's admission of a sequence: GPU prefix hits, then loads of the lower-tier
    hits; checks every block it would serve against the truth; recomputes the rest."""
    hit = m.lookup([meta.block_hash for meta in metas])
    gpu_hits = [b for b in hit.gpu_blocks if b is not None]
    m.touch(gpu_hits)
    # Served: the leading GPU run, then the lower-tier hits up to the next GPU hit.
    num_gpu = next((i for i, b in enumerate(hit.gpu_blocks) if b is None), hit.num_blocks)
    end = next((i for i in range(num_gpu, hit.num_blocks) if hit.gpu_blocks[i] is not None),
               hit.num_blocks)
    for block, meta in zip(gpu_hits[:num_gpu], metas):
        assert truth.holds(m.kv_cache[block.block_id], meta), "a wrong GPU block was served"
    lower = metas[num_gpu:end]
    served = num_gpu
    targets: list[KVCacheBlock] = []
    if lower:
        targets = m.allocate(len(lower)) or []
        if targets:
            num_ok = m.complete_load(m.prepare_load(lower, targets))
            for block, meta in zip(targets[:num_ok], lower):
                assert block.block_hash == meta.block_hash
                assert truth.holds(m.kv_cache[block.block_id], meta), \
                    "a wrong block was restored"
            for block in targets[num_ok:]:
                assert block.block_hash is None, "a block that failed to load is cached"
            served += num_ok
    m.free(gpu_hits)
    m.free(targets)
    if served < len(metas):
        compute(m, truth, metas[served:])
    return served


def check_idle(m: TierManager) -> None:
    m.flush()
    m.pool.check_invariants()
    stats = m.stats()
    assert stats.num_jobs_in_flight == 0 and stats.num_loads_in_flight == 0
    assert stats.pool.num_free == stats.pool.num_blocks, "a GPU block is still referenced"
    assert m.host is not None
    m.host.check_invariants(idle=True)


def check_disk(m: TierManager, truth: Truth) -> int:
    """Every block the disk holds passes its checks and is the truth; returns how many.
    (Read through DiskTier itself: the injected read faults are not wanted here.)"""
    assert m.disk is not None
    hashes = list(truth.metas)
    present = [h for h, there in zip(hashes, m.disk.contains(hashes)) if there]
    dest = torch.empty(LAYOUT.block_shape, dtype=LAYOUT.dtype)
    for block_hash in present:
        meta = truth.metas[block_hash]
        assert DiskTier.get_many_into(m.disk, [meta], [dest]) == [True]
        assert truth.holds(dest, meta)
    return len(present)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", range(3))
def test_random_faults_never_serve_a_wrong_block(faulty_manager, seed):
    """A seeded workload of computes and restores over a 6-block GPU, a 3-slot host and a
    disk, with a third of the disk calls and a fifth of the copies failing (half of them
    after part of the work). Every block served is the truth; failed blocks are
    recomputed; nothing stays pinned or referenced; the disk holds only whole, true
    blocks; the failures are counted."""
    rng = random.Random(seed)
    reads, writes, swaps = (Faults(rate, seed=seed * 10 + i)
                            for i, rate in enumerate((0.3, 0.3, 0.2)))
    m = faulty_manager(num_gpu=6, num_host=3, reads=reads, writes=writes, swaps=swaps)
    truth = Truth()
    names = [f"seq{i}" for i in range(5)]
    num_served = 0
    for _ in range(60):
        metas = truth.sequence(rng.choice(names), rng.randint(1, 4))
        num_served += restore(m, truth, metas)
        m.pool.check_invariants()
        if rng.random() < 0.3:
            m.flush()  # let write-backs reach the disk (or fail) before the next round
    check_idle(m)
    stats = m.stats()
    assert reads.num_failed and writes.num_failed and swaps.num_failed, "no fault was injected"
    failures = stats.tiers[Tier.DISK].failures + stats.tiers[Tier.HOST].failures
    assert failures > 0
    assert sum(t.failures for t in stats.transfers.values()) > 0
    assert num_served > 0, "nothing was ever restored: the test proves nothing"
    check_disk(m, truth)


@pytest.mark.timeout(120)
def test_a_dead_disk_does_not_wedge_the_host_tier(faulty_manager):
    """Every disk write fails. Dirty host blocks cannot reach the disk; after the failed
    write-back they are dropped like clean ones (lost below the host), so new blocks still
    get slots, and the manager never blocks. Once the disk works again, writes land."""
    writes = Faults(rate=1.0, partial_rate=0.0)
    m = faulty_manager(num_gpu=4, num_host=2, reads=Faults(), writes=writes)
    truth = Truth()
    for i in range(12):
        metas = truth.sequence(f"dead{i}", 1)
        compute(m, truth, metas)
        m.flush()
    stats = m.stats()
    assert writes.num_failed > 0 and stats.tiers[Tier.DISK].failures > 0
    assert stats.transfers[Direction.HOST_TO_DISK].failures > 0
    assert stats.disk.num_blocks == 0
    check_idle(m)
    # The host holds the last two; the older ones are gone (misses, to be recomputed).
    newest = truth.sequence("dead11", 1)
    assert m.lookup([newest[0].block_hash]).num_blocks == 1
    assert m.lookup([truth.sequence("dead0", 1)[0].block_hash]).num_blocks == 0
    writes.rate = 0.0
    for i in range(3):
        compute(m, truth, truth.sequence(f"alive{i}", 1))
    m.flush()
    assert m.stats().disk.num_blocks > 0
    check_idle(m)


@pytest.mark.timeout(120)
def test_a_batch_half_written_before_the_error_is_whole_on_disk(faulty_manager):
    """A write-back batch fails after its first half committed: those blocks are on disk,
    byte-exact, and served after a restart; the rest are misses."""
    writes = Faults(calls=frozenset({0}), partial_rate=1.0)
    # Host slots for all six beside the slots kept for reads.
    m = faulty_manager(num_gpu=8, num_host=12, reads=Faults(), writes=writes)
    truth = Truth()
    metas = truth.sequence("half", 6)
    compute(m, truth, metas)
    m.flush()  # one write-back batch of six blocks: the first three commit, then it raises
    assert writes.num_failed == 1
    hashes = [meta.block_hash for meta in metas]
    assert m.disk.contains(hashes) == [True] * 3 + [False] * 3
    m.close()
    fresh = TierManager(LAYOUT, m.config)  # a restart, with a sound disk
    try:
        targets = fresh.allocate(6)
        assert fresh.complete_load(fresh.prepare_load(metas, targets)) == 3
        for block, meta in zip(targets[:3], metas):
            assert truth.holds(fresh.kv_cache[block.block_id], meta)
        fresh.free(targets)
    finally:
        fresh.close()


@pytest.mark.timeout(120)
def test_a_copy_that_fails_after_one_block_caches_none_of_its_blocks(faulty_manager):
    """A host -> GPU copy raises after it copied the first block: the load reports no
    block (the job failed as a whole), none of the targets is cached, the host slots are
    unpinned, and the next load of the same blocks succeeds."""
    swaps = Faults()
    m = faulty_manager(num_gpu=6, num_host=4, reads=Faults(), writes=Faults(), swaps=swaps)
    truth = Truth()
    metas = truth.sequence("copy", 3)
    compute(m, truth, metas)
    m.flush()
    blocks = m.allocate(6)  # push the three out of the GPU pool
    m.free(blocks)
    swaps.calls = frozenset({swaps.num_calls})
    swaps.partial_rate = 1.0
    targets = m.allocate(3)
    assert m.complete_load(m.prepare_load(metas, targets)) == 0
    assert all(block.block_hash is None for block in targets)
    assert m.lookup([meta.block_hash for meta in metas]).locations == [Tier.HOST] * 3
    m.free(targets)
    check_idle(m)
    assert restore(m, truth, metas) == 3
    check_idle(m)


def test_a_write_of_blocks_another_writer_stored_meanwhile_touches_them(tmp_path, caplog):
    """Two I/O threads (or processes) may write the same block: the second put finds it
    present. That is a use, not a lack of room: the block becomes the newest, and no
    'no room' warning is logged."""
    truth = Truth()
    metas = truth.sequence("twice", 4)
    payloads = [truth.data[meta.block_hash] for meta in metas]
    record_bytes = len(encode_record(metas[0], LAYOUT,
                                     payloads[0].view(-1).view(torch.uint8).numpy()))
    with DiskTier(tmp_path, LAYOUT, 3 * record_bytes) as disk:
        assert sum(disk.put(metas[:3], payloads[:3])) == 3  # oldest first: 0, 1, 2
        with caplog.at_level("WARNING", logger="kvtier.tiers.disk"):
            assert sum(disk.put(metas[:1], payloads[:1])) == 1  # all present: 1, 2, 0
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        assert sum(disk.put(metas[3:], payloads[3:])) == 1  # evicts 1, the oldest now
        hashes = [meta.block_hash for meta in metas]
        assert disk.contains(hashes) == [True, False, True, True]
