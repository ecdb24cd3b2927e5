"""Where the engine thread's time goes in its steps (`LLM.thread_time`).

The GPU runs what the engine thread queued; while the thread plans, launches or moves
blocks, a GPU without queued work waits. Beside busy I/O threads the thread also waits for
the GIL, and that lands in whichever part was running (docs/BENCHMARKS.md, "The engine
thread beside the I/O threads").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class ThreadTime:
    """Seconds the engine thread spent in each part of its steps.

    planning_s: `Scheduler.schedule` (polls, lookups, allocations, issuing loads).
    launching_s: the model runner's step until its kernels are queued (on CUDA their
        launches; on the CPU the step's compute, which the launch runs).
    after_launch_s: `Scheduler.launched` (loads issued, stores started, transfers
        advanced) while the GPU computes the step.
    waiting_s: waiting for the GPU (for queued steps before planning, for the sampled ids
        after `launched`), landing loads meanwhile.
    """

    planning_s: float = 0.0
    launching_s: float = 0.0
    after_launch_s: float = 0.0
    waiting_s: float = 0.0

    def since(self, earlier: ThreadTime) -> ThreadTime:
        """The seconds spent between `earlier` (a copy taken then) and now."""
        return ThreadTime(*(now - then for now, then in
                            zip(dataclasses.astuple(self), dataclasses.astuple(earlier))))

    def as_dict(self) -> dict[str, float]:
        """The parts by name (`planning_s`, ...), for reports."""
        return dataclasses.asdict(self)
