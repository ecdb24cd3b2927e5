"""CUDA-graph decode: the attention launch a graph records, and graphs against eager steps.

The CPU test runs the Triton paged attention under TRITON_INTERPRET=1 with the metadata a
decode graph records (max_seq_len far above the real lengths, many split-KV ranges, padding
rows) against kernels.reference. The @gpu tests generate with and without graphs on a tiny
random model and compare the logits of every step and the tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.cuda_graphs import BATCH_BUCKETS, decode_buckets
from kvtier.engine.engine_config import EngineConfig
from kvtier.engine.loader import LoadedModel, load_model
from kvtier.kernels import AttentionConfig, paged_attention, reference

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_decode_buckets_cover_max_num_seqs() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(5) == (1, 2, 4, 8)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(10_000) == BATCH_BUCKETS
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def test_config_checks_cuda_graphs_flag() -> None:
    assert EngineConfig().cuda_graphs is True
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="maybe")  # type: ignore[arg-type]


def test_cpu_engine_records_no_graphs() -> None:
    with LLM("random:tiny-llama", device="cpu", host_cache=False, disk_cache=False,
             gpu_blocks=8) as llm:
        assert llm.runner.graphs is None
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(not INTERPRETING, reason="Triton kernels run on the CPU only under "
                    "TRITON_INTERPRET=1")
def test_graph_shaped_decode_attention_matches_reference() -> None:
    """Decode metadata as a graph records it: max_seq_len of 64 blocks for requests of 5 to
    40 tokens (most of the 16 splits are empty), and padding rows (seq_len 1, block table
    of zeros, slot 0 of block 0) up to the bucket."""
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, group, head_dim, block_size, num_blocks = 2, 4, 32, 16, 12
    real_lens, bucket, max_blocks = [5, 17, 40], 8, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables = torch.zeros(bucket, max_blocks, dtype=torch.int32)
    scattered = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0: padding's
    taken = 0
    for row, seq_len in enumerate(real_lens):
        count = -(-seq_len // block_size)
        block_tables[row, :count] = scattered[taken:taken + count].to(torch.int32)
        taken += count
    seq_lens = torch.ones(bucket, dtype=torch.int32)
    seq_lens[:len(real_lens)] = torch.tensor(real_lens, dtype=torch.int32)
    query_start_loc = torch.arange(bucket + 1, dtype=torch.int32)
    query = torch.randn(bucket, num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim ** -0.5
    max_seq_len = max_blocks * block_size
    args = (query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, 1, max_seq_len)

    graph_shaped = paged_attention(*args, scale, config=AttentionConfig(
        block_q=4, tile_n=16, num_splits=16))
    expected = reference.paged_attention(*args, scale)
    assert torch.isfinite(graph_shaped).all()
    torch.testing.assert_close(graph_shaped, expected, atol=2e-5, rtol=2e-5)
    # Padding rows see exactly one key: slot 0 of block 0, so their output is its value.
    padding_values = v_cache[0, 0].repeat_interleave(group, dim=0)  # [num_heads, head_dim]
    for row in range(len(real_lens), bucket):
        torch.testing.assert_close(graph_shaped[row], padding_values, atol=2e-5, rtol=2e-5)
    # The eager launch (real max_seq_len, no split) agrees on the real rows.
    eager = paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                            1, max(real_lens), scale,
                            config=AttentionConfig(block_q=4, tile_n=16, num_splits=1))
    torch.testing.assert_close(graph_shaped[:3], eager[:3], atol=2e-5, rtol=2e-5)


# ---- GPU: graphs against eager steps -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cuda() -> LoadedModel:
    return load_model("random:tiny-llama", "cuda", "float32", attn_backend="triton", seed=0)


def _generate(loaded: LoadedModel, prompts: list[list[int]], cuda_graphs: bool,
              max_tokens: int) -> tuple[list[tuple[int, ...]], list[torch.Tensor], int]:
    """(tokens per prompt, the logits of every step, the number of graph replays)."""
    with LLM(loaded, gpu_blocks=64, max_num_seqs=16, host_cache=False, disk_cache=False,
             cuda_graphs=cuda_graphs, warmup=False) as llm:
        assert (llm.runner.graphs is not None) == cuda_graphs
        recorded: list[torch.Tensor] = []
        sample = llm.runner.sample_fn

        def recording_sample(logits: torch.Tensor, requests: list) -> torch.Tensor:
            recorded.append(logits.detach().clone().cpu())
            return sample(logits, requests)

        llm.runner.sample_fn = recording_sample
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        replays = llm.runner.graphs.num_replays if cuda_graphs else 0
    return [o.outputs[0].token_ids for o in outputs], recorded, replays


def _prompts(num: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(length),), generator=gen).tolist()
            for length in torch.randint(5, 40, (num,), generator=gen)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [4, 3], ids=["bucket", "padded"])
def test_graph_decode_matches_eager(tiny_cuda: LoadedModel, num_prompts: int) -> None:
    prompts = _prompts(num_prompts, seed=num_prompts)
    max_tokens = 20
    eager_tokens, eager_logits, _ = _generate(tiny_cuda, prompts, False, max_tokens)
    graph_tokens, graph_logits, replays = _generate(tiny_cuda, prompts, True, max_tokens)
    # One prefill step samples every first token; each later step is a graph decode.
    assert replays == max_tokens - 1
    assert len(graph_logits) == len(eager_logits) == max_tokens
    for step, (graph, eager) in enumerate(zip(graph_logits, eager_logits)):
        torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert graph_tokens == eager_tokens


@pytest.mark.gpu
def test_graphs_cover_buckets_and_leave_mixed_steps_eager(tiny_cuda: LoadedModel) -> None:
    with LLM(tiny_cuda, gpu_blocks=64, max_num_seqs=5, host_cache=False,
             disk_cache=False, warmup=False) as llm:
        graphs = llm.runner.graphs
        assert graphs is not None and graphs.buckets == (1, 2, 4, 8)
        assert graphs.max_seq_len == 64 * 16  # min(1024 positions, 64 blocks of 16)
        # A second request arrives while the first decodes: its prefill step is mixed.
        llm.add_request([7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
        llm.step()  # prefill
        llm.step()  # decode of one request: bucket 1
        assert graphs.num_replays == 1
        llm.add_request(list(range(3, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
        llm.step()  # mixed: a decode and a prefill run eagerly
        assert graphs.num_replays == 1
        while llm.has_unfinished():
            llm.step()
        assert graphs.num_replays > 1
