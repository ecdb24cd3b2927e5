"""A step-by-step record of one engine for `bench longctx`: after every step, occupancy and
the bytes moved between tiers in it, and the fronts of restores under way."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.engine import LLM, RequestOutput, SamplingParams

from kvtier.stats import Direction, ManagerStats


class StepRecorder:
    """Samples an engine's stats after every step: occupancy and bytes moved in that step.

    Steps are numbered across every engine fed to it (`start`), so a strategy that restarts
    its engine keeps one timeline. The disk tier's block count is read only at `start` and
    between requests (`between_requests`): reading it touches LMDB, and after a dropped page
    cache that took milliseconds on the timed request's thread.
    """

    def __init__(self) -> None:
        self.samples: list[dict[str, Any]] = []
        self._origin = time.perf_counter()
        self._previous: ManagerStats | None = None
        self._phase = ""
        self._disk_blocks = 0

    def start(self, llm: LLM, phase: str) -> None:
        """Begin sampling `llm` (moves are counted from its current totals)."""
        self._previous = llm.stats(lower_tiers=False)
        self._phase = phase
        self.between_requests(llm)

    def between_requests(self, llm: LLM) -> None:
        """Read the disk tier's block count, for the steps that follow."""
        disk = llm.stats().disk
        self._disk_blocks = disk.num_blocks if disk is not None else 0

    def sample(self, llm: LLM) -> None:
        stats = llm.stats(lower_tiers=False)
        assert self._previous is not None, "start() the recorder before sampling"
        moved = {d.value: stats.bytes_moved(d) - self._previous.bytes_moved(d)
                 for d in Direction}
        self._previous = stats
        self.samples.append({
            "step": len(self.samples), "t_s": time.perf_counter() - self._origin,
            "phase": self._phase,
            "gpu_blocks": stats.pool.num_cached,
            "gpu_used_blocks": stats.pool.num_blocks - stats.pool.num_free,
            "host_blocks": stats.host_cached,
            "disk_blocks": self._disk_blocks,
            "bytes_moved": moved,
            "fronts": [{"compute_block": f.compute_block, "load_block": f.load_block,
                        "num_blocks": f.num_blocks, "restored": f.num_restored,
                        "computed": f.num_computed}
                       for f in llm.scheduler.restore_fronts().values()],
        })

    def swaps(self) -> list[dict[str, Any]]:
        """The steps in which bytes moved between tiers."""
        return [s for s in self.samples if any(s["bytes_moved"].values())]


def run_one(llm: LLM, prompt: Sequence[int], params: SamplingParams,
            recorder: StepRecorder) -> RequestOutput:
    """Run one request to completion, sampling the engine after every step."""
    request_id = llm.add_request(list(prompt), params)
    while True:
        outputs = llm.step()
        recorder.sample(llm)
        for output in outputs:
            if output.request_id == request_id:
                recorder.between_requests(llm)
                return output
