"""An engine on the second GPU: its load, steps, swaps and engine thread all launch there
(CUDA's current device is per thread; `kvtier.cuda_device.bind_thread`). Needs two GPUs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.async_llm import AsyncLLM
from kvtier.engine.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]
PROMPTS = [[17 + i + 3 * j for j in range(40 + 7 * i)] for i in range(4)]


def _engine(device: str) -> LLM:
    loaded = load_model("random:tiny-llama", torch.device(device), "float32", seed=5)
    return LLM(loaded, gpu_blocks=64, host_cache=True, host_cache_gb=0.01)


def test_an_engine_on_cuda_1_gives_cuda_0s_tokens_from_any_thread() -> None:
    params = SamplingParams(max_tokens=8)
    with _engine("cuda:0") as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    torch.cuda.set_device(0)  # the caller's thread points elsewhere, as a server's may
    with _engine("cuda:1") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
        engine = AsyncLLM(llm)

        async def one(prompt: list[int]) -> tuple[int, ...]:
            ids: list[int] = []
            async for delta in await engine.submit(prompt, params):
                ids += delta.token_ids
            return tuple(ids)

        async def every() -> list[tuple[int, ...]]:  # gathered inside the running loop
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 300)

        try:
            torch.cuda.set_device(0)
            streamed = asyncio.run(every())
        finally:
            engine.shutdown()
    assert [list(s) for s in streamed] == [list(e) for e in expected]
