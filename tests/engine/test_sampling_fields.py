"""The vLLM sampling fields: penalties and min_p against transformers' own logits
processors, logprobs against transformers' scores, and n completions through the engine."""

from __future__ import annotations

import pytest
import torch
import transformers
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.config import named_config
from kvtier.engine.loader import LoadedModel, build_model
from kvtier.engine.logits_processors import apply_min_p, apply_penalties
from kvtier.engine.sampler import sample
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

VOCAB = 64


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 3  # [num_rows, vocab]


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    logits = random_logits(2, seed=1)
    prompts = [[1, 5, 5, 9], [2, 3]]
    outputs = [[9, 11, 40], []]
    ours = apply_penalties(logits, [SamplingParams(repetition_penalty=penalty)] * 2, prompts,
                           outputs)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(2):
        seen = torch.tensor([prompts[row] + outputs[row]])
        expected = processor(seen, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], expected)
    assert not torch.equal(ours, logits)


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = random_logits(1, seed=2)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(logits, [params], [[7, 8]], [[3, 3, 3, 4]])
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 3 * 0.25  # generated three times
    expected[0, 4] -= 0.5 + 1 * 0.25
    # Tokens 7 and 8 only sit in the prompt: untouched (they are not generated text).
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_matches_transformers(min_p: float, temperature: float) -> None:
    logits = random_logits(3, seed=3)
    scaled = TemperatureLogitsWarper(temperature)(None, logits.clone())
    expected = MinPLogitsWarper(min_p)(None, scaled.clone())
    ours = apply_min_p(logits / temperature, torch.full((3,), min_p))
    torch.testing.assert_close(ours.isinf(), expected.isinf())
    kept = ~expected.isinf()
    torch.testing.assert_close(ours[kept], expected[kept])
    assert kept.sum() < kept.numel()  # the cut removed something


def test_sampling_with_min_p_draws_only_kept_tokens() -> None:
    logits = random_logits(1, seed=4)
    allowed = ~MinPLogitsWarper(0.2)(None, logits.clone()).isinf()[0]
    params = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    for seed in range(30):
        generator = torch.Generator().manual_seed(seed)
        (token,) = sample(logits.clone(), [params], [generator]).tolist()
        assert allowed[token]


def test_greedy_applies_the_repetition_penalty() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    params = SamplingParams(repetition_penalty=2.0)
    (token,) = sample(logits, [params], [None], [[10]], [[]]).tolist()
    assert token == 11  # 10 was in the prompt: 5 / 2 < 4
    with pytest.raises(ValueError, match="penalty"):
        sample(logits, [params], [None])


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"logprobs": -1}, "logprobs"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"n": True}, "n"),
    ({"best_of": 2}, "best_of"),
])
def test_bad_fields_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


# ---- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, transformers.PreTrainedModel]:
    """A random tiny Llama and its transformers twin with the same weights."""
    config = named_config("tiny-llama")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config.to_hf(), dtype=torch.float32)
    hf.eval()
    model = build_model(config, torch.device("cpu"), torch.float32, "torch",
                        hf.state_dict().items())
    return LoadedModel(model, None, config, "tiny-sampling@0"), hf


def engine(loaded: LoadedModel) -> LLM:
    return LLM(loaded, gpu_blocks=64, host_cache=False, disk_cache=False)


def test_logprobs_match_transformers_scores(tiny) -> None:
    loaded, hf = tiny
    prompt = [5, 9, 13, 17, 21]
    with engine(loaded) as llm:
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=4, logprobs=3))
    (completion,) = output.outputs
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert list(completion.token_ids) == hf_out.sequences[0, len(prompt):].tolist()
    assert len(completion.logprobs) == 4
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = torch.log_softmax(hf_out.logits[step][0].float(), dim=-1)
        top = expected.topk(3)
        assert entry[token].rank == 1  # greedy: the chosen token is the most likely
        assert set(entry) == set(top.indices.tolist())
        for rank, (value, index) in enumerate(zip(top.values, top.indices), start=1):
            assert entry[int(index)].rank == rank
            assert entry[int(index)].logprob == pytest.approx(float(value), abs=1e-4)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_n_completions_come_back_as_one_request(tiny) -> None:
    loaded, _ = tiny
    prompt = list(range(3, 40))  # two full blocks the completions share
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    with engine(loaded) as llm:
        (output,) = llm.generate([prompt], params)
        (again,) = llm.generate([prompt], params)
        (greedy,) = llm.generate([prompt], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    assert output.finished and [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in output.outputs)
    assert len({c.token_ids for c in output.outputs}) > 1  # each completion draws its own
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    # The second request found the prompt's full blocks cached for each completion.
    assert again.metrics.cached_tokens_gpu == 3 * 32
    assert output.metrics.computed_tokens >= 3 * 5  # every completion ran its own decodes
