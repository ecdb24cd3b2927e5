"""How measured rates size a restore: the prefill rate and the disk's rate decide whether
the disk is asked at all, how much of the head the model computes, and how long the compute
front waits; the disk's rate is timed while it reads. Over a real TierManager and LMDB
disk tier (`restore_cases`)."""

from __future__ import annotations

import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from kvtier.engine.request import RequestStatus
from kvtier.engine.restore_rates import MIN_SAVING_S, PrefillRate, TierRates, worth_reading
from restore_cases import (
    BS,
    LAYOUT,
    NAMESPACE,
    PROMPT,
    Driver,
    ReadHook,
    config,
    finish_idle,
    prompt_of,
    restored_blocks,
    wait_for_landed,
    warm,
)

from kvtier.manager import TierManager
from kvtier.stats import Tier, busy_seconds
from kvtier.tiers.record import BlockMeta

SECOND = prompt_of(33, start=500)
THIRD = prompt_of(33, start=900)


def test_a_slow_model_waits_for_a_tier_that_delivers_sooner(disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=3)  # blocks 7 and 6 land, block 5's read is held
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(1000, 1e6)  # a thousandth of a token a second
        request = driver.add(PROMPT)
        assert driver.step().scheduled == []  # the admitting step waits
        assert hook.gated.wait(timeout=60)
        wait_for_landed(driver, request, 2)  # blocks 7 and 6
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


def test_a_disk_too_slow_to_save_time_on_a_prefix_is_asked_only_to_probe(
        disk_dir: Path) -> None:
    warm(disk_dir, [PROMPT, SECOND, THIRD])
    hook = ReadHook(delay_s=0.3)  # 13 tokens a second
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        # 32 tokens to come: 0.32 s to compute alone, 0.317 s with a disk delivering one
        # token a second beside the model, a saving under MIN_SAVING_S.
        driver.scheduler.prefill_rate.observe(100, 1.0)
        driver.scheduler.tier_rates.observe(Tier.DISK, 1, 1.0)
        # The first prefix turned away is read anyway, to measure the disk again...
        probed = driver.add(PROMPT)
        assert driver.step().scheduled == []  # a probe waits for a first landing
        # A read not started when the compute front claims is cancelled and measures
        # nothing: the test waits for the I/O thread, which a loaded machine may run late.
        assert hook.started.wait(timeout=60)
        finish_idle(driver)
        assert hook.read and set(hook.read) <= set(probed.block_hashes)
        # ...which is still too slow: the next ones are not asked (the next probe comes
        # after two more are turned away).
        hook.read.clear()
        hook.started.clear()
        requests = [driver.add(SECOND)]
        finish_idle(driver)
        assert hook.read == []
        requests.append(driver.add(THIRD))
        assert driver.step().scheduled == []
        assert hook.started.wait(timeout=60)
        finish_idle(driver)
        assert hook.read and set(hook.read) <= set(requests[1].block_hashes)
        # The scheduler's own account of it: two probes, one prefix sent to compute.
        counts = driver.scheduler.restore_counts
        assert (counts.probes, counts.turned_away) == (2, 1)
        assert counts.started == 2 and counts.no_room == 0
    assert restored_blocks(requests[0]) == 0 and requests[0].counters.computed == 33


def test_a_slow_first_read_does_not_shut_the_disk_out_for_later_prefixes(
        disk_dir: Path) -> None:
    """A cold first read (after start, the page cache dropped) took long: on its rates
    the disk would save nothing on the prefixes after it, and were they never read, the
    rates would never change. The next prefix probes the disk, which has become fast; its
    rates replace the cold ones, and the prefix after it is read on them.

    The compute front claims after a wall-clock bound (`FIRST_LANDING_WAIT_SHARE` of the
    compute time) and cancels the reads not started by then: a read that never ran
    measures nothing. So the test waits for the I/O thread (the first read at the gate,
    the probe's first landing) rather than trusting it to run within the bound, which on
    a loaded machine it need not."""
    warm(disk_dir, [PROMPT, SECOND, THIRD])
    hook = ReadHook(gate_at=1)  # the first read is held for 0.4 s, none after it
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        rates = driver.scheduler.tier_rates
        driver.scheduler.prefill_rate.observe(100, 1.0)  # 0.32 s for 32 tokens
        driver.add(PROMPT)
        assert driver.step().scheduled == []  # the admitting step waits
        assert hook.gated.wait(timeout=60)  # block 7's read has started: it is measured
        # Held at least 0.4 s: whether it lands before the front reaches block 7 or after
        # (overtaken, counted all the same), its latency exceeds the compute time alone.
        threading.Timer(0.4, hook.release).start()
        finish_idle(driver)
        assert rates.expected([Tier.DISK]) is not None
        assert not worth_reading(32, 100.0, rates.expected([Tier.DISK]), MIN_SAVING_S,
                                 rates.expected_latency([Tier.DISK]))
        probe = driver.add(SECOND)
        assert driver.step().scheduled == []  # a probe waits for a first landing
        wait_for_landed(driver, probe, 1)  # the disk, fast now, lands within that wait
        finish_idle(driver)
        assert restored_blocks(probe) > 0
        assert worth_reading(32, 100.0, rates.expected([Tier.DISK]), MIN_SAVING_S,
                             rates.expected_latency([Tier.DISK]))
        warm_read = driver.add(THIRD)
        driver.step()
        wait_for_landed(driver, warm_read, 1)
        finish_idle(driver)
        counts = driver.scheduler.restore_counts
        assert (counts.probes, counts.turned_away) == (1, 0)  # the third read on the rates
    assert restored_blocks(warm_read) > 0


def test_a_closed_gate_is_probed_ever_more_rarely_and_never_for_a_short_prefix(
        disk_dir: Path) -> None:
    rates = TierRates()
    rates.observe(Tier.DISK, 1, 1.0)
    # Probes at the 1st, 3rd, 7th and 15th prefix turned away, then every 16th.
    probes = [i for i in range(1, 48) if rates.turned_away([Tier.DISK])]
    assert probes == [1, 3, 7, 15, 31, 47]
    assert not rates.turned_away([Tier.HOST])  # only slow tiers are gated
    rates.opened([Tier.DISK])  # a read on the rates: the next turned away probes
    assert rates.turned_away([Tier.DISK])
    # A prefix the model computes sooner than MIN_SAVING_S is never read, probe or not.
    warm(disk_dir, [PROMPT, SECOND, THIRD])
    hook = ReadHook()
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(1000, 1e-3)  # a fast model: computing beats any read
        driver.scheduler.tier_rates.observe(Tier.DISK, 1, 1.0)
        for prompt in (PROMPT, SECOND, THIRD):
            driver.add(prompt)
            finish_idle(driver)
    assert hook.read == []


def test_host_blocks_behind_a_slow_disks_blocks_still_make_the_disk_worth_asking(
        disk_dir: Path) -> None:
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook()
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        # Blocks 4-7 come back to the host tier (read from disk), blocks 0-3 stay on disk
        # only, as a conversation's first blocks leave a host tier before its later ones.
        metas = [BlockMeta(hashes[i], hashes[i - 1] if i else NAMESPACE,
                           tuple(PROMPT[i * BS:(i + 1) * BS])) for i in range(8)]
        blocks = manager.allocate(4)
        assert manager.complete_load(manager.prepare_load(metas[4:], blocks)) == 4
        manager.free(blocks)
        everything = manager.allocate(manager.pool.num_free_blocks)  # off the GPU
        manager.free(everything)
        assert [manager.host.contains(h) for h in hashes[:8]] == [False] * 4 + [True] * 4
        hook.read.clear()
        driver = Driver(manager)
        # As in the test above, the disk alone would save nothing on 32 tokens; but behind
        # its 16 tokens the host holds 16 more, which it can give only if the disk is asked.
        driver.scheduler.prefill_rate.observe(100, 1.0)
        driver.scheduler.tier_rates.observe(Tier.DISK, 1, 1.0)
        request = driver.add(PROMPT)
        finish_idle(driver)
    assert request.counters.cached_host == 4 * BS
    assert request.counters.computed == 4 * BS + 1


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


def test_beside_a_running_request_the_disk_delivers_what_a_lone_request_would_compute(
        disk_dir: Path) -> None:
    """The rates of the test above, the disk twice as fast: alone, the model would compute
    a third of the prefix. Beside a running request each token it computes holds that one
    up as long as the disk takes to deliver two, so every block is loaded."""
    hashes = warm(disk_dir, [PROMPT])
    hook = ReadHook(gate_at=1)  # block 7's read is held: nothing lands, the rates stay put
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(100, 1.0)
        driver.scheduler.tier_rates.observe(Tier.DISK, 200, 1.0)
        other = driver.add(prompt_of(17, start=2000), max_tokens=40)
        for _ in range(3):  # its prompt is computed: it decodes a token a step from here
            driver.step()
        request = driver.add(PROMPT)
        chunks = [(p.request.request_id, p.start) for _ in range(3)
                  for p in driver.step().scheduled]
        fronts = driver.scheduler.restore_fronts()[request.request_id]
        assert fronts.load_block == 0  # every block issued: no head kept for the front
        assert all(rid == other.request_id for rid, _ in chunks), chunks  # the front waits
        hook.release()
        finish_idle(driver)
    assert hook.read == list(reversed(hashes[:8]))
    assert restored_blocks(request) == 8 and request.counters.computed == 1
    assert other.status is RequestStatus.FINISHED


def test_a_head_pays_only_while_it_holds_the_others_up_less_than_it_spares_this_one() -> None:
    rate = PrefillRate()
    rate.observe(100, 1.0)  # no context term
    # Alone, with a disk as fast as the model: the fronts meet half way.
    assert rate.head_tokens(300, 0, 100.0) == 150
    assert rate.head_tokens(300, 0, 100.0, others=0) == 150
    # One request beside it: computing a token holds it up as long as loading the token
    # would keep this one waiting.
    assert not rate.head_pays(300, 0, 100.0, others=1)
    assert rate.head_tokens(300, 0, 100.0, others=1) == 0
    # A disk four times slower than the model: computing a token holds three others up,
    # together, for less time than loading it keeps this request waiting, so the head is
    # sized as alone; with four others it no longer is.
    assert rate.head_pays(300, 0, 25.0, others=3)
    assert rate.head_tokens(300, 0, 25.0, others=3) == rate.head_tokens(300, 0, 25.0) == 240
    assert not rate.head_pays(300, 0, 25.0, others=4)
    # Unknown speed: nothing to weigh, the head is whatever the caller does without one.
    assert PrefillRate().head_pays(300, 0, 25.0, others=8)


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


def test_slow_tiers_are_asked_only_when_reading_could_save_enough_time() -> None:
    # No prefill rate yet: nothing to weigh a read against, so the tiers are asked.
    assert worth_reading(16, None, None)
    # Rate of the slow tiers unknown: asked when computing alone takes MIN_SAVING_S or more.
    assert not worth_reading(1_000, 40_000.0, None)  # 25 ms
    assert worth_reading(8_000, 40_000.0, None)  # 200 ms
    # Both known: asked when the two fronts together would save MIN_SAVING_S.
    saving = 32_768 / 24_000 - 32_768 / (24_000 + 10_000)
    assert saving > MIN_SAVING_S and worth_reading(32_768, 24_000.0, 10_000.0)
    saving = 8_192 / 40_000 - 8_192 / (40_000 + 3_000)
    assert saving < MIN_SAVING_S and not worth_reading(8_192, 40_000.0, 3_000.0)
    # ... unless a fast tier holds some of those tokens further on: they come at once, and
    # the tiers are asked as while the disk's rate is unknown (computing alone >= 50 ms).
    assert worth_reading(8_192, 40_000.0, 3_000.0, fast_blocks_behind=True)
    assert not worth_reading(1_000, 40_000.0, 3_000.0, fast_blocks_behind=True)  # 25 ms alone
    # A threshold of 0 asks the slow tiers for every prefix.
    assert worth_reading(16, 40_000.0, None, min_saving_s=0.0)
    assert worth_reading(16, 40_000.0, 1.0, min_saving_s=0.0)


def test_a_slow_tiers_first_read_latency_counts_against_reading() -> None:
    # An 8K prefix on an H100 (~35K tokens/s) and a cold 1.3 GB/s disk (~10K tokens/s of an
    # 8B model's KV): reading saves 52 ms if the disk starts at once, 34 ms if its first
    # read ends 80 ms in: then it is not asked.
    assert worth_reading(8_192, 35_000.0, 10_000.0)
    assert not worth_reading(8_192, 35_000.0, 10_000.0, load_latency_s=0.08)
    # A 32K prefix (~24K tokens/s over it) still saves ~0.35 s with that latency.
    assert worth_reading(32_768, 24_000.0, 10_000.0, load_latency_s=0.08)
    # A latency longer than computing alone never makes reading look slower than that.
    assert not worth_reading(1_000, 10_000.0, 10_000.0, load_latency_s=5.0)


def test_reads_the_compute_front_overtook_still_teach_the_disks_rate(disk_dir: Path) -> None:
    """A disk too slow to land anything before the compute front reaches it must still
    be measured, or the scheduler keeps asking it (its rate unknown) and every restore
    pays the wait and the lookups for nothing."""
    hashes = warm(disk_dir, [PROMPT])
    # Every read slowed (`delay_s`), the first held until the front is past it: overtaken
    # whatever the machine's timing (a read not started by then would be cancelled, unmeasured).
    hook = ReadHook(delay_s=0.05, gate_at=1)
    with closing(TierManager(LAYOUT, config(disk_dir), disk_read_hook=hook)) as manager:
        driver = Driver(manager)
        driver.scheduler.prefill_rate.observe(8, 1e-6)  # the model: fast, 8 tokens a step
        driver.scheduler.min_restore_saving_s = 0.0  # ask the disk all the same
        request = driver.add(PROMPT)
        assert driver.step().scheduled == []  # the admitting step waits
        assert hook.gated.wait(timeout=60)  # block 7's read has started
        for _ in range(20):  # the front computes every block, 8 tokens a step
            if request.is_finished:
                break
            driver.step()
        assert request.is_finished, "the compute front waited for the read"
        hook.release()
        finish_idle(driver)
    assert restored_blocks(request) == 0 and hook.read == [hashes[7]]  # read, but overtaken
    rates = driver.scheduler.tier_rates
    assert 0 < rates.expected([Tier.DISK]) < 4 / 0.05 * 4  # ~80 tokens/s a thread, slow
    assert rates.expected_latency([Tier.DISK]) >= 0.05


def test_a_slow_disk_index_lookup_counts_in_the_disks_latency(disk_dir: Path,
                                                             monkeypatch) -> None:
    """After a dropped page cache the disk's index lookup alone took 0.2 s on a lent H100:
    it must weigh against reading like the first read's wait does."""
    warm(disk_dir, [PROMPT])
    with closing(TierManager(LAYOUT, config(disk_dir))) as manager:
        contains = manager.disk.contains

        def cold_contains(block_hashes):
            time.sleep(0.1)
            return contains(block_hashes)

        monkeypatch.setattr(manager.disk, "contains", cold_contains)
        driver = Driver(manager)
        driver.scheduler.min_restore_saving_s = 0.0  # ask the disk all the same
        request = driver.add(PROMPT)
        finish_idle(driver)
    assert restored_blocks(request) > 0
    assert driver.scheduler.tier_rates.expected_latency([Tier.DISK]) >= 0.1


def test_the_threshold_is_an_engine_option() -> None:
    from kvtier.engine import LLM

    with LLM("random:tiny-llama", device="cpu", gpu_blocks=8, host_cache=False,
             disk_cache=False, restore_min_saving_s=0.0) as llm:
        assert llm.scheduler.min_restore_saving_s == 0.0
    with pytest.raises(ValueError, match="restore_min_saving_s"):
        LLM("random:tiny-llama", device="cpu", restore_min_saving_s=-1.0)


def test_under_load_a_measured_tier_is_read_for_any_saving() -> None:
    """A prefix whose read saves less than the lone request's margin at the measured rates
    (more than the busy one): a request alone computes it (the margin guards its own
    latency); with others running or waiting the read is taken, the GPU time it saves going
    to them, even when its first read lands after the prefix would be computed. While the
    tier's rate is unknown the margin holds either way."""
    from kvtier.engine.request import RequestId
    from kvtier.engine.restore_gate import RestoreGate

    gate = RestoreGate()
    gate.prefill_rate.observe(10_000, 1.0)  # 10K tokens/s
    # Fronts of equal speeds halve its compute time: a saving above the busy margin and
    # below the lone request's.
    num_tokens = 200
    slow = [Tier.DISK]
    assert not gate.worth_reading(RequestId("alone"), num_tokens, 0, slow, False, busy=True)
    assert gate.counts.turned_away == 1  # no rate yet: the margin, and nothing to probe
    gate.tier_rates.observe(Tier.DISK, 10_000, 1.0, latency_s=0.0)
    assert not gate.worth_reading(RequestId("alone"), num_tokens, 0, slow, False, busy=False)
    assert gate.worth_reading(RequestId("busy"), num_tokens, 0, slow, False, busy=True)
    assert not gate.take_probe(RequestId("busy"))  # read on the rates, not as a probe
    # A first read that lands after the prefix would be computed: a request alone computes
    # it; beside others it still spares them the GPU time of its tokens.
    gate.tier_rates.observe(Tier.DISK, 10_000, 1.0, latency_s=0.1, replace=True)
    assert not gate.worth_reading(RequestId("late"), num_tokens, 0, slow, False, busy=False)
    assert gate.worth_reading(RequestId("late"), num_tokens, 0, slow, False, busy=True)
    # Too few tokens to take the busy margin's time to compute: computed either way.
    assert not gate.worth_reading(RequestId("tiny"), 5, 0, slow, False, busy=True)
