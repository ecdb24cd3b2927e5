"""Scheduler scenarios on a tiny real TierManager (blocks of 4 tokens, a few blocks).

No model runs here: `Driver.step` plays the model's part by writing a value derived from
(token id, position) into every slot the plan computes, and samples a fixed token. That makes
restored blocks checkable byte for byte: a block's KV must be what was written for its tokens.
"""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from kvtier.engine.request import Request, RequestId, RequestStatus
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.step_plan import SchedulerOutput

from kvtier.config import TierConfig
from kvtier.hashing import BlockHasher, namespace_hash
from kvtier.layout import KVLayout
from kvtier.manager import TierManager
from kvtier.stats import Tier
from kvtier.tiers.record import BlockMeta

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS,
                  dtype=torch.float32)
SAMPLED = 7  # the token every sampling step produces


def kv_value(token_id: int, position: int) -> float:
    return float(token_id * 1000 + position)


class Driver:
    """A scheduler over a real TierManager, stepped like the engine steps it."""

    def __init__(self, manager: TierManager, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, long_prefill_token_threshold: int = 0
                 ) -> None:
        self.manager = manager
        self.scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens,
                                   long_prefill_token_threshold=long_prefill_token_threshold)
        self.namespace = namespace_hash("scheduler-test", LAYOUT)
        self.count = 0

    def add(self, prompt: list[int], max_tokens: int = 4) -> Request:
        request = Request(RequestId(f"r{self.count}"), tuple(prompt), params=None,
                          hasher=BlockHasher(self.namespace, BS),
                          max_num_tokens=len(prompt) + max_tokens, arrival_time=0.0)
        self.count += 1
        self.scheduler.add_request(request)
        return request

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        plan = self.scheduler.schedule()
        kv = self.manager.kv_cache  # [num_blocks, num_layers, 2, BS, kv_heads, head_dim]
        for planned in plan.scheduled:
            request = planned.request
            for pos in range(planned.start, planned.start + planned.num_new_tokens):
                block = request.block_table[pos // BS]
                assert block.block_hash is None or block.ref_cnt >= 1
                kv[block.block_id, :, :, pos % BS] = kv_value(request.token_ids[pos], pos)
        sampled = [SAMPLED if p.samples else None for p in plan.scheduled]
        # The restores' further loads and the last update's stores start with the step, as
        # in LLM.
        self.scheduler.launched(batch_stores=False)
        return plan, self.scheduler.update(plan, sampled)

    def run_until_done(self, max_steps: int = 500) -> list[Request]:
        finished: list[Request] = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return finished
            finished += self.step()[1]
            self.manager.pool.check_invariants()
            time.sleep(0 if not self.scheduler.num_loading else 0.001)
        raise AssertionError("requests did not finish")

    def evict_gpu(self) -> None:
        """Reuse every free pool block once, so no cached hash is left on the GPU."""
        self.manager.flush()  # write-through copies hold their blocks until they land
        blocks = self.manager.allocate(self.manager.pool.num_free_blocks)
        assert blocks is not None
        self.manager.free(blocks)
        assert not self.manager.pool.cached


def assert_kv_matches_tokens(manager: TierManager, request: Request, num_tokens: int) -> None:
    """The cache holds, for each of the first `num_tokens` tokens, the value written for it."""
    for pos in range(num_tokens):
        block = request.block_table[pos // BS]
        stored = manager.kv_cache[block.block_id, :, :, pos % BS]
        expected = kv_value(request.token_ids[pos], pos)
        assert torch.all(stored == expected), f"position {pos}: {stored.flatten()[:2]}"


@pytest.fixture
def host_manager():
    manager = TierManager(LAYOUT, TierConfig.from_slots(LAYOUT, num_gpu_blocks=8,
                                                        num_host_slots=16))
    yield manager
    manager.close()


def prompt_of(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


def test_chunked_prefill_respects_the_token_budget(host_manager: TierManager) -> None:
    driver = Driver(host_manager, max_num_batched_tokens=8)
    request = driver.add(prompt_of(22), max_tokens=3)
    chunks = []
    while request.status is not RequestStatus.FINISHED:
        plan, _ = driver.step()
        assert plan.num_batched_tokens <= 8
        chunks.append((plan.scheduled[0].num_new_tokens, plan.scheduled[0].samples))
    # 22 prompt tokens in chunks of at most 8; only the chunk that ends the prompt samples.
    assert chunks == [(8, False), (8, False), (6, True), (1, True), (1, True)]
    assert request.output_token_ids == [SAMPLED] * 3 and request.finish_reason == "length"
    assert request.counters.computed == 22 + 2
    host_manager.flush()  # the last write-through holds its block until it lands
    host_manager.pool.check_invariants()
    assert host_manager.pool.num_free_blocks == 8  # everything freed


def test_first_come_first_served_under_the_caps(host_manager: TierManager) -> None:
    driver = Driver(host_manager, max_num_seqs=2, max_num_batched_tokens=10)
    a, b, c = driver.add(prompt_of(6, 100)), driver.add(prompt_of(6, 200)), \
        driver.add(prompt_of(3, 300))
    plan, _ = driver.step()
    # Budget 10: all of a's prompt, then 4 tokens of b; c waits for a running seat.
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(a, 6), (b, 4)]
    plan, _ = driver.step()
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(a, 1), (b, 2)]
    assert c.status is RequestStatus.WAITING
    order = driver.run_until_done()
    assert order[-1] is c  # c starts only once a seat is free
    assert [r.finish_reason for r in (a, b, c)] == ["length"] * 3


def test_past_the_threshold_a_long_prompt_leaves_room_for_those_waiting(
        host_manager: TierManager) -> None:
    driver = Driver(host_manager, max_num_batched_tokens=8, long_prefill_token_threshold=5)
    long = driver.add(prompt_of(22, 100), max_tokens=2)
    plan, _ = driver.step()
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(long, 8)]  # alone
    short = driver.add(prompt_of(3, 200), max_tokens=1)
    plan, finished = driver.step()
    # Someone waits: the long prompt takes 5 tokens, the 3 left start the short one, which
    # samples its token at once.
    assert [(p.request, p.num_new_tokens, p.samples) for p in plan.scheduled] == [
        (long, 5, False), (short, 3, True)]
    assert finished == [short]
    plan, _ = driver.step()
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(long, 8)]  # alone again
    driver.run_until_done()
    assert [r.finish_reason for r in (long, short)] == ["length"] * 2


def test_a_long_prompt_admitted_first_leaves_room_for_the_one_behind_it(
        host_manager: TierManager) -> None:
    driver = Driver(host_manager, max_num_batched_tokens=8, long_prefill_token_threshold=5)
    first, second = driver.add(prompt_of(12, 300), max_tokens=1), \
        driver.add(prompt_of(2, 400), max_tokens=1)
    plan, finished = driver.step()
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(first, 5), (second, 2)]
    assert finished == [second]
    plan, _ = driver.step()  # nobody waits: the whole budget
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(first, 7)]


@pytest.mark.parametrize(("max_num_seqs", "threshold"), [(1, 5), (8, 0)])
def test_a_waiting_prompt_waits_for_every_chunk_without_a_seat_or_the_threshold(
        host_manager: TierManager, max_num_seqs: int, threshold: int) -> None:
    # One seat, taken: the short prompt could not start, so the long one keeps the whole
    # budget despite the threshold; no threshold: first come, first served.
    driver = Driver(host_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=8,
                    long_prefill_token_threshold=threshold)
    long = driver.add(prompt_of(22, 100), max_tokens=2)
    driver.step()
    short = driver.add(prompt_of(3, 200), max_tokens=1)
    plan, _ = driver.step()
    assert [(p.request, p.num_new_tokens) for p in plan.scheduled] == [(long, 8)]
    assert short.status is RequestStatus.WAITING


def test_newest_running_request_is_preempted_and_comes_back(host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    a, b, c = (driver.add(prompt_of(8, s), max_tokens=6) for s in (100, 200, 300))
    plan, _ = driver.step()  # three prompts of 2 blocks: 6 of the 8 blocks
    assert len(plan.scheduled) == 3 and plan.preempted == []
    # Each now decodes its 9th token into a third block; 2 are free: a and b get one, and
    # the newest running request (c) is preempted to make room, back first in the queue.
    plan, _ = driver.step()
    assert [p.request for p in plan.scheduled] == [a, b]
    assert plan.preempted == [c] and c.status is RequestStatus.PREEMPTED
    assert c.counters.num_preemptions == 1 and c.block_table == []
    assert driver.scheduler.waiting[0] is c
    assert a.counters.num_preemptions == b.counters.num_preemptions == 0
    driver.run_until_done()
    for request in (a, b, c):
        assert request.finish_reason == "length" and request.num_output_tokens == 6
    # c resumed from its cached full blocks (GPU or host), not from scratch.
    assert c.counters.cached_gpu + c.counters.cached_host >= 8
    host_manager.pool.check_invariants()


def test_a_restoring_request_does_not_block_later_requests(host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    first = driver.add(prompt_of(13), max_tokens=1)
    driver.run_until_done()
    assert first.counters.computed == 13
    driver.evict_gpu()  # the 3 full blocks now live on the host only

    again = driver.add(prompt_of(13), max_tokens=2)
    other = driver.add(prompt_of(5, 500), max_tokens=2)
    plan, _ = driver.step()
    # Its loads were issued; its compute front starts next step, after they had a step's
    # time (on the CPU the host copies land at the next poll, so nothing is computed).
    assert again.status is RequestStatus.RUNNING
    assert [p.request for p in plan.scheduled] == [other]
    plan, _ = driver.step()
    restored = [p for p in plan.scheduled if p.request is again]
    assert restored and restored[0].start == 12  # 3 blocks restored; only token 13 computed
    assert again.counters.cached_host == 12 and again.counters.cached_gpu == 0
    assert_kv_matches_tokens(host_manager, again, 12)
    driver.run_until_done()
    assert again.counters.computed == 1 + 1


def test_prefix_split_between_gpu_and_host_on_a_full_pool(host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    driver.add(prompt_of(25), max_tokens=1)  # 6 full blocks + 1 token
    driver.run_until_done()
    host_manager.flush()
    # Reuse 4 free blocks (evicting the prompt's last full blocks from the GPU) and keep 3:
    # one free block is left besides the cached prefix still on the GPU.
    held = host_manager.allocate(4)
    assert held is not None
    host_manager.free(held[3:])
    again = driver.add(prompt_of(25), max_tokens=2)
    plan, _ = driver.step()
    # The GPU hits are taken before blocks are allocated for the host hits; there is then no
    # room for the load or the computation, so the request waits, holding nothing.
    assert not plan.scheduled and again.status is RequestStatus.WAITING
    assert again.block_table == []
    assert driver.scheduler.restore_counts.no_room >= 1  # its host hits were given up
    host_manager.pool.check_invariants()
    host_manager.free(held[:3])
    while not any(p.request is again for p in plan.scheduled):
        plan, _ = driver.step()
    assert plan.scheduled[0].start == 24
    assert again.counters.cached_gpu + again.counters.cached_host == 24
    assert again.counters.cached_gpu > 0 and again.counters.cached_host > 0
    assert len({b.block_id for b in again.block_table}) == len(again.block_table)
    assert_kv_matches_tokens(host_manager, again, 25)
    driver.run_until_done()


def test_a_restore_takes_the_blocks_queued_stores_hold(host_manager: TierManager) -> None:
    """Write-throughs not started yet hold GPU blocks; a restore short of blocks reclaims
    them (as a chunk's allocation would) instead of computing a prefix the host holds."""
    driver = Driver(host_manager)
    driver.add(prompt_of(25), max_tokens=1)  # 6 full blocks + 1 token
    driver.run_until_done()
    driver.evict_gpu()  # the prefix is on the host alone
    # Another request's 5 computed blocks, queued for the host and not started: the store
    # path's references are all that hold them, and 3 of the 8 blocks stay free.
    other = driver.add(prompt_of(20, start=500))
    blocks = host_manager.allocate(5)
    assert blocks is not None
    host_manager.cache_full_blocks(blocks, [other.block_meta(i) for i in range(5)])
    host_manager.free(blocks)
    driver.scheduler.waiting.remove(other)  # only its blocks play a part
    assert host_manager.num_stores_queued == 5 and host_manager.pool.num_free_blocks == 3

    again = driver.add(prompt_of(25), max_tokens=2)
    driver.run_until_done()
    assert again.counters.cached_host == 24  # restored, not computed
    assert driver.scheduler.restore_counts.no_room == 0


@pytest.mark.parametrize("seconds_per_token", [1.0, None])
def test_a_restore_short_of_blocks_waits_for_running_requests(
        host_manager: TierManager, seconds_per_token: float | None) -> None:
    """Host hits that find no GPU blocks while another request runs: the request waits for
    that one to free its blocks, then restores every hit, rather than computing them a
    chunk at a time as blocks come free. It waits at most as long as computing them would
    take (the first step only while the model's rate is unknown), then computes."""
    driver = Driver(host_manager, max_num_batched_tokens=8)  # a chunk fits in 2 blocks
    driver.add(prompt_of(25), max_tokens=1)  # 6 full blocks + 1 token
    driver.run_until_done()
    driver.evict_gpu()  # the prefix is on the host alone
    if seconds_per_token is not None:
        driver.scheduler.prefill_rate.observe(64, 64 * seconds_per_token)
    running = driver.add(prompt_of(13, start=500), max_tokens=8)  # 4 blocks now, 6 at the end
    driver.step()
    assert running.status is RequestStatus.RUNNING
    again = driver.add(prompt_of(25), max_tokens=2)
    plan, _ = driver.step()  # 6 hits, 4 free blocks
    assert again.status is RequestStatus.WAITING and again.block_table == []
    assert driver.scheduler.restore_counts.room_waits == 1
    assert driver.scheduler.restore_counts.no_room == 0
    host_manager.pool.check_invariants()
    steps_waiting = 0
    for _ in range(500):  # until its last prompt token is computed (it then samples)
        plan, _ = driver.step()
        if any(p.request is again and p.samples for p in plan.scheduled):
            break
        steps_waiting += again.status is RequestStatus.WAITING
        time.sleep(0 if not driver.scheduler.num_loading else 0.001)
    assert_kv_matches_tokens(host_manager, again, 25)
    driver.run_until_done()
    counts = driver.scheduler.restore_counts
    if seconds_per_token is not None:  # computing 24 tokens takes 24 s: it waits
        assert again.counters.cached_host == 24 and again.counters.computed == 2
        assert counts.no_room == 0 and counts.started == 1
        # Looked up once: while no block came free it was not looked up again, however
        # many steps it waited.
        assert steps_waiting > 1 and counts.room_waits == 1
    else:  # the rate is unknown: one step, then it computes its prefix, a chunk at a time
        assert counts.no_room >= 1 and again.counters.computed > 2


def test_gpu_hits_are_shared_not_recomputed(host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    first = driver.add(prompt_of(9), max_tokens=1)
    driver.run_until_done()
    cached_ids = [host_manager.pool.cached[h].block_id for h in first.block_hashes[:2]]
    second = driver.add(prompt_of(9), max_tokens=2)
    plan, _ = driver.step()
    # The two full blocks are hit on the GPU; only the last prompt token is computed.
    assert plan.scheduled[0].start == 8 and plan.scheduled[0].num_new_tokens == 1
    assert [b.block_id for b in second.block_table[:2]] == cached_ids
    assert second.counters.cached_gpu == 8 and second.counters.cached_host == 0
    assert_kv_matches_tokens(host_manager, second, 9)


@pytest.mark.parametrize("bad_block", [2, 0])
def test_partial_restore_recomputes_the_rest(tmp_path: Path, bad_block: int) -> None:
    # Host tier off, disk on: blocks reach the disk through the staging slab.
    config = TierConfig(num_gpu_blocks=8, disk_path=tmp_path / "kv",
                        disk_budget_bytes=64 * LAYOUT.bytes_per_block)
    with closing(TierManager(LAYOUT, config)) as manager:
        driver = Driver(manager)
        first = driver.add(prompt_of(17), max_tokens=1)
        driver.run_until_done()
        manager.flush()  # the write-through reached the disk
        driver.evict_gpu()
        # The bad block's record now claims other tokens under the same hash (a collision):
        # the load must reject it, keep the blocks before it and recompute from there on.
        assert manager.disk is not None
        payload = torch.zeros(LAYOUT.bytes_per_block, dtype=torch.uint8)
        manager.disk.delete([first.block_hashes[bad_block]])
        manager.disk.put([BlockMeta(first.block_hashes[bad_block],
                                    first.parent_hash(bad_block), (0, 0, 0, 0))], [payload])
        again = driver.add(prompt_of(17), max_tokens=2)
        plan, _ = driver.step()
        assert again.status is RequestStatus.RUNNING and not plan.scheduled
        manager.flush()  # every read has landed before the compute front moves
        plan, _ = driver.step()
        # Every block but the bad one is restored (the blocks after it too: a block's KV
        # does not depend on the blocks before it); the bad one is recomputed.
        assert plan.scheduled[0].request is again
        assert plan.scheduled[0].start == bad_block * BS
        assert plan.scheduled[0].num_new_tokens == BS
        assert len(again.block_table) == 4  # the hit's blocks; token 16 takes a fifth
        assert_kv_matches_tokens(manager, again, 16)
        driver.run_until_done()
        assert again.counters.cached_disk == 3 * BS
        assert again.counters.computed == BS + 1 + 1
        manager.pool.check_invariants()


def test_a_lone_request_that_outgrows_the_pool_ends_with_length() -> None:
    config = TierConfig.from_slots(LAYOUT, num_gpu_blocks=2)
    with closing(TierManager(LAYOUT, config)) as manager:
        driver = Driver(manager)
        request = driver.add(prompt_of(6), max_tokens=10)
        driver.run_until_done(max_steps=20)
        # 8 tokens fill both blocks: the 9th has no room and nobody else can give any.
        assert request.finish_reason == "length" and request.num_tokens == 9
        manager.flush()
        assert manager.pool.num_free_blocks == 2


def test_a_request_that_does_not_fit_waits_without_taking_from_running_ones(
        host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    a = driver.add(prompt_of(24), max_tokens=4)  # 6 of the 8 blocks
    driver.step()
    b = driver.add(prompt_of(12, 400), max_tokens=1)  # needs 3 blocks, 2 are free
    plan, _ = driver.step()
    assert [p.request for p in plan.scheduled] == [a]
    assert b.status is RequestStatus.WAITING and b.block_table == []
    assert a.counters.num_preemptions == 0
    driver.run_until_done()
    assert b.finish_reason == "length" and b.counters.num_preemptions == 0


def test_a_request_without_room_is_looked_up_again_only_once_blocks_came_free(
        host_manager: TierManager) -> None:
    driver = Driver(host_manager)
    a = driver.add(prompt_of(24), max_tokens=6)  # 6 of the 8 blocks, growing to 8
    driver.step()
    b = driver.add(prompt_of(12, 400), max_tokens=1)  # needs 3 blocks: never fits beside a

    def blocks_looked_up() -> int:
        gpu = host_manager.stats().tiers[Tier.GPU]
        return gpu.hits + gpu.misses

    before = blocks_looked_up()
    while a.status is not RequestStatus.FINISHED:
        driver.step()
        assert b.status is RequestStatus.WAITING or a.status is RequestStatus.FINISHED
    # a's five decode steps took blocks and freed none: b's 2-block prefix was looked up
    # at the first of them alone.
    assert blocks_looked_up() - before == 2
    driver.run_until_done()
    assert b.finish_reason == "length" and b.counters.num_preemptions == 0
