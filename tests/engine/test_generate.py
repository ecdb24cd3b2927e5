"""End-to-end generation: greedy float32 outputs equal transformers' `generate()`.

Models: SmolLM2-135M through the "smollm2-135m" alias, and small random-weight Llama and
Qwen2 models built with `ModelConfig.to_hf()` (the Hugging Face twin is saved to a directory
that the engine loads, so both run the same weights). Prompts go from a few tokens to over
2,000, batched and one by one, with prefill chunked by a small token budget. The API's input
checks and the step-wise interface are exercised on the tiny model.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
import transformers
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.config import named_config
from kvtier.engine.loader import LoadedModel, converted_model_dir, load_model

from kvtier.stores import STORE_BATCH_BLOCKS, STORE_MAX_OFFERS

MAX_TOKENS = 6

_SENTENCES = (
    "The keeper of the northern lighthouse wrote down {n} passing ships in a green notebook.",
    "On day {n} the ferry left late because a goat had wandered onto the loading ramp.",
    "Her recipe for plum bread called for {n} grams of flour and a patient oven.",
    "The old clock in the station hall struck {n} times, although nobody had wound it.",
    "Twelve engineers argued for {n} minutes about where the new bridge should start.",
)


def filler_text(num_sentences: int) -> str:
    """Plain English of roughly 17 tokens per sentence, different for every sentence."""
    return " ".join(_SENTENCES[i % len(_SENTENCES)].format(n=i + 3)
                    for i in range(num_sentences))


def hf_greedy(hf_model, prompt_token_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_token_ids):].tolist()


def assert_same_tokens(outputs, prompts, references) -> None:
    for index, (output, prompt, reference) in enumerate(zip(outputs, prompts, references)):
        assert list(output.prompt_token_ids) == list(prompt)
        generated = list(output.outputs[0].token_ids)
        assert generated == reference, \
            f"prompt {index} ({len(prompt)} tokens): {generated} != {reference}"


# ---- tiny random models ------------------------------------------------------------------


@dataclasses.dataclass
class TinyModel:
    name: str
    loaded: LoadedModel
    hf: transformers.PreTrainedModel
    prompts: list[list[int]]
    references: list[list[int]]


def build_tiny(name: str, directory: Path) -> TinyModel:
    """A random model of `name`'s shape (context raised to 4096) and its HF twin."""
    config = dataclasses.replace(named_config(name), max_position_embeddings=4096)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config.to_hf(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough for clear argmax margins
        for param_name, param in hf.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, 0.1, generator=generator)
    hf.eval().save_pretrained(directory)
    loaded = load_model(str(directory), "cpu", "float32")
    token_gen = torch.Generator().manual_seed(1)
    # eos (2) is never in a prompt; lengths from a few tokens to over 2,000.
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=token_gen).tolist()
               for n in (3, 40, 700, 2100)]
    return TinyModel(name, loaded, hf, prompts, [hf_greedy(hf, p) for p in prompts])


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request, tmp_path_factory) -> TinyModel:
    return build_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> TinyModel:
    return build_tiny("tiny-llama", tmp_path_factory.mktemp("tiny-llama-api"))


def tiny_llm(model: TinyModel, **kwargs) -> LLM:
    options = {"gpu_blocks": 400, "host_cache": False, "disk_cache": False,
               "max_num_batched_tokens": 256}
    options.update(kwargs)
    return LLM(model.loaded, **options)


def test_tiny_models_match_transformers_batched_and_one_by_one(tiny: TinyModel) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with tiny_llm(tiny) as llm:
        batched = llm.generate(tiny.prompts, params)
    assert_same_tokens(batched, tiny.prompts, tiny.references)
    # One by one, each on a fresh engine: nothing cached, everything computed.
    for prompt, reference in zip(tiny.prompts, tiny.references):
        with tiny_llm(tiny) as llm:
            (output,) = llm.generate([prompt], params)
        assert list(output.outputs[0].token_ids) == reference
        assert output.metrics.cached_tokens == 0
        assert output.metrics.computed_tokens == len(prompt) + len(reference) - 1


def test_tiny_models_match_transformers_when_long_prompts_leave_room_to_short_ones(
        tiny: TinyModel) -> None:
    # Chunks of at most 32 tokens while others wait: the short prompts start beside the
    # 2,100-token one, and every answer stays transformers'.
    params = SamplingParams(max_tokens=MAX_TOKENS)
    longest = max(range(len(tiny.prompts)), key=lambda i: len(tiny.prompts[i]))
    order = [longest, *(i for i in range(len(tiny.prompts)) if i != longest)]
    prompts = [tiny.prompts[i] for i in order]
    with tiny_llm(tiny, long_prefill_token_threshold=32) as llm:
        assert llm.scheduler.long_prefill_token_threshold == 32
        requests = [llm.add_request(prompt, params) for prompt in prompts]
        first_token_step: dict[str, int] = {}
        outputs = {}
        step = 0
        while llm.has_unfinished():
            for delta in llm.stream_step():
                first_token_step.setdefault(delta.request_id, step)
                if delta.output is not None:
                    outputs[delta.request_id] = delta.output
            step += 1
    assert_same_tokens([outputs[r] for r in requests], prompts, [tiny.references[i]
                                                                 for i in order])
    # Every shorter prompt had its first token before the long one, which was admitted first.
    assert all(first_token_step[r] < first_token_step[requests[0]] for r in requests[1:])


def test_tiny_models_match_transformers_with_a_small_gpu_budget_and_a_host_tier(
        tiny: TinyModel) -> None:
    # 140 blocks of 16: the 2,100-token prompt fits alone (132 blocks), the batch does not.
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with tiny_llm(tiny, gpu_blocks=140, host_cache=True, host_cache_gb=0.05) as llm:
        batched = llm.generate(tiny.prompts, params)
        again = llm.generate(tiny.prompts[::-1], params)
    assert_same_tokens(batched, tiny.prompts, tiny.references)
    assert_same_tokens(again, tiny.prompts[::-1], tiny.references[::-1])
    # The second round found the prompts' blocks cached (on the GPU or the host).
    assert sum(o.metrics.cached_tokens for o in again) > 2000


def test_tiny_models_match_transformers_in_the_deterministic_mode(tiny: TinyModel) -> None:
    # The batch-invariant kernels keep float32 exactness: the same greedy tokens as
    # transformers, batched and through a small GPU budget with a host tier.
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with tiny_llm(tiny, deterministic=True) as llm:
        assert_same_tokens(llm.generate(tiny.prompts, params), tiny.prompts, tiny.references)
    with tiny_llm(tiny, deterministic=True, gpu_blocks=140, host_cache=True,
                  host_cache_gb=0.05) as llm:
        llm.generate(tiny.prompts, params)
        again = llm.generate(tiny.prompts[::-1], params)
    assert_same_tokens(again, tiny.prompts[::-1], tiny.references[::-1])
    assert sum(o.metrics.cached_tokens for o in again) > 2000


# ---- SmolLM2 -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf(smollm2: LoadedModel) -> transformers.PreTrainedModel:
    """transformers' model from the same converted weights the engine loaded."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(converted_model_dir()), dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def smollm2_case(smollm2: LoadedModel, smollm2_hf) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (a chat turn, a few raw tokens, ~300 and ~2,100 raw tokens) and references."""
    tokenizer = smollm2.tokenizer
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True)
    if not isinstance(chat, list):
        chat = chat["input_ids"]
    prompts = [list(chat), tokenizer.encode("The sky is"),
               tokenizer.encode(filler_text(18))[:300],
               tokenizer.encode(filler_text(130))[:2100]]
    assert len(prompts[1]) <= 4 and len(prompts[3]) == 2100
    return prompts, [hf_greedy(smollm2_hf, p) for p in prompts]


def test_smollm2_matches_transformers_batched_then_one_by_one(smollm2, smollm2_case) -> None:
    prompts, references = smollm2_case
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with LLM(smollm2, gpu_blocks=400, host_cache=False, disk_cache=False,
             max_num_batched_tokens=512) as llm:
        batched = llm.generate(prompts, params)
        assert_same_tokens(batched, prompts, references)
        singles = [llm.generate([p], params)[0] for p in prompts]
    assert_same_tokens(singles, prompts, references)
    # The second pass hit the first pass's full blocks in the GPU pool.
    long_prompt = singles[3]
    assert long_prompt.metrics.cached_tokens_gpu == (2100 - 1) // 16 * 16
    assert long_prompt.metrics.computed_tokens == 2100 - long_prompt.metrics.cached_tokens_gpu \
        + MAX_TOKENS - 1


def test_smollm2_generate_is_raw_and_chat_uses_the_template(smollm2, smollm2_case) -> None:
    prompts, references = smollm2_case
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with LLM(smollm2, gpu_blocks=64, host_cache=False, disk_cache=False) as llm:
        (raw,) = llm.generate("The sky is", params)
        (chat,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           params)
        (by_mapping,) = llm.generate([{"prompt": "The sky is"}], params)
        (with_system,) = llm.chat([{"role": "system", "content": "Answer in French."},
                                   {"role": "user", "content": "What is the capital of France?"}],
                                  params)
    assert list(raw.prompt_token_ids) == prompts[1] and raw.prompt == "The sky is"
    assert list(raw.outputs[0].token_ids) == references[1]
    assert list(by_mapping.outputs[0].token_ids) == references[1]
    assert list(chat.prompt_token_ids) == prompts[0]
    assert list(chat.outputs[0].token_ids) == references[0]
    assert chat.outputs[0].text.startswith("The capital")
    assert chat.prompt is not None and chat.prompt.endswith("assistant\n")
    # The system prompt reaches the model through the template, before the user's turn.
    template = smollm2.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer in French."},
         {"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    assert with_system.prompt == template and "Answer in French." in template
    assert list(with_system.prompt_token_ids) == smollm2.tokenizer.encode(
        template, add_special_tokens=False)


# ---- API behaviour (tiny model) ----------------------------------------------------------


def test_bad_input_is_rejected_with_a_clear_error(tiny_llama: TinyModel) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        LLM(tiny_llama.loaded, device="tpu")
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with tiny_llm(tiny_llama, gpu_blocks=20) as llm:
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]])
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("hello")
        with pytest.raises(ValueError, match="context is 4096"):
            llm.generate([[5] * 5000])
        with pytest.raises(ValueError, match="GPU block budget is 20"):
            llm.generate([[5] * 400])
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate([[5, 6], [5] * 400])
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate([[5, 6], [7, 8]], [SamplingParams()] * 3)
        with pytest.raises(ValueError, match="at least 1"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=0))
        with pytest.raises(ValueError, match=r"\[0, 256\)"):
            llm.generate([[5, 256]])
        assert not llm.has_unfinished()  # nothing of a rejected batch was queued
        # A prompt that fits exactly still runs; it ends when no block is left to grow into.
        (output,) = llm.generate([[5] * 320], SamplingParams(max_tokens=4))
        (completion,) = output.outputs
        assert completion.finish_reason == "length" and len(completion.token_ids) == 1
    with pytest.raises(ValueError, match="closed"):
        llm.generate([[5, 6]])


def test_step_interface_and_cache_salt(tiny_llama: TinyModel) -> None:
    prompt = tiny_llama.prompts[1]  # 40 tokens: 2 full blocks
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with tiny_llm(tiny_llama) as llm:
        first = llm.add_request(prompt, params, request_id="a")
        with pytest.raises(ValueError, match="already in use"):
            llm.add_request(prompt, params, request_id="a")
        outputs = []
        while llm.has_unfinished():
            outputs += llm.step()
        assert [o.request_id for o in outputs] == [first]
        assert list(outputs[0].outputs[0].token_ids) == tiny_llama.references[1]
        # Same salt (none) hits the cached blocks; another tenant's salt does not.
        same = llm.add_request(prompt, params)
        salted = llm.add_request(prompt, params, cache_salt="tenant-2")
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step())
        assert done[same].metrics.cached_tokens_gpu == 32
        assert done[salted].metrics.cached_tokens == 0
        assert list(done[salted].outputs[0].token_ids) == tiny_llama.references[1]
        assert done[same].metrics.ttft_s is not None and done[same].metrics.ttft_s >= 0
        stats = llm.stats()
        assert stats.pool.num_blocks == 400


def test_the_engine_thread_time_is_told_apart_by_part_of_the_step(
        tiny_llama: TinyModel) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with tiny_llm(tiny_llama) as llm:
        before = llm.thread_time()
        began = time.perf_counter()
        llm.generate(tiny_llama.prompts[:2], params)
        elapsed = time.perf_counter() - began
        spent = llm.thread_time().since(before)
        assert spent.planning_s == pytest.approx(llm.planning_seconds - before.planning_s)
        # On the CPU the launch is the step's compute; the tiers' work follows each step.
        assert spent.launching_s > 0 and spent.after_launch_s > 0 and spent.waiting_s >= 0
        assert sum(spent.as_dict().values()) <= elapsed
        # A copy: the engine's own count goes on without it.
        llm.generate(tiny_llama.prompts[:1], params)
        assert llm.thread_time().launching_s > before.launching_s + spent.launching_s


def _observe_store_submits(llm: LLM) -> list[int]:
    """Blocks queued for the host each time the engine offers them to `submit_stores`."""
    queued_when_offered: list[int] = []
    submit = llm.manager.submit_stores

    def observed_submit(batch: bool = False) -> None:  # the real call
        queued_when_offered.append(llm.manager.num_stores_queued)
        submit(batch)

    llm.manager.submit_stores = observed_submit
    return queued_when_offered


def test_a_long_prompts_stores_start_while_the_next_step_runs(tiny_llama: TinyModel) -> None:
    prompt = list(range(3, 3 + 16 * STORE_BATCH_BLOCKS + 8))  # STORE_BATCH_BLOCKS full blocks
    with tiny_llm(tiny_llama, host_cache=True, host_cache_gb=0.01) as llm:
        offered = _observe_store_submits(llm)
        llm.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS))
        llm.step()  # the prompt: its full blocks are queued for the host, held
        assert llm.manager.num_stores_queued == STORE_BATCH_BLOCKS
        assert llm.stats().host_cached == 0
        assert {block.ref_cnt for block in llm.manager.pool.blocks[:STORE_BATCH_BLOCKS]} == {2}
        llm.step()  # a decode step: they start while it runs (before its ids are read)
        assert offered[-1] == STORE_BATCH_BLOCKS and llm.manager.num_stores_queued == 0
        while llm.has_unfinished():
            llm.step()
        llm.manager.drain()
        assert llm.stats().host_cached == STORE_BATCH_BLOCKS


def test_a_few_blocks_wait_for_more_and_start_when_nothing_is_left_to_run(
        tiny_llama: TinyModel) -> None:
    prompt = tiny_llama.prompts[1]  # 40 tokens: 2 full blocks
    with tiny_llm(tiny_llama, host_cache=True, host_cache_gb=0.01) as llm:
        offered = _observe_store_submits(llm)
        llm.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS))
        llm.step()
        for _ in range(MAX_TOKENS - 2):  # decode steps: two blocks are too few to copy yet
            llm.step()
            assert llm.manager.num_stores_queued == 2 and llm.stats().host_cached == 0
        assert [block.ref_cnt for block in llm.manager.pool.blocks[:2]] == [2, 2]
        assert len(offered) < STORE_MAX_OFFERS
        llm.step()  # the last token: with nothing left to run, the copies start
        assert not llm.has_unfinished() and llm.manager.num_stores_queued == 0
        llm.manager.drain()
        assert llm.stats().host_cached == 2


def test_queued_stores_start_after_enough_offers(tiny_llama: TinyModel) -> None:
    prompt = tiny_llama.prompts[1]  # 40 tokens: 2 full blocks, then one per 16 decodes
    with tiny_llm(tiny_llama, host_cache=True, host_cache_gb=0.01) as llm:
        offered = _observe_store_submits(llm)
        # (The engine offers once a step: at most STORE_MAX_OFFERS steps.)
        params = SamplingParams(max_tokens=STORE_MAX_OFFERS + 4, ignore_eos=True)
        llm.add_request(prompt, params)
        while llm.stats().host_cached == 0:
            assert llm.has_unfinished(), "the request ended before its stores started"
            llm.step()
        # Offered with two blocks queued, held back until the last of STORE_MAX_OFFERS.
        assert [n for n in offered if n][:STORE_MAX_OFFERS] == [2] * STORE_MAX_OFFERS
        assert llm.stats().host_cached == 2


def test_seeded_sampling_is_reproducible(tiny_llama: TinyModel) -> None:
    prompts = tiny_llama.prompts[:2]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=7)
    with tiny_llm(tiny_llama) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with tiny_llm(tiny_llama) as llm:
        alone = llm.generate([prompts[1]], params)[0].outputs[0].token_ids
    assert alone == first[1]  # a seeded request draws the same tokens in any batch
    # Sampling, not greedy decoding, produced them.
    assert any(first[i][:MAX_TOKENS] != tuple(tiny_llama.references[i]) for i in range(2))
