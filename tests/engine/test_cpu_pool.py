"""On the CPU the KV pool is sized from the model's context and the batch, not from RAM."""

from __future__ import annotations

from kvtier.engine import LLM, SamplingParams
from kvtier.engine.config import named_config
from kvtier.engine.sizing import cpu_pool_blocks


def test_cpu_pool_follows_context_and_batch() -> None:
    context = named_config("tiny-llama").max_position_embeddings
    with LLM("random:tiny-llama", device="cpu", host_cache=False, disk_cache=False) as llm:
        assert llm.num_gpu_blocks == -(-context // 16) + 64 - 1
    with LLM("random:tiny-llama", device="cpu", host_cache=False, disk_cache=False,
             max_model_len=128, max_num_seqs=4, block_size=8) as llm:
        assert llm.num_gpu_blocks == cpu_pool_blocks(128 // 8, 4) == 16 + 3
        # A batch larger than the pool holds at once still finishes: requests wait for
        # room (or are preempted) instead of failing.
        prompts = [[(7 * i + j) % 200 + 1 for j in range(60)] for i in range(6)]
        assert len(prompts) * -(-(60 + 8) // 8) > llm.num_gpu_blocks
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * 6
