"""Bidirectional restores over a real TierManager and a real LMDB disk tier whose reads are
slowed, gated or failed by a read hook: every meeting point of the compute front and the
load front happens for real.

Two drivers: `Driver` plays the model's part (it writes a value derived from (token id,
position) into every slot a chunk computes, and checks before each chunk that the context
it attends to holds exactly the values of its tokens, so a block served wrong fails at
once); `ModelDriver` runs the tiny random Llama in float32 and compares the generated tokens
with a run with the tiers off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import torch
from kvtier.engine.loader import LoadedModel, load_model
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.request import Request, RequestId, RequestStatus
from kvtier.engine.restore import busy_seconds
from kvtier.engine.scheduler import Scheduler, SchedulerOutput

from kvtier.config import TierConfig
from kvtier.hashing import BlockHash, BlockHasher, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Tier
from kvtier.tiers.record import BlockMeta

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS,
                  dtype=torch.float32)
SAMPLED = 7
NAMESPACE = namespace_hash("bidirectional-restore-test", LAYOUT)


class ReadHook:
    """The disk tier's read hook: records the blocks read (in order), sleeps `delay_s` per
    block, holds the `gate_at`-th read and every later one until `release()`, and fails
    the blocks in `fail`."""

    def __init__(self, delay_s: float = 0.0, gate_at: int | None = None,
                 fail: frozenset[BlockHash] = frozenset()) -> None:
        self.delay_s, self.gate_at, self.fail = delay_s, gate_at, fail
        self.read: list[BlockHash] = []
        self.gated = threading.Event()  # a read is held at the gate
        self._open = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, meta: BlockMeta) -> None:
        with self._lock:
            self.read.append(meta.block_hash)
            held = self.gate_at is not None and len(self.read) >= self.gate_at
        if held:
            self.gated.set()
            assert self._open.wait(timeout=120), "the test never released the gate"
        if self.delay_s:
            time.sleep(self.delay_s)
        if meta.block_hash in self.fail:
            raise OSError("injected read failure")

    def release(self) -> None:
        self._open.set()


def kv_value(token_id: int, position: int) -> float:
    return float(token_id * 1000 + position)


def config(disk_dir: Path, num_gpu_blocks: int = 16) -> TierConfig:
    return TierConfig.from_slots(LAYOUT, num_gpu_blocks=num_gpu_blocks, num_host_slots=32,
                                 disk_path=disk_dir, num_disk_blocks=256,
                                 io_threads=1)


class Driver:
    """A scheduler over a real TierManager, stepped like the engine steps it."""

    def __init__(self, manager: TierManager, max_num_batched_tokens: int = 8) -> None:
        self.manager = manager
        # One block per load group: the fronts can meet at any block.
        self.scheduler = Scheduler(manager, 8, max_num_batched_tokens,
                                   restore_group_bytes=LAYOUT.bytes_per_block)
        self.count = 0

    def add(self, prompt: list[int], max_tokens: int = 1) -> Request:
        request = Request(RequestId(f"r{self.count}"), tuple(prompt), params=None,
                          hasher=BlockHasher(NAMESPACE, BS),
                          max_num_tokens=len(prompt) + max_tokens, arrival_time=0.0)
        self.count += 1
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        kv = self.manager.kv_cache  # [num_blocks, num_layers, 2, BS, kv_heads, head_dim]
        for planned in plan.scheduled:
            request = planned.request
            for pos in range(planned.start):  # the context this chunk attends to
                block = request.block_table[pos // BS]
                expected = kv_value(request.token_ids[pos], pos)
                assert torch.all(kv[block.block_id, :, :, pos % BS] == expected), \
                    f"{request.request_id} position {pos}: wrong KV served"
            for pos in range(planned.start, planned.start + planned.num_new_tokens):
                block = request.block_table[pos // BS]
                kv[block.block_id, :, :, pos % BS] = kv_value(request.token_ids[pos], pos)
        self.scheduler.update(plan, [SAMPLED if p.samples else None for p in plan.scheduled])
        self.manager.pool.check_invariants()
        return plan

    def run_until_done(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
            time.sleep(0.001 if self.scheduler.num_loading else 0)
        raise AssertionError("requests did not finish")


def prompt_of(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


PROMPT = prompt_of(33)  # 8 full blocks and one token


def warm(disk_dir: Path, prompts: list[list[int]]) -> list[BlockHash]:
    """Compute `prompts` once and close: their full blocks end up on disk only."""
    manager = TierManager(LAYOUT, config(disk_dir))
    driver = Driver(manager)
    requests = [driver.add(p) for p in prompts]
    driver.run_until_done()
    manager.close()
    return requests[0].block_hashes


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def restored_blocks(request: Request) -> int:
    return request.counters.cached_disk // BS


def finish_idle(driver: Driver) -> None:
    driver.run_until_done()
    driver.manager.flush()
    driver.step()  # completes the loads given up (cancelled ones hold their blocks till then)
    driver.manager.pool.check_invariants()
    assert driver.manager.pool.num_free_blocks == driver.manager.pool.num_blocks
    assert driver.scheduler.num_loading == 0


def test_a_fast_tier_meets_at_block_0(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook()
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        plan = driver.step()  # admitted: loads issued from the tail, nothing computed yet
        assert not plan.scheduled and request.status is RequestStatus.RUNNING
        manager.flush()  # the tier is faster than the compute front: everything landed
        plan = driver.step()
        assert plan.scheduled[0].start == 32 and plan.scheduled[0].num_new_tokens == 1
        assert hook.read == list(reversed(hashes[:8]))  # loaded backward from the tail
        finish_idle(driver)
    assert restored_blocks(request) == 8 and request.counters.computed == 1


def test_a_slow_tier_meets_the_compute_front_in_the_middle(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    # The tail's first two reads land; the third (block 5) is held: it has started, the
    # reads below it are still queued.
    hook = ReadHook(gate_at=3)
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        driver.step()
        assert hook.gated.wait(timeout=60)
        fronts, chunks = [], []
        while request.status is not RequestStatus.FINISHED:
            fronts.append(driver.scheduler.restore_fronts().get(request.request_id))
            chunks += [(p.start, p.num_new_tokens) for p in driver.step().scheduled]
        # The compute front computed blocks 0-5 (two per step), cancelling the queued loads
        # and the held one, and skipped 6 and 7, which had landed.
        assert chunks == [(0, 8), (8, 8), (16, 8), (32, 1)]
        assert [f.compute_block for f in fronts[:3]] == [0, 2, 4]
        assert restored_blocks(request) == 2
        assert request.counters.computed == 6 * BS + 1
        assert hook.read == [hashes[7], hashes[6], hashes[5]]  # blocks 0-4 never read
        hook.release()
        finish_idle(driver)
    assert manager.stats().tiers[Tier.DISK].failures == 0  # cancelled is not failed


def test_a_broken_tier_meets_at_the_end(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(fail=frozenset(hashes))
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        driver.step()
        manager.flush()  # every read failed
        finish_idle(driver)
        assert manager.stats().tiers[Tier.DISK].failures == 8
    assert len(hook.read) == 8
    assert restored_blocks(request) == 0 and request.counters.computed == 33


def test_a_failed_load_in_the_middle_of_the_tail_is_computed(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(fail=frozenset({hashes[5]}))
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        driver.step()
        manager.flush()
        plan = driver.step()
        # Blocks 0-4 landed and are skipped; block 5 is computed; 6 and 7 are skipped next.
        assert (plan.scheduled[0].start, plan.scheduled[0].num_new_tokens) == (20, 4)
        plan = driver.step()
        assert (plan.scheduled[0].start, plan.scheduled[0].num_new_tokens) == (32, 1)
        finish_idle(driver)
    assert restored_blocks(request) == 7 and request.counters.computed == BS + 1


def test_a_request_preempted_while_both_fronts_move_comes_back(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=2)  # block 7 lands; block 6's read is held
    with closing(TierManager(LAYOUT, config(disk_dir, num_gpu_blocks=12),
                     disk_read_hook=hook)) as manager:
        driver = Driver(manager, max_num_batched_tokens=2)
        growing = driver.add(prompt_of(2, 500), max_tokens=40)  # older: never the victim
        request = driver.add(PROMPT, max_tokens=2)
        seen = None
        for _ in range(200):
            fronts = driver.scheduler.restore_fronts().get(request.request_id)
            plan = driver.step()
            if request in plan.preempted:
                seen = fronts
                break
            time.sleep(0.001)
        # Preempted with its head partly computed, block 7 landed and loads in flight.
        assert seen is not None, "the restoring request was never preempted"
        assert 0 < seen.compute_block < seen.load_block < seen.num_blocks
        assert seen.num_restored == 1
        assert request.status is RequestStatus.PREEMPTED and request.block_table == []
        hook.release()
        finish_idle(driver)
    assert request.counters.num_preemptions >= 1
    assert request.num_output_tokens == 2 and growing.num_output_tokens == 40
    assert hashes[7] in hook.read


def test_a_slow_model_waits_for_a_tier_that_delivers_sooner(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=3)  # blocks 7 and 6 land, block 5's read is held
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(1000, 1e6)  # a thousandth of a token a second
        request = driver.add(PROMPT)
        assert driver.step().scheduled == []  # the admitting step waits
        assert hook.gated.wait(timeout=60)
        deadline = time.monotonic() + 60
        while restored_blocks_now(driver, request) < 2:
            assert time.monotonic() < deadline, "blocks 7 and 6 never landed"
            time.sleep(0.001)
        # The model would compute a block long after the tier delivers the rest at the rate
        # it landed blocks 7 and 6: the front waits for the loads instead of claiming.
        assert [p for _ in range(3) for p in driver.step().scheduled] == []
        hook.release()
        finish_idle(driver)
    assert restored_blocks(request) == 8 and request.counters.computed == 1
    assert hook.read == list(reversed(hashes[:8]))


def test_a_prefix_computed_sooner_than_a_disk_read_lands_is_not_read(disk_dir: Path) -> None:
    warm(disk_dir, [PROMPT])
    hook = ReadHook()
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(1000, 1e-6)  # the whole prompt in nanoseconds
        request = driver.add(PROMPT)
        finish_idle(driver)
        disk = manager.stats().tiers[Tier.DISK]
    assert hook.read == []
    assert (disk.hits, disk.misses) == (0, 0)  # the disk was not even asked
    assert restored_blocks(request) == 0 and request.counters.computed == 33


def test_a_disk_too_slow_to_save_time_on_a_prefix_is_not_asked(disk_dir: Path) -> None:
    warm(disk_dir, [PROMPT])
    hook = ReadHook()
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        # 32 tokens to come: 0.32 s to compute alone, 0.317 s with a disk delivering one
        # token a second beside the model, a saving under MIN_SAVING_S.
        driver.scheduler.prefill_rate.observe(100, 1.0)
        driver.scheduler.tier_rates.observe(Tier.DISK, 1, 1.0)
        request = driver.add(PROMPT)
        finish_idle(driver)
        disk = manager.stats().tiers[Tier.DISK]
    assert hook.read == [] and (disk.hits, disk.misses) == (0, 0)
    assert restored_blocks(request) == 0 and request.counters.computed == 33


def test_the_head_the_model_computes_while_the_disk_loads_the_tail_is_never_issued(
        disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=1)  # block 7's read is held: nothing lands, the rates stay put
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        # The model computes as many tokens a second as the disk delivered to recent
        # restores: each front takes half of the 32 tokens still to come.
        driver.scheduler.prefill_rate.observe(100, 1.0)
        driver.scheduler.tier_rates.observe(Tier.DISK, 100, 1.0)
        request = driver.add(PROMPT)
        first = driver.step()  # no wait for a first landing: the disk's rate is known
        fronts = driver.scheduler.restore_fronts()[request.request_id]
        assert (fronts.load_block, fronts.num_blocks) == (4, 8)  # blocks 0-3 never issued
        chunks = [(p.start, p.num_new_tokens) for p in first.scheduled]
        chunks += [(p.start, p.num_new_tokens) for _ in range(3)
                   for p in driver.step().scheduled]
        # The head first, then the queued loads in the way are cancelled and computed; the
        # front stops at block 7, whose read has started.
        assert chunks == [(0, 8), (8, 8), (16, 8), (24, 4)]
        hook.release()
        finish_idle(driver)
    assert hook.read == [hashes[7]]
    assert restored_blocks(request) == 1 and request.counters.computed == 7 * BS + 1


def test_restores_teach_the_scheduler_the_disks_rate(disk_dir: Path) -> None:
    warm(disk_dir, [PROMPT])
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=ReadHook())) as manager:
        driver = Driver(manager)
        assert driver.scheduler.tier_rates.expected([Tier.DISK]) is None
        request = driver.add(PROMPT)
        driver.step()
        manager.flush()
        finish_idle(driver)
    assert restored_blocks(request) == 8
    assert driver.scheduler.tier_rates.expected([Tier.DISK]) > 0


def test_the_disks_rate_is_timed_while_it_reads_not_until_the_engine_notices(
        disk_dir: Path) -> None:
    warm(disk_dir, [PROMPT])
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=ReadHook())) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        driver.step()
        manager.flush()  # every read has run: the blocks wait in host slots
        time.sleep(0.5)  # a long model step: nobody collects them meanwhile
        finish_idle(driver)
    assert restored_blocks(request) == 8
    # 32 tokens over 0.5 s would be 64 tokens/s: the reads themselves took milliseconds.
    assert driver.scheduler.tier_rates.expected([Tier.DISK]) > 32 / 0.5 * 4


def test_busy_seconds_counts_overlapping_reads_once() -> None:
    assert busy_seconds([]) == 0
    assert busy_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]) == pytest.approx(2.5)
    assert busy_seconds([(2.0, 3.0), (0.0, 4.0)]) == pytest.approx(4.0)


def restored_blocks_now(driver: Driver, request: Request) -> int:
    driver.scheduler._finish_loads()  # noqa: SLF001
    fronts = driver.scheduler.restore_fronts()[request.request_id]
    return fronts.num_restored


# ---- a real model: the same tokens as with the tiers off ----------------------------------

MODEL_PROMPTS = [[(13 * i + 7 * j) % 200 + 3 for j in range(323)] for i in range(2)]  # 20 blocks


@pytest.fixture(scope="module")
def tiny() -> Iterator[LoadedModel]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("random:tiny-llama", "cpu", "float32")
    torch.set_num_threads(before)


class ModelDriver:
    """Scheduler, TierManager and ModelRunner stepped like `LLM.step`, greedy sampling."""

    def __init__(self, loaded: LoadedModel, tier_config: TierConfig, hook=None) -> None:
        self.layout = loaded.config.kv_layout(16, torch.float32)
        self.manager = TierManager(self.layout, tier_config, disk_read_hook=hook)
        self.scheduler = Scheduler(self.manager, 4, 16,
                                   restore_group_bytes=self.layout.bytes_per_block)
        self.runner = ModelRunner(loaded.model, self.manager.kv_cache, 16,
                                  lambda logits, requests: logits.argmax(dim=-1))
        self.namespace = namespace_hash("tiny", self.layout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 5,
                 settle: bool = False) -> list[Request]:
        """Run `prompts` to the end; `settle`: let every load land after the first step."""
        requests = [Request(RequestId(f"m{i}"), tuple(p), params=None,
                            hasher=BlockHasher(self.namespace, 16),
                            max_num_tokens=len(p) + max_tokens, arrival_time=0.0)
                    for i, p in enumerate(prompts)]
        for request in requests:
            self.scheduler.add_request(request)
        while self.scheduler.has_unfinished():
            plan = self.scheduler.schedule()
            sampled = self.runner.execute(plan.scheduled) if plan.scheduled else []
            self.scheduler.update(plan, sampled)
            if settle:
                self.manager.flush()
                settle = False
            if not plan.scheduled:
                time.sleep(0.0005)
        return requests

    def close(self) -> None:
        self.manager.close()


def model_config(loaded: LoadedModel, disk_dir: Path | None) -> TierConfig:
    layout = loaded.config.kv_layout(16, torch.float32)
    if disk_dir is None:
        return TierConfig(num_gpu_blocks=64)
    return TierConfig.from_slots(layout, num_gpu_blocks=64, num_host_slots=64,
                                 disk_path=disk_dir, num_disk_blocks=64,
                                 io_threads=1)


@pytest.mark.parametrize("tier", ["slow", "broken", "fast"])
def test_restored_outputs_equal_tiers_off(tiny: LoadedModel, disk_dir: Path, tier: str) -> None:
    off = ModelDriver(tiny, model_config(tiny, None))
    expected = [r.output_token_ids for r in off.generate(MODEL_PROMPTS)]
    off.close()
    warmer = ModelDriver(tiny, model_config(tiny, disk_dir))
    warmed = warmer.generate(MODEL_PROMPTS)
    warmer.close()
    assert [r.output_token_ids for r in warmed] == expected

    # slow: 1 ms per block read, one block computed per step; broken: every read fails.
    hook = ReadHook(delay_s=0.001 if tier == "slow" else 0.0,
                    fail=frozenset(h for r in warmed for h in r.block_hashes)
                    if tier == "broken" else frozenset())
    driver = ModelDriver(tiny, model_config(tiny, disk_dir), hook)
    restored = driver.generate(MODEL_PROMPTS, settle=tier == "fast")
    driver.close()
    assert [r.output_token_ids for r in restored] == expected
    num_full = sum((len(p) - 1) // 16 for p in MODEL_PROMPTS)
    num_restored = sum(restored_blocks_of(r) for r in restored)
    num_computed = sum(r.counters.computed for r in restored)
    assert num_computed == sum(len(p) + 4 for p in MODEL_PROMPTS) - num_restored * 16
    if tier == "broken":
        assert num_restored == 0
    elif tier == "fast":
        assert num_restored == num_full  # met at block 0: a pure restore
    else:
        assert 0 < num_restored < num_full  # met in the middle: head computed, tail loaded


def restored_blocks_of(request: Request) -> int:
    return request.counters.cached_disk // 16


def test_a_block_gone_from_disk_after_the_lookup_is_computed(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=1)  # the first read (block 7) waits; the rest are queued
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        request = driver.add(PROMPT)
        driver.step()  # looked up (all 8 on disk) and issued, without looking up again
        assert hook.gated.wait(timeout=60)
        assert manager.disk is not None and manager.disk.delete([hashes[3]]) == 1
        hook.release()
        manager.flush()
        chunks = []
        while request.status is not RequestStatus.FINISHED:
            chunks += [(p.start, p.num_new_tokens) for p in driver.step().scheduled]
        assert chunks == [(12, 4), (32, 1)]  # block 3 computed, the rest restored
        finish_idle(driver)
    assert restored_blocks(request) == 7
