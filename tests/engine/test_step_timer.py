"""The prefill steps' timing that sizes restores' claims: `StepTimer` on the CPU (wall time)
and on CUDA (events read once the GPU passed them), and `PrefillRate`'s average."""

from __future__ import annotations

import time

import pytest
import torch
from kvtier.engine.restore_rates import MIN_SAVING_S, PrefillRate, worth_reading
from kvtier.engine.step_timer import MIN_TIMED_TOKENS, StepTimer


def test_cpu_steps_are_timed_by_the_wall_clock_and_short_ones_not_at_all() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin(MIN_TIMED_TOKENS)
    time.sleep(0.02)
    timer.end()
    timer.begin(MIN_TIMED_TOKENS - 1)  # a decode-sized step says nothing about prefill
    timer.end()
    [(num_tokens, seconds)] = timer.finished()
    assert num_tokens == MIN_TIMED_TOKENS and 0.02 <= seconds < 5
    assert timer.finished() == []  # each step is reported once


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_are_reported_once_the_gpu_has_run_them() -> None:
    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    timer.begin(1000)
    for _ in range(20):
        a = a @ a / 64
    timer.end()
    torch.cuda.synchronize()
    [(num_tokens, seconds)] = timer.finished()
    assert num_tokens == 1000 and seconds > 0


def test_the_prefill_rate_follows_recent_steps() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    rate.observe(1000, 0.0)  # no time measured: ignored
    rate.observe(0, 1.0)
    assert rate.tokens_per_s is None
    rate.observe(1000, 1.0)
    assert rate.tokens_per_s == 1000
    rate.observe(3000, 1.0)
    assert rate.tokens_per_s == 2000  # half the old average, half the new step


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
    # A threshold of 0 asks the slow tiers for every prefix.
    assert worth_reading(16, 40_000.0, None, min_saving_s=0.0)
    assert worth_reading(16, 40_000.0, 1.0, min_saving_s=0.0)
