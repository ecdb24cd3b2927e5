"""The prefill steps' timing that sizes restores' claims: `StepTimer` on the CPU (wall time)
and on CUDA (events read once the GPU passed them), and `PrefillRate`'s average."""

from __future__ import annotations

import time

import pytest
import torch
from kvtier.engine.restore_rates import PrefillRate
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
