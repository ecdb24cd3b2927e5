"""CUDA graphs: the attention launch a graph records, prefill chunks as graph rows, and
graphs against eager steps.

The CPU tests run the Triton paged attention under TRITON_INTERPRET=1 with the metadata a
decode graph records (max_seq_len far above the real lengths, many split-KV ranges, padding
rows) against kernels.reference, and run a real model over the rows `stage_rows` builds for
a step mixing a prefill chunk and a decode against the eager step's inputs. The @gpu tests
generate with and without graphs on a tiny random model and compare the logits of every
step and the tokens.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.attention import AttentionMetadata
from kvtier.engine.cuda_graphs import (
    BATCH_BUCKETS,
    MAX_ROW_KEY_READS,
    chunk_key_reads,
    decode_buckets,
    stage_rows,
)
from kvtier.engine.engine_config import EngineConfig
from kvtier.engine.loader import LoadedModel, load_model
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.step_plan import ScheduledRequest
from kvtier.kernels import AttentionConfig, paged_attention, reference

from kvtier.device_cache import allocate_kv_cache
from kvtier.free_queue import KVCacheBlock

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


def test_chunk_key_reads_counts_each_rows_context() -> None:
    assert chunk_key_reads(0, 1) == 1
    assert chunk_key_reads(9, 1) == 10  # a decode at position 9
    assert chunk_key_reads(1024, 16) == sum(range(1025, 1041))
    # The 16 tokens left after a restored 16K prefix still run as rows; after 32K they do not.
    assert chunk_key_reads(16368, 16) <= MAX_ROW_KEY_READS < chunk_key_reads(32768, 16)


def _planned(request_id: str, block_ids: list[int], token_ids: list[int], start: int,
             num_new_tokens: int, samples: bool) -> ScheduledRequest:
    request = SimpleNamespace(request_id=request_id, token_ids=token_ids,
                              block_table=[KVCacheBlock(block_id) for block_id in block_ids])
    return ScheduledRequest(request, start, num_new_tokens, samples)  # type: ignore[arg-type]


def test_prefill_chunk_as_graph_rows_matches_the_eager_step() -> None:
    """A step with a 7-token chunk after a 37-token context, a decode and a one-token chunk
    that does not sample, staged as 9 rows of a 16-row bucket, gives the eager step's hidden
    state at every request's last token and stores the same K/V."""
    loaded = load_model("random:tiny-llama", "cpu", "float32", attn_backend="torch", seed=1)
    block_size, num_blocks = 16, 14
    dtype = next(loaded.model.parameters()).dtype
    cache = allocate_kv_cache(loaded.config.kv_layout(block_size, dtype), num_blocks, "cpu")
    cache.zero_()  # block 0 is what padding rows read (finite)
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (44, 21, 30)]
    tables = [[9, 3, 12], [5, 11], [2, 7]]  # scattered, block 0 left to padding
    runner = ModelRunner(loaded.model, cache, block_size, sample_fn=None)

    def forward(inputs_cache: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            return loaded.model.forward(ids, positions, inputs_cache, metadata)

    # The contexts, computed eagerly once.
    contexts = [_planned(f"r{i}", tables[i], tokens[i], 0, n, False)
                for i, n in enumerate((37, 20, 29))]
    inputs = runner.prepare_inputs(contexts)
    forward(cache, inputs.input_ids, inputs.positions, inputs.attn_metadata)
    rows_cache = cache.clone()

    step = [_planned("r0", tables[0], tokens[0], 37, 7, True),
            _planned("r1", tables[1], tokens[1], 20, 1, True),
            _planned("r2", tables[2], tokens[2], 29, 1, False)]
    inputs = runner.prepare_inputs(step)
    eager = forward(cache, inputs.input_ids, inputs.positions, inputs.attn_metadata)
    eager_last = eager[torch.tensor([6, 7, 8])]  # [3, hidden]

    size, max_blocks = 16, 8
    staged_tokens = np.full((4, size), 99, dtype=np.int64)
    seq_lens = np.full(size, 99, dtype=np.int32)
    block_tables = np.full((size, max_blocks), 99, dtype=np.int32)
    num_rows = stage_rows(step, block_size, staged_tokens, seq_lens, block_tables, size)
    assert num_rows == 9
    assert staged_tokens[3, :3].tolist() == [6, 7, 8]
    assert seq_lens[:9].tolist() == list(range(38, 45)) + [21, 30]
    assert staged_tokens[2, 9:].tolist() == [-1] * 7  # padding rows store nothing
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(size + 1, dtype=torch.int32),
        seq_lens=torch.from_numpy(seq_lens), block_tables=torch.from_numpy(block_tables),
        slot_mapping=torch.from_numpy(staged_tokens[2]), max_query_len=1,
        max_seq_len=max_blocks * block_size)
    rows = forward(rows_cache, torch.from_numpy(staged_tokens[0]),
                   torch.from_numpy(staged_tokens[1]), metadata)  # [size, hidden]
    rows_last = rows[torch.from_numpy(staged_tokens[3, :3])]
    torch.testing.assert_close(rows_last, eager_last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows_cache, cache, atol=1e-5, rtol=1e-5)
    changed = (rows_cache != 0).any(dim=tuple(range(1, cache.dim())))  # [num_blocks]
    assert not changed[0]  # padding rows wrote nothing into block 0


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
    assert sum(map(len, prompts)) > 16  # the prefill is too many rows for a graph
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


def _continue_after_prefix(loaded: LoadedModel, cuda_graphs: bool
                           ) -> tuple[list[tuple[int, ...]], list[torch.Tensor], int]:
    """Two prompts of 6 and 5 tokens (one 11-row prefill step), then a 40-token prompt and
    the same prompt plus 7 tokens: the second finds 32 tokens on the GPU and computes a
    15-token chunk. Then the prompt's first 20 tokens (16 found, 4 computed) beside a new
    3-token prompt: one 7-row step."""
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 256, (40,), generator=gen).tolist()
    steps: list[list[list[int]]] = [
        [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]],
        [prefix],
        [prefix + [21, 22, 23, 24, 25, 26, 27]],
    ]
    tokens: list[tuple[int, ...]] = []
    recorded: list[torch.Tensor] = []
    with LLM(loaded, gpu_blocks=64, max_num_seqs=16, host_cache=False, disk_cache=False,
             cuda_graphs=cuda_graphs, warmup=False) as llm:
        sample = llm.runner.sample_fn

        def recording_sample(logits: torch.Tensor, requests: list) -> torch.Tensor:
            recorded.append(logits.detach().clone().cpu())
            return sample(logits, requests)

        llm.runner.sample_fn = recording_sample
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        for prompts in steps:
            tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.add_request(prefix[:20], params)
        llm.add_request([31, 32, 33], params)
        while llm.has_unfinished():
            tokens += [o.outputs[0].token_ids for o in llm.step() if o.finished]
        replays = llm.runner.graphs.num_replays if cuda_graphs else 0
    return tokens, recorded, replays


@pytest.mark.gpu
def test_prefill_chunks_as_graph_rows_match_eager(tiny_cuda: LoadedModel) -> None:
    eager_tokens, eager_logits, _ = _continue_after_prefix(tiny_cuda, False)
    graph_tokens, graph_logits, replays = _continue_after_prefix(tiny_cuda, True)
    # Every step but the 40-token prefill (40 rows > the 16-row bucket) replays a graph.
    assert replays == len(graph_logits) - 1 > 0
    assert len(graph_logits) == len(eager_logits)
    for step, (graph, eager) in enumerate(zip(graph_logits, eager_logits)):
        torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert graph_tokens == eager_tokens


@pytest.mark.gpu
def test_graphs_cover_buckets_and_leave_long_steps_eager(tiny_cuda: LoadedModel) -> None:
    with LLM(tiny_cuda, gpu_blocks=64, max_num_seqs=5, host_cache=False,
             disk_cache=False, warmup=False) as llm:
        graphs = llm.runner.graphs
        assert graphs is not None and graphs.buckets == (1, 2, 4, 8)
        assert graphs.max_seq_len == 64 * 16  # min(1024 positions, 64 blocks of 16)
        llm.add_request([7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
        llm.step()  # a 3-token prefill: 3 rows of bucket 4
        llm.step()  # decode of one request: bucket 1
        assert graphs.num_replays == 2
        llm.add_request(list(range(3, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
        llm.step()  # a decode and a 27-token prefill: 28 rows, above bucket 8, run eagerly
        assert graphs.num_replays == 2
        while llm.has_unfinished():
            llm.step()
        assert graphs.num_replays > 2
