"""The prefill steps' timing that sizes restores' claims: `StepTimer` on the CPU (wall time)
and on CUDA (events read once the GPU passed them), and `PrefillRate`'s cost model."""

from __future__ import annotations

import time

import pytest
import torch
from kvtier.engine.restore_rates import PrefillRate, prefill_keys
from kvtier.engine.step_timer import MIN_TIMED_TOKENS, StepTimer


def test_cpu_steps_are_timed_by_the_wall_clock_and_short_ones_not_at_all() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin(MIN_TIMED_TOKENS, 5000)
    time.sleep(0.02)
    timer.end()
    timer.begin(MIN_TIMED_TOKENS - 1)  # a decode-sized step says nothing about prefill
    timer.end()
    [(num_tokens, num_keys, seconds)] = timer.finished()
    assert num_tokens == MIN_TIMED_TOKENS and num_keys == 5000 and 0.02 <= seconds < 5
    assert timer.unfinished() == []  # a CPU step has ended when it returns
    assert timer.num_queued() == 0
    assert timer.finished() == []  # each step is reported once


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_are_reported_once_the_gpu_has_run_them() -> None:
    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    timer.begin(1000, 7)
    for _ in range(20):
        a = a @ a / 64
    timer.end()
    timer.finished()  # the GPU is still busy with the step here, or has just finished it
    assert timer.unfinished() in ([(1000, 7)], [])
    torch.cuda.synchronize()
    assert timer.num_queued() == 0  # counting them keeps their times for `finished`
    [(num_tokens, num_keys, seconds)] = timer.finished()
    assert num_tokens == 1000 and num_keys == 7 and seconds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_queued_on_the_gpu_are_counted_until_it_ran_them() -> None:
    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time ahead of both steps
    for num_tokens in (100, 200):
        timer.begin(num_tokens)
        a = a @ a / 64
        timer.end()
    assert timer.num_queued() == 2
    torch.cuda.synchronize()
    assert timer.num_queued() == 0
    assert [step[0] for step in timer.finished()] == [100, 200]


def test_steps_at_one_context_give_a_rate_per_token() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None and rate.seconds(100, 0) is None
    assert rate.head_tokens(1000, 0, 50.0) == 0  # nothing known: nothing claimed
    rate.observe(1000, 0.0)  # no time measured: ignored
    rate.observe(0, 1.0)
    assert rate.tokens_per_s is None
    rate.observe(1000, 1.0, prefill_keys(1000, 0))
    assert rate.tokens_per_s == pytest.approx(1000) and rate.per_key_s == 0
    assert rate.seconds(500, 4000) == pytest.approx(0.5)  # no way to tell context apart yet


def test_steps_at_several_contexts_separate_the_cost_per_key() -> None:
    # Steps of a model that spends 1 ms per token and 1 us per key attended to.
    def seconds(n: int, context: int) -> float:
        return 1e-3 * n + 1e-6 * prefill_keys(n, context)

    rate = PrefillRate()
    for n, context in [(1000, 0), (1000, 8000), (500, 20000)]:
        rate.observe(n, seconds(n, context), prefill_keys(n, context))
    assert rate.per_token_s == pytest.approx(1e-3) and rate.per_key_s == pytest.approx(1e-6)
    assert rate.seconds(300, 30000) == pytest.approx(seconds(300, 30000))
    # Recent steps weigh most: a model twice as fast is followed within a few steps.
    for _ in range(12):
        for n, context in [(1000, 0), (1000, 8000)]:
            rate.observe(n, seconds(n, context) / 2, prefill_keys(n, context))
    assert rate.per_token_s == pytest.approx(5e-4, rel=0.01)


def test_the_head_ends_when_the_tier_delivers_the_rest() -> None:
    rate = PrefillRate()
    rate.observe(1000, 1.0, prefill_keys(1000, 0))  # 1,000 tokens/s, nothing per key
    # With no cost per key: the head's share is R*P/(P+L).
    assert rate.head_tokens(3000, 0, 2000.0) == 1000
    for n, context in [(1000, 0), (1000, 8000)]:
        rate.observe(n, 1e-3 * n + 1e-6 * prefill_keys(n, context), prefill_keys(n, context))
    head = rate.head_tokens(30000, 2000, 3000.0)
    # Computing the head after 2,000 tokens takes as long as loading the other tokens.
    assert rate.seconds(head, 2000) == pytest.approx((30000 - head) / 3000.0, rel=1e-3)
    assert head < 30000 * 1000 / (1000 + 3000)  # the dearer tail leaves the head shorter
    assert rate.head_tokens(100, 0, 1e-9) >= 99  # a tier that hardly delivers: compute all


def test_a_backlog_on_the_device_leaves_the_head_to_the_loads() -> None:
    rate = PrefillRate()
    for n, context in [(1000, 0), (1000, 8000)]:
        rate.observe(n, 1e-3 * n + 1e-6 * prefill_keys(n, context), prefill_keys(n, context))
    free = rate.head_tokens(30000, 2000, 3000.0)
    rate.set_backlog([(1000, prefill_keys(1000, 0))])  # one step queued: about 1.5 s
    assert rate.backlog_s == pytest.approx(rate.seconds(1000, 0))
    head = rate.head_tokens(30000, 2000, 3000.0)
    assert 0 < head < free
    # The head starts after the backlog and ends when the loads deliver the rest.
    assert rate.backlog_s + rate.seconds(head, 2000) == pytest.approx((30000 - head) / 3000.0,
                                                                      rel=1e-3)
    rate.set_backlog([(100000, 0)])  # longer than the loads take: they deliver everything
    assert rate.head_tokens(30000, 2000, 3000.0) == 0
