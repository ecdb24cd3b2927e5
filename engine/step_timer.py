"""How long the model took for the prefill steps it ran, on the device's own clock.

A step on CUDA returns once its kernels are queued (a chunk that samples nothing never
waits for the GPU), so the wall time of `ModelRunner.execute` says nothing about the model's
speed there: each timed step gets a pair of CUDA events, read once the GPU has passed the
second. On the CPU the step's wall time is its time. `Scheduler.prefill_rate` is fed from
here, and sizes what a restore computes against what it loads.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

#: Steps with fewer prefill tokens are not timed: they measure per-step costs, not the rate.
MIN_TIMED_TOKENS = 64


@dataclass(slots=True)
class _Pending:
    num_tokens: int
    num_keys: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class StepTimer:
    """Times steps of at least `MIN_TIMED_TOKENS` prefill tokens on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: deque[_Pending] = deque()
        self._done: list[tuple[int, int, float]] = []
        self._wall_start: float | None = None
        self._tokens = 0
        self._keys = 0

    def begin(self, num_tokens: int, num_keys: int = 0) -> None:
        """A step of `num_tokens` prefill tokens attending to `num_keys` keys in all
        (`restore_rates.prefill_keys`) starts (call `end` after queueing it)."""
        self._tokens, self._keys = num_tokens, num_keys
        if num_tokens < MIN_TIMED_TOKENS:
            return
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append(_Pending(num_tokens, num_keys, start,
                                          torch.cuda.Event(enable_timing=True)))
        else:
            self._wall_start = time.perf_counter()

    def end(self) -> None:
        if self._tokens < MIN_TIMED_TOKENS:
            return
        if self.device.type == "cuda":
            self._pending[-1].end.record()
        elif self._wall_start is not None:
            self._done.append((self._tokens, self._keys, time.perf_counter() - self._wall_start))
            self._wall_start = None

    def finished(self) -> list[tuple[int, int, float]]:
        """(prefill tokens, keys, seconds) of each timed step the device has finished since
        the last call, oldest first."""
        self._take_finished()
        done, self._done = self._done, []
        return done

    def num_queued(self) -> int:
        """Timed steps queued on the device and not finished now (0 on the CPU)."""
        self._take_finished()
        return len(self._pending)

    def _take_finished(self) -> None:
        while self._pending and self._pending[0].end.query():
            step = self._pending.popleft()
            self._done.append((step.num_tokens, step.num_keys,
                               step.start.elapsed_time(step.end) / 1e3))

    def unfinished(self) -> list[tuple[int, int]]:
        """(prefill tokens, keys) of the timed steps queued on the device and not finished
        at the last `finished` call (none on the CPU, where a step ends when it returns)."""
        return [(step.num_tokens, step.num_keys) for step in self._pending]
