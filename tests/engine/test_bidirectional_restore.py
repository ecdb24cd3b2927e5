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

import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import torch
from kvtier.engine.loader import LoadedModel, load_model
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.request import Request, RequestId, RequestStatus
from kvtier.engine.restore import FIRST_LANDING_WAIT_SHARE, FIRST_SLOW_GROUPS
from kvtier.engine.scheduler import Scheduler
from restore_cases import (
    BS,
    LAYOUT,
    PROMPT,
    Driver,
    ReadHook,
    config,
    finish_idle,
    prompt_of,
    restored_blocks,
    warm,
)

from kvtier.config import TierConfig
from kvtier.hashing import BlockHasher, namespace_hash
from kvtier.manager import TierManager
from kvtier.stats import Tier


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


def test_the_first_landing_wait_is_a_small_share_of_computing_the_prefix(
        disk_dir: Path) -> None:
    """With the model's speed known, the compute front waits for the tier's first group at
    most FIRST_LANDING_WAIT_SHARE of the time computing the prefix takes (here 2% of
    0.4 s), not the full FIRST_LANDING_WAIT_S: a cold disk's first read can take longer
    than that, and the wait would make the prompt slower than computing it."""
    warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=1)  # the first read is held: nothing lands meanwhile
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(8, 0.1)  # 12.5 ms a token: 32 take 0.4 s
        request = driver.add(PROMPT)
        try:
            assert not driver.step().scheduled  # admitted, loads issued, the front holds
            assert hook.gated.wait(timeout=60)
            time.sleep(FIRST_LANDING_WAIT_SHARE * 0.4 * 2.5)  # past the share, within 50 ms
            plan = driver.step()
            assert [(p.start, p.num_new_tokens) for p in plan.scheduled] == [(0, 8)]
        finally:
            hook.release()
        finish_idle(driver)
    assert request.status is RequestStatus.FINISHED


def test_with_the_models_speed_known_the_reads_are_issued_around_the_first_launch(
        disk_dir: Path) -> None:
    """Issuing a read is host work on the engine thread (0.5 ms a group on an H100), and
    before the request's first step nothing hides it: while the tiers' rate is unknown the
    admitting step issues only FIRST_SLOW_GROUPS groups, the rest go once the step with the
    front's first claim is queued (`Scheduler.launched`, where `LLM` calls it), and the
    fronts still meet."""
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=1)  # nothing lands: the front claims once its wait is over
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(8, 0.1)  # known: 32 tokens take 0.4 s
        request = driver.add(PROMPT)
        rid = request.request_id
        try:
            assert not driver.step().scheduled  # admitted, the front holds
            assert driver.scheduler.restore_fronts()[rid].load_block == 8 - FIRST_SLOW_GROUPS
            time.sleep(FIRST_LANDING_WAIT_SHARE * 0.4 * 2.5)  # past the wait
            plan = driver.scheduler.schedule()
            assert [(p.start, p.num_new_tokens) for p in plan.scheduled] == [(0, 8)]
            driver.compute(plan)
            # Claimed blocks 0 and 1; blocks 2 and 3 are issued with the step, not before.
            assert driver.scheduler.restore_fronts()[rid].load_block == 8 - FIRST_SLOW_GROUPS
            driver.scheduler.launched(batch_stores=False)
            assert driver.scheduler.restore_fronts()[rid].load_block == 2
            driver.scheduler.update(plan, [None])
        finally:
            hook.release()
        finish_idle(driver)
    assert request.status is RequestStatus.FINISHED
    assert set(hook.read) <= set(hashes[2:8])  # the claimed head was never read


@pytest.mark.parametrize(("tokens_per_s", "load_block"), [
    (400.0, 2),   # reads 20 groups in two steps: every group above the 2-block head
    (100.0, 11),  # reads 5 in two steps: the rest wait for the first launch
])
def test_with_both_rates_known_admission_issues_what_the_tiers_read_in_two_steps(
        disk_dir: Path, tokens_per_s: float, load_block: int) -> None:
    """With the tiers' rate known too, the admitting step issues the groups they are
    expected to read while ADMISSION_STEPS steps compute (here 2 x 0.1 s at L tokens/s,
    4 tokens a group), at least FIRST_SLOW_GROUPS and none inside the head the compute
    front takes: the engine thread issues more only once the first step's launch returns,
    which for a large model is about when that step ends."""
    prompt = prompt_of(65)  # 16 full blocks
    hashes = warm(disk_dir, [prompt])
    hook = ReadHook(gate_at=1)  # nothing lands while the fronts are looked at
    with closing(TierManager(LAYOUT, config(disk_dir, num_gpu_blocks=32),
                             disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(8, 0.1)  # 8 tokens (a step) take 0.1 s
        driver.scheduler.tier_rates.observe(Tier.DISK, int(tokens_per_s), 1.0)
        request = driver.add(prompt)
        rid = request.request_id
        try:
            plan = driver.scheduler.schedule()  # admitted; the rates size the first claim
            assert driver.scheduler.restore_fronts()[rid].load_block == load_block
            assert load_block == 2 or 16 - load_block > FIRST_SLOW_GROUPS
            driver.compute(plan)
            driver.scheduler.launched(batch_stores=False)
            driver.scheduler.update(plan, [None] * len(plan.scheduled))
        finally:
            hook.release()
        finish_idle(driver)
    assert request.status is RequestStatus.FINISHED
    assert set(hook.read) <= set(hashes[2:16])  # the claimed head was never read


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
        # Preempted with its head partly computed, block 7 landed and loads in flight. How
        # far the compute front got follows the prefill rate it measured (wall clock), so
        # on a loaded machine it may just have reached the load front; never past it.
        assert seen is not None, "the restoring request was never preempted"
        assert 0 < seen.compute_block <= seen.load_block < seen.num_blocks
        assert seen.num_restored == 1
        assert request.status is RequestStatus.PREEMPTED and request.block_table == []
        hook.release()
        finish_idle(driver)
    assert request.counters.num_preemptions >= 1
    assert request.num_output_tokens == 2 and growing.num_output_tokens == 40
    assert hashes[7] in hook.read


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

    def _while_step_runs(self) -> None:
        self.scheduler.launched(batch_stores=False)

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
            sampled = self.runner.execute(plan.scheduled, self._while_step_runs) \
                if plan.scheduled else []
            self._while_step_runs()  # as the engine does (`LLM._run_step`)
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
