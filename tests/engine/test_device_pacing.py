"""On CUDA the engine plans a step once the GPU is down to `MAX_STEPS_AHEAD` queued prefill
steps: a long prompt's chunks would otherwise fill CUDA's launch queue, and the engine thread
would block in a launch, landing no loads, with its claims made long before the GPU gets to
them. GPU only (on the CPU a step has ended when it returns)."""

from __future__ import annotations

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.scheduler import MAX_STEPS_AHEAD

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_long_prompt_is_planned_at_most_one_step_ahead_of_the_gpu() -> None:
    # An 8B shape, so that a chunk of 8192 tokens computes far longer than it takes to launch.
    with LLM("random:llama3-8b", device="cuda", dtype="bfloat16", max_num_batched_tokens=8192,
             gpu_blocks=2200, host_cache=False, disk_cache=False, cuda_graphs=False) as llm:
        queued: list[int] = []
        schedule = llm.scheduler.schedule

        def counting_schedule():
            queued.append(llm.runner.step_timer.num_queued())
            return schedule()

        llm.scheduler.schedule = counting_schedule
        prompt = torch.randint(10, 30000, (32768,), generator=torch.Generator().manual_seed(0))
        [output] = llm.generate([prompt.tolist()], SamplingParams(max_tokens=2))
        assert len(output.outputs[0].token_ids) == 2
        # Four chunks: the later ones are planned with one step still queued, never two.
        assert max(queued) == MAX_STEPS_AHEAD, queued
