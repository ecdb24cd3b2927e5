"""The engine's models over the paged KV cache against transformers, and ModelConfig.

Each request is prefilled in chunks that straddle block boundaries, then decoded token by
token, batched with another request of a different length whose steps start later, over
scrambled block tables. The logits of every position must equal transformers' forward on
the whole sequence (float32, eager attention) and pick the same argmax.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import transformers
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.attention import AttentionMetadata, PagedAttention, select_backend
from kvtier.engine.config import NAMED_CONFIGS, ModelConfig, RopeScaling, named_config
from kvtier.engine.loader import LoadedModel, converted_model_dir, load_model
from kvtier.engine.models.llama import rope_inv_freq
from kvtier.kernels import cudnn_backend
from kvtier.kernels.cudnn_backend import cudnn_available
from transformers import AutoModelForCausalLM

from kvtier.device_cache import allocate_kv_cache, layer_views

TINY = ["tiny-llama", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]

# float32 on both sides; the only difference is the order of reductions in attention and
# matmuls over differently shaped batches.
ATOL = RTOL = 1e-4


def hf_twin(loaded: LoadedModel) -> torch.nn.Module:
    """transformers' model for `loaded.config`, holding the same weights."""
    hf_model = AutoModelForCausalLM.from_config(loaded.config.to_hf(), dtype=torch.float32,
                                                attn_implementation="eager")
    result = hf_model.load_state_dict(loaded.model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
    assert set(result.missing_keys) == tied and not result.unexpected_keys, result
    return hf_model.eval()


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def run_plans(batch, sequences: list[list[int]], plans: list[list[int]]) -> list[torch.Tensor]:
    """Step i feeds request r the next plans[r][i] tokens of sequences[r] (0: sits out)."""
    fed = [0] * len(sequences)
    outs: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in range(max(len(plan) for plan in plans)):
        chunks = []
        for r, plan in enumerate(plans):
            size = plan[step] if step < len(plan) else 0
            chunks.append(sequences[r][fed[r]:fed[r] + size] or None)
            fed[r] += size
        for r, logits in enumerate(batch.step(chunks)):
            if logits is not None:
                outs[r].append(logits)
    assert fed == [len(s) for s in sequences], "plans must cover the sequences"
    return [torch.cat(out) for out in outs]


@pytest.mark.parametrize("name", TINY)
def test_random_model_matches_transformers(name, paged_batch):
    loaded = load_model(f"random:{name}", "cpu", "float32", seed=3)
    hf_model = hf_twin(loaded)
    gen = torch.Generator().manual_seed(11)
    vocab = loaded.config.vocab_size
    sequences = [torch.randint(0, vocab, (45,), generator=gen).tolist(),
                 torch.randint(0, vocab, (23,), generator=gen).tolist()]
    plans = [[16, 13, 11, 1, 1, 1, 1, 1],
             [0, 7, 9, 1, 1, 1, 1, 1, 1, 1]]
    batch = paged_batch(loaded.model, loaded.config, num_reqs=2, max_len=48, seed=5)
    got = run_plans(batch, sequences, plans)
    for tokens, logits in zip(sequences, got):
        expected = hf_logits(hf_model, tokens)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_smollm2_greedy_decode_matches_transformers(smollm2, paged_batch):
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(converted_model_dir()), dtype=torch.float32, attn_implementation="eager",
        local_files_only=True).eval()
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.encode("The KV cache of a transformer stores the keys and values of "
                                "every earlier token, so that generating the next token only "
                                "needs one new row per layer. Explain why this matters:"),
               tokenizer.encode("Paris is the capital of")]
    assert len(prompts[0]) > 32 and len(prompts[0]) != len(prompts[1])
    num_new = 5
    batch = paged_batch(smollm2.model, smollm2.config, num_reqs=2,
                        max_len=len(prompts[0]) + num_new, seed=2)
    # Prefill: request 0 in three chunks (16, 13, rest), request 1 in one, a step later.
    first = prompts[0]
    steps = [[first[:16], None], [first[16:29], prompts[1]], [first[29:], None]]
    sequences = [list(p) for p in prompts]
    logits = [[], []]
    for chunks in steps:
        for r, out in enumerate(batch.step(chunks)):
            if out is not None:
                logits[r].append(out)
    # Both requests are now prefilled; decode greedily, batched.
    for _ in range(num_new):
        next_ids = [int(torch.cat(lg)[-1].argmax()) for lg in logits]
        for r, token_id in enumerate(next_ids):
            sequences[r].append(token_id)
        for r, out in enumerate(batch.step([[t] for t in next_ids])):
            logits[r].append(out)
    for r, prompt in enumerate(prompts):
        got = torch.cat(logits[r])  # [len(sequences[r]), vocab]
        expected = hf_logits(hf_model, sequences[r])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        # Hence the greedy continuation is transformers' greedy continuation.
        assert sequences[r][len(prompt):] == expected.argmax(-1)[len(prompt) - 1:-1].tolist()


def test_slot_mapping_minus_one_is_not_stored():
    loaded = load_model("random:tiny-llama", "cpu", "float32", seed=0)
    config = loaded.config
    kv_cache = allocate_kv_cache(config.kv_layout(16, torch.float32), 2)
    before = kv_cache.clone()
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([2], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([16, -1]), max_query_len=2, max_seq_len=2)
    loaded.model(torch.tensor([5, 6]), torch.tensor([0, 1]), kv_cache, metadata)
    for layer in range(config.num_layers):
        k_cache, v_cache = layer_views(kv_cache, layer)
        assert k_cache[1, 0].abs().sum() > 0 and v_cache[1, 0].abs().sum() > 0
        assert torch.equal(k_cache[1, 1:], before[1, layer, 0, 1:])
    assert torch.equal(kv_cache[0], before[0])


def test_triton_backend_matches_torch_backend():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 16
    seq_lens = [21, 5]
    q_lens = [6, 1]  # a prefill chunk after 15 cached tokens, and a decode
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
    block_tables = torch.tensor([[3, 0], [1, 0]], dtype=torch.int32, device=device)
    slots = [3 * 16 + p if p < 16 else 0 * 16 + p - 16 for p in range(15, 21)] + [1 * 16 + 4]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 6, 7], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables, slot_mapping=torch.tensor(slots, device=device),
        max_query_len=6, max_seq_len=21)
    start = torch.randn(4, 1, 2, block_size, num_kv_heads, head_dim, generator=gen)
    results = {}
    # "cudnn" sends this short step to the Triton kernel (and on the CPU it always does).
    for backend in ("torch", "triton", "cudnn"):
        cache = start.to(device, copy=True)  # every backend starts from the same context
        k_cache, v_cache = layer_views(cache, 0)
        attn = PagedAttention(num_heads, num_kv_heads, head_dim, backend=backend)
        results[backend] = (attn(query, key, value, k_cache, v_cache, metadata), cache)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(results["triton"][1], results["torch"][1])
    assert torch.equal(results["cudnn"][0], results["triton"][0])
    assert torch.equal(results["cudnn"][1], results["triton"][1])
    assert not torch.equal(results["torch"][1].cpu(), start), "new K/V must have been stored"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3"])
def test_random_model_on_cuda_matches_transformers(name, paged_batch):
    loaded = load_model(f"random:{name}", "cuda", "float32", seed=3, attn_backend="triton")
    hf_model = hf_twin(loaded).cuda()
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
                 for n in (40, 19)]
    batch = paged_batch(loaded.model, loaded.config, num_reqs=2, max_len=40, device="cuda")
    got = run_plans(batch, sequences, [[16, 20, 1, 1, 1, 1], [3, 15, 1]])
    for tokens, logits in zip(sequences, got):
        with torch.no_grad():
            expected = hf_model(torch.tensor([tokens], device="cuda")).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=2e-3, rtol=2e-3)


def test_select_backend(monkeypatch):
    assert select_backend("cpu", 16) == "torch"
    assert select_backend("cuda", 16) == ("cudnn" if cudnn_available() else "triton")
    assert select_backend("cuda:0", 16, "torch") == "torch"
    with pytest.raises(ValueError, match="cudnn attention backend needs a CUDA device"):
        select_backend("cpu", 16, "cudnn")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cpu", 16, "triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cpu", 256, "flash")
    with pytest.raises(ValueError, match="flash"):
        select_backend("cuda", 16, "flash")  # no flash-attn here, or a block size it can't page
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", 16, "sdpa")
    with pytest.raises(ValueError, match="unknown attention backend"):
        PagedAttention(4, 2, 16, backend="sdpa")


# ---- ModelConfig ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NAMED_CONFIGS))
def test_config_round_trips_through_transformers(name):
    config = named_config(name)
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("name", TINY)
def test_num_parameters_matches_transformers(name):
    config = named_config(name)
    hf_model = AutoModelForCausalLM.from_config(config.to_hf())
    assert config.num_parameters() == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-1b", "tiny-llama3", "tiny-mistral"])
def test_rope_frequencies_equal_transformers(name):
    config = named_config(name)
    hf_config = config.to_hf()
    rope_type = config.rope_scaling.rope_type
    expected, scaling = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](
        hf_config, torch.device("cpu"))
    assert scaling == 1.0
    got = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(got, expected)
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    assert not torch.equal(got, plain), "the scaling must change some frequencies"


def test_from_hf_reads_transformers_4_style_rope_fields():
    # transformers 4.x configs carry rope_theta and rope_scaling, no rope_parameters.
    old_style = types.SimpleNamespace(
        model_type="llama", vocab_size=100, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
        eos_token_id=[7, 9], bos_token_id=None)
    config = ModelConfig.from_hf(old_style)
    assert config.rope_theta == 500000.0 and config.head_dim == 8
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert config.eos_token_ids == (7, 9) and config.bos_token_id is None


def test_from_hf_rejects_other_architectures_and_rope_types():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    yarn = transformers.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 2048})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(yarn)


def test_sliding_window_caps_the_context():
    mistral = transformers.MistralConfig(sliding_window=4096, max_position_embeddings=32768)
    assert ModelConfig.from_hf(mistral).max_position_embeddings == 4096
    qwen2 = transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096,
                                     max_position_embeddings=32768)
    config = ModelConfig.from_hf(qwen2)
    assert config.max_position_embeddings == 32768 and config.attention_bias


def test_config_validation_and_kv_layout():
    config = named_config("llama3-8b")
    layout = config.kv_layout(16, torch.bfloat16)
    assert layout.block_shape == (32, 2, 16, 8, 128)
    assert layout.bytes_per_block == 2 * 1024 * 1024  # 2 MiB per 16-token block
    base = {"family": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 2}
    ModelConfig(**base)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig(**{**base, "num_layers": 0})
    with pytest.raises(ValueError, match="family"):
        ModelConfig(**{**base, "family": "gpt2"})
    with pytest.raises(ValueError, match="not supported"):
        RopeScaling("dynamic", 2.0)
    with pytest.raises(ValueError, match="unknown model config"):
        named_config("llama9-1t")


@pytest.mark.gpu
@pytest.mark.skipif(not cudnn_available(), reason="needs nvidia-cudnn-frontend and CUDA")
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2"])
def test_cudnn_backend_matches_triton_backend_in_half_precision(name, paged_batch,
                                                                monkeypatch):
    monkeypatch.setattr(cudnn_backend, "MIN_STEP_TOKENS", 512)  # small steps take cuDNN
    gen = torch.Generator().manual_seed(4)
    logits = {}
    for backend in ("triton", "cudnn"):
        loaded = load_model(f"random:{name}", "cuda", "float16", seed=3, attn_backend=backend)
        sequences = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
                     for n in (902, 522)]
        gen = torch.Generator().manual_seed(4)  # the same tokens for both backends
        # cuDNN reads the unwritten slots of a request's last block (masked): in the engine
        # they hold zeros or an earlier owner's K/V; here a large finite value.
        batch = paged_batch(loaded.model, loaded.config, num_reqs=2, max_len=904,
                            device="cuda", poison=1e4)
        # A 600-token chunk, then 300 batched with a 520-token prompt (both cuDNN), then
        # decodes (the Triton kernel).
        logits[backend] = run_plans(batch, sequences, [[600, 300, 1, 1], [0, 520, 1, 1]])
    for got, expected in zip(logits["cudnn"], logits["triton"]):
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not cudnn_available(), reason="needs nvidia-cudnn-frontend and CUDA")
def test_cudnn_engine_zeroes_the_blocks_a_step_starts(monkeypatch):
    # A pool whose every slot holds NaN, the worst an earlier owner could leave: the engine
    # zeroes each block before a step first writes it, so cuDNN's masked reads of the last
    # block's unwritten slots stay finite and the tokens are the Triton kernel's.
    monkeypatch.setattr(cudnn_backend, "MIN_STEP_TOKENS", 512)  # small steps take cuDNN
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (700, 530)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "cudnn"):
        loaded = load_model("random:tiny-llama3", "cuda", "float16", seed=3,
                            attn_backend=backend)
        with LLM(loaded, gpu_blocks=256, host_cache=False, disk_cache=False,
                 warmup=False) as llm:
            llm.runner.kv_cache.fill_(float("nan"))
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cudnn"] == tokens["triton"]
