"""One request cannot stop the engine (SmolLM2 on the CPU, tiers off).

- Every numeric sampling field is bounded to what the sampler can represent: a top_k past
  int64, a seed past 64 bits are refused; a temperature that would underflow is raised to
  the smallest one the sampler divides by.
- A request whose values slipped past validation (built with `model_construct`) and give
  NaN probabilities ends with "error" alone: the other requests of its batch answer as
  without it, and the next `generate` is not haunted by it.
- An internal error in one step ends that step's requests with "error"; the engine goes on
  and answers the same prompts as before.
- Through `AsyncLLM`, the failing request's stream raises RequestFailedError while a
  concurrent stream completes unchanged, and the engine keeps running.
"""

from __future__ import annotations

import asyncio

import pytest
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.async_llm import AsyncLLM, RequestFailedError
from kvtier.engine.sampler import MIN_TEMPERATURE

from kvtier.validation import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Name a bird.", "Name a tree."]
GREEDY = SamplingParams(max_tokens=8)


def make_llm(smollm2) -> LLM:
    return LLM(smollm2, gpu_blocks=48, host_cache=False, disk_cache=False)


def unchecked_nan_params() -> SamplingParams:
    """Params a validator would refuse: dividing the logits by 1e-50 gives inf, and NaN
    probabilities."""
    return SamplingParams.model_construct(
        **{**SamplingParams().model_dump(), "temperature": 1e-50, "max_tokens": 8})


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("seed", 2**64), ("temperature", 1e5), ("temperature", float("nan")),
    ("repetition_penalty", 1e-30), ("repetition_penalty", float("inf")),
    ("stop_token_ids", (2**63,)), ("min_p", float("nan")), ("top_p", float("nan"))])
def test_numeric_fields_are_bounded(field, value) -> None:
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_a_tiny_temperature_is_raised_to_the_smallest_usable_one() -> None:
    assert SamplingParams(temperature=1e-50).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).greedy


def test_a_request_whose_sampling_fails_ends_alone(smollm2) -> None:
    with make_llm(smollm2) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        outputs = llm.generate(PROMPTS + ["Name a fish."],
                               [GREEDY, GREEDY, unchecked_nan_params()])
        assert [o.outputs[0].token_ids for o in outputs[:2]] == expected
        bad = outputs[2].outputs[0]
        assert bad.finish_reason == "error" and "sampling" in bad.error
        # Nothing of the failed request is left queued: the next call answers as before.
        assert not llm.has_unfinished()
        again = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        llm.manager.pool.check_invariants()
        assert llm.manager.pool.num_free_blocks == llm.manager.pool.num_blocks


def test_an_internal_error_in_a_step_ends_its_requests_and_the_engine_goes_on(smollm2) -> None:
    with make_llm(smollm2) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        execute = llm.runner.execute
        calls = []

        def fail_third_step(*args, **kwargs):  # a fault injected into the model runner
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault")
            return execute(*args, **kwargs)

        llm.runner.execute = fail_third_step
        outputs = llm.generate(PROMPTS, GREEDY)
        assert {o.outputs[0].finish_reason for o in outputs} == {"error"}
        assert all("internal error" in o.outputs[0].error for o in outputs)
        assert not llm.has_unfinished()
        again = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        llm.manager.pool.check_invariants()
        assert llm.manager.pool.num_free_blocks == llm.manager.pool.num_blocks


def test_a_failing_stream_does_not_touch_a_concurrent_one(smollm2) -> None:
    with make_llm(smollm2) as llm:
        good_ids = list(llm.tokenizer.encode(PROMPTS[0]))
        bad_ids = list(llm.tokenizer.encode(PROMPTS[1]))
        [expected] = llm.generate([good_ids], GREEDY)
        engine = AsyncLLM(llm)

        async def scenario() -> tuple[tuple[int, ...], BaseException | None]:
            good = await engine.submit(good_ids, GREEDY)
            bad = await engine.submit(bad_ids, unchecked_nan_params())

            async def collect(stream) -> tuple[int, ...]:
                return tuple([t async for delta in stream for t in delta.token_ids])

            results = await asyncio.gather(collect(good), collect(bad),
                                           return_exceptions=True)
            return results[0], results[1]

        try:
            good_tokens, bad_result = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
            assert good_tokens == expected.outputs[0].token_ids
            assert isinstance(bad_result, RequestFailedError)
            assert "sampling" in str(bad_result)
            assert engine.is_running
        finally:
            engine.shutdown()
        assert engine.failure is None
