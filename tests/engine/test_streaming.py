"""Streaming output, stop strings and abort on SmolLM2 (CPU, float32).

- The incremental detokenizer never hands out half a character and its deltas add up to a
  full decode (also for text whose characters span several byte-level tokens).
- `stream_step` deltas of greedy requests add up to `generate`'s tokens and text.
- Stop strings cut the text before them, hold back text that may begin one, and end the
  request; a stop token id's text is left out.
- `abort` frees the blocks at once, keeps full blocks cached, also for a request whose
  prefix is still being read from disk.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.loader import LoadedModel

TEXTS = ["Write one sentence about rivers.", "List three colours."]


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """The prompts as token ids (no chat template on any path)."""
    return [smollm2.tokenizer.encode(text) for text in TEXTS]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_llm(smollm2: LoadedModel, **options) -> LLM:
    defaults = {"gpu_blocks": 64, "host_cache": False, "disk_cache": False}
    return LLM(smollm2, **{**defaults, **options})


def stream_all(llm: LLM) -> dict[str, dict]:
    """Step to the end; per request its deltas' tokens, text pieces and finish reason."""
    seen: dict[str, dict] = {}
    while llm.has_unfinished():
        for delta in llm.stream_step():
            entry = seen.setdefault(delta.request_id, {"ids": [], "pieces": [], "reason": None,
                                                       "output": None})
            assert entry["reason"] is None, "a delta after the finishing one"
            entry["ids"] += delta.token_ids
            entry["pieces"].append(delta.text)
            entry["reason"] = delta.finish_reason
            entry["output"] = delta.output
    return seen


def test_detokenizer_deltas_add_up_to_a_full_decode(smollm2) -> None:
    tokenizer = smollm2.tokenizer
    text = "héllo wörld 日本語 🙂 ok . Ünïcödé ✓ done"
    rng = random.Random(0)
    sequences = [tokenizer.encode(text)]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(5)]
    for token_ids in sequences:
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add([t]) for t in token_ids]
        pieces.append(detok.finish())
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(pieces) == full
        if token_ids is sequences[0]:
            assert not any("\ufffd" in p for p in pieces), pieces  # no half character


def test_stream_step_deltas_equal_generate(smollm2, prompts) -> None:
    params = SamplingParams(max_tokens=12)
    with make_llm(smollm2) as llm:
        expected = llm.generate(prompts, params)
    with make_llm(smollm2) as llm:
        ids = [llm.add_request(p, params) for p in prompts]
        seen = stream_all(llm)
        llm.manager.pool.check_invariants()
    for rid, output in zip(ids, expected):
        entry = seen[rid]
        assert tuple(entry["ids"]) == output.outputs[0].token_ids
        assert "".join(entry["pieces"]) == output.outputs[0].text
        assert entry["reason"] == output.outputs[0].finish_reason
        assert entry["output"].outputs[0].token_ids == output.outputs[0].token_ids
        # One delta per step at least.
        assert len(entry["pieces"]) >= len(output.outputs[0].token_ids)


def test_stop_strings_cut_the_text_and_end_the_request(smollm2, prompts) -> None:
    with make_llm(smollm2) as llm:
        [free] = llm.generate(prompts[:1], SamplingParams(max_tokens=16, ignore_eos=True))
    text = free.outputs[0].text
    stop = text[6:9]  # a stop string in the middle of the greedy answer
    assert stop and text.find(stop) >= 1
    never = text[:3] + "\x00never"  # begins like the text but never completes
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=(never, stop))
    with make_llm(smollm2) as llm:
        [cut] = llm.generate(prompts[:1], params)
        # The token that completes the stop string is also the last one max_tokens allows.
        [edge] = llm.generate(prompts[:1], SamplingParams(
            max_tokens=len(cut.outputs[0].token_ids), ignore_eos=True, stop=(stop,)))
        rid = llm.add_request(prompts[0], params)
        seen = stream_all(llm)[rid]
        llm.manager.pool.check_invariants()
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == text[:text.find(stop)]
    assert len(cut.outputs[0].token_ids) < len(free.outputs[0].token_ids)
    edge_c, cut_c = edge.outputs[0], cut.outputs[0]
    assert (edge_c.text, edge_c.finish_reason, edge_c.token_ids) == \
        (cut_c.text, "stop", cut_c.token_ids)
    assert cut.outputs[0].token_ids == free.outputs[0].token_ids[:len(cut.outputs[0].token_ids)]
    assert "".join(seen["pieces"]) == cut.outputs[0].text
    assert seen["reason"] == "stop"
    # Held back until it could no longer start `never`, then handed out.
    with make_llm(smollm2) as llm:
        [held] = llm.generate(prompts[:1], SamplingParams(max_tokens=16, ignore_eos=True,
                                                          stop=(never,)))
    assert held.outputs[0].text == text and held.outputs[0].finish_reason == "length"


def test_a_stop_token_ends_the_request_without_its_text(smollm2, prompts) -> None:
    with make_llm(smollm2) as llm:
        [free] = llm.generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))
        stop_id = free.outputs[0].token_ids[4]
        [cut] = llm.generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True,
                                                         stop_token_ids=(stop_id,)))
    first = free.outputs[0].token_ids.index(stop_id)
    assert cut.outputs[0].token_ids == free.outputs[0].token_ids[:first + 1]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == smollm2.tokenizer.decode(list(free.outputs[0].token_ids[:first]),
                                                skip_special_tokens=True)


def test_abort_frees_blocks_at_once_and_keeps_full_ones_cached(smollm2, prompts) -> None:
    prompt = smollm2.tokenizer.encode("The history of the river valley is long and " * 6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with make_llm(smollm2) as llm:
        [expected] = llm.generate(prompts[1:], params)
    with make_llm(smollm2) as llm:
        victim = llm.add_request(prompt, params)
        other = llm.add_request(prompts[1], params)
        for _ in range(3):
            llm.stream_step()
        pool = llm.manager.pool
        held = pool.num_blocks - pool.num_free_blocks
        assert llm.abort(victim)
        assert not llm.abort(victim)  # already stopped
        num_full = len(prompt) // 16
        assert pool.num_blocks - pool.num_free_blocks <= held - -(-len(prompt) // 16)
        assert pool.stats().num_cached >= num_full
        deltas = llm.stream_step()
        [ended] = [d for d in deltas if d.request_id == victim]
        assert ended.finish_reason == "abort" and ended.output is not None
        seen = stream_all(llm)
        assert seen[other]["output"].outputs[0].token_ids == expected.outputs[0].token_ids
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks
        # The aborted prompt's full blocks are served from the GPU cache.
        again = llm.add_request(prompt, SamplingParams(max_tokens=1))
        [done] = [d.output for d in stream_all_outputs(llm) if d.request_id == again]
        assert done.metrics.cached_tokens_gpu == num_full * 16


def stream_all_outputs(llm: LLM):
    outputs = []
    while llm.has_unfinished():
        outputs += [d for d in llm.stream_step() if d.output is not None]
    return outputs


def test_abort_while_the_prefix_loads_from_disk(smollm2, tmp_path: Path) -> None:
    prompt = smollm2.tokenizer.encode("A document about tiered storage of caches. " * 8)
    options = {"disk_cache": True, "disk_cache_dir": tmp_path, "host_cache": True,
               "host_cache_gb": 0.05}
    with make_llm(smollm2, **options) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    # A fresh engine: the prefix is on disk only, so admitting it starts a disk read.
    with make_llm(smollm2, **options) as llm:
        rid = llm.add_request(prompt, SamplingParams(max_tokens=4))
        llm.step()
        # Admitted at once: its restore loads the prefix from disk while the compute front
        # starts (the first claim waits a step for loads in flight).
        assert rid in llm.scheduler.restore_fronts()
        assert llm.abort(rid)
        outputs = []
        while llm.has_unfinished():
            outputs += llm.step()
        assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
        manager = llm.manager
        manager.pool.check_invariants()
        assert manager.pool.num_free_blocks == manager.pool.num_blocks
        assert manager.stats().num_loads_in_flight == 0
        manager.host.check_invariants(idle=True)


@pytest.mark.parametrize("bad", [("",), ("ok", 3)])
def test_bad_stop_strings_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=bad)
