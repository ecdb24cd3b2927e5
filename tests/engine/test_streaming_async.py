"""`AsyncLLM`: the engine loop in one background thread, one async iterator per request.

- Concurrent streams equal `LLM.generate`, and each ends with its finishing delta.
- A full engine refuses a request (EngineFullError); a bad prompt raises ValueError.
- Leaving a stream early aborts its request: its blocks are free again at once.
- Shutdown ends the streams still open with EngineClosedError and refuses new work.
"""

from __future__ import annotations

import asyncio

import pytest
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.async_llm import AsyncLLM, EngineClosedError, EngineFullError

PROMPTS = ["Name a bird.", "Name a tree.", "Name a stone."]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_llm(smollm2) -> LLM:
    return LLM(smollm2, gpu_blocks=48, host_cache=False, disk_cache=False)


def smollm2_encode(llm: LLM, prompt: str) -> list[int]:
    return list(llm.tokenizer.encode(prompt))


async def consume(engine: AsyncLLM, token_ids: list[int], params: SamplingParams) -> dict:
    stream = await engine.submit(token_ids, params)
    ids, pieces, reasons = [], [], []
    async for delta in stream:
        ids += delta.token_ids
        pieces.append(delta.text)
        reasons.append(delta.finish_reason)
    return {"ids": tuple(ids), "text": "".join(pieces), "reasons": reasons}


def test_concurrent_streams_equal_generate(smollm2) -> None:
    params = SamplingParams(max_tokens=10)
    with make_llm(smollm2) as llm:
        prompts = [smollm2_encode(llm, p) for p in PROMPTS]
        expected = llm.generate(prompts, params)
    with make_llm(smollm2) as llm:
        engine = AsyncLLM(llm)

        async def run() -> list[dict]:
            return await asyncio.wait_for(asyncio.gather(
                *(consume(engine, p, params) for p in prompts)), timeout=300)

        try:
            results = asyncio.run(run())
        finally:
            engine.shutdown()
        llm.manager.pool.check_invariants()
    for result, output in zip(results, expected):
        assert result["ids"] == output.outputs[0].token_ids
        assert result["text"] == output.outputs[0].text
        assert result["reasons"][-1] == output.outputs[0].finish_reason
        assert set(result["reasons"][:-1]) <= {None}


def test_full_engine_bad_prompt_early_exit_and_shutdown(smollm2) -> None:
    long = SamplingParams(max_tokens=500, ignore_eos=True)
    with make_llm(smollm2) as llm:
        engine = AsyncLLM(llm, max_num_requests=2)
        prompt = smollm2_encode(llm, "Tell a long story.")

        async def scenario() -> None:
            first = await engine.submit(prompt, long)
            second = await engine.submit(prompt, long)
            with pytest.raises(EngineFullError):
                await engine.submit(prompt, long)
            # Leave `first` at its first token: its request is aborted, its blocks freed.
            deltas = first.__aiter__()
            async for delta in deltas:
                if delta.token_ids:
                    break
            await deltas.aclose()
            num_requests = await engine.call(lambda llm: len(llm._requests))
            for _ in range(100):  # the abort is a command the engine runs between steps
                if num_requests == 1:
                    break
                await asyncio.sleep(0.05)
                num_requests = await engine.call(lambda llm: len(llm._requests))
            assert num_requests == 1  # only `second` is left
            with pytest.raises(ValueError, match="must lie in"):
                await engine.submit([10**7], long)
            # Shutdown ends `second` with an abort and refuses new work.
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
            reasons = [delta.finish_reason async for delta in second]
            assert reasons[-1] == "abort" and len(reasons) < 500
            with pytest.raises(EngineClosedError):
                await engine.submit(prompt, long)

        asyncio.run(asyncio.wait_for(scenario(), timeout=300))
        assert not engine.is_running
        llm.manager.pool.check_invariants()
        assert llm.manager.pool.num_free_blocks == llm.manager.pool.num_blocks
        assert not llm.has_unfinished()
