"""Warm-up at engine start (engine.warmup).

CPU: the warm-up steps fit the engine's limits and write nothing into the KV cache; the Triton
cache directory goes under the user cache directory unless TRITON_CACHE_DIR is set; an engine
with a disk tier times one prefill at start, which its first restore is weighed with.
GPU: after warm-up, serving prompts of every shape class compiles no new kernel variant, and
the engine's tokens equal those of an engine that skipped warm-up.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.config import named_config
from kvtier.engine.loader import LoadedModel, build_model, init_random_weights, load_model
from kvtier.engine.restore_rates import PrefillRate
from kvtier.engine.warmup import (
    run_steps,
    time_cpu_prefill,
    use_user_triton_cache,
    warmup_steps,
)
from kvtier.kernels import cudnn_backend
from kvtier.kernels.cudnn_backend import cudnn_available

from kvtier.device_cache import allocate_kv_cache


@pytest.mark.parametrize("cudnn_min_tokens", [None, 512, 2048])
@pytest.mark.parametrize(("budget", "max_num_seqs", "max_model_len"),
                         [(2048, 64, 131072), (256, 1, 1024), (8, 2, 40), (8192, 256, 4096)])
def test_steps_fit_the_engine_limits(budget: int, max_num_seqs: int, max_model_len: int,
                                     cudnn_min_tokens: int | None) -> None:
    steps = warmup_steps(budget, max_num_seqs, max_model_len, cudnn_min_tokens)
    names = [s.name for s in steps]
    below = [s for s in steps if s.name == "prefill below cuDNN"]
    # Where cuDNN takes the full budget, Triton's one-pass prefill is warmed just below it.
    takes_full = cudnn_min_tokens is not None and steps[0].q_lens[0] >= cudnn_min_tokens
    assert len(below) == takes_full
    if takes_full:
        assert below[0].q_lens == below[0].seq_lens == (cudnn_min_tokens - 1,)
    names = [n for n in names if n != "prefill below cuDNN"]
    assert names[:4] == ["prefill", "long prefix", "decode", "long decode"]
    assert ("mixed" in names) == ("mixed, short contexts" in names) == (max_num_seqs > 1)
    assert ("mid-sized prefill" in names) == (steps[0].q_lens[0] > 512)
    for step in steps:
        assert 0 < sum(step.q_lens) <= budget, step
        assert len(step.q_lens) <= max_num_seqs, step
        assert all(0 < q <= s < max_model_len for q, s in zip(step.q_lens, step.seq_lens))
    # The first step is a prompt of the full step budget (allocator and GEMM shapes).
    assert steps[0].q_lens == (min(budget, max_model_len - 1),)


def test_steps_write_nothing_into_the_cache() -> None:
    loaded = load_model("random:tiny-llama", "cpu", "float32")
    layout = loaded.config.kv_layout(16, torch.float32)
    kv_cache = allocate_kv_cache(layout, 8, "cpu")
    kv_cache.normal_(generator=torch.Generator().manual_seed(0))
    before = kv_cache.clone()
    run_steps(loaded.model, kv_cache, 16, warmup_steps(64, 4, 1024))
    assert torch.equal(kv_cache, before)


def test_triton_cache_goes_under_the_user_cache_dir(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "kvtier"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = use_user_triton_cache()
    assert path == tmp_path / "kvtier" / "triton"
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o700
    assert os.environ["TRITON_CACHE_DIR"] == str(path)
    # A cache directory that cannot be created leaves Triton's default (no error).
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    assert use_user_triton_cache() is None
    assert "TRITON_CACHE_DIR" not in os.environ
    # A directory the user chose wins.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_user_triton_cache() == tmp_path / "mine"
    assert not (tmp_path / "mine").exists()


def test_cpu_engine_skips_warmup() -> None:
    with LLM("random:tiny-llama", device="cpu", gpu_blocks=8, host_cache=False,
             disk_cache=False) as llm:
        assert llm.warmup_report is None
        assert llm.scheduler.gate.start_rate.tokens_per_s is None  # no slow tier to weigh


@pytest.mark.parametrize(("budget", "max_model_len", "timed"),
                         [(2048, 4096, 128), (64, 4096, 64), (2048, 40, 39)])
def test_the_cpu_start_up_prefill_fits_the_engine_limits(budget: int, max_model_len: int,
                                                         timed: int) -> None:
    loaded = load_model("random:tiny-llama", "cpu", "float32")
    kv_cache = allocate_kv_cache(loaded.config.kv_layout(16, torch.float32), 4, "cpu")
    before = kv_cache.clone()
    [(num_tokens, num_keys, seconds)] = time_cpu_prefill(loaded.model, kv_cache, 16, budget,
                                                         max_model_len)
    assert num_tokens == timed and num_keys == timed * (timed + 1) // 2 and seconds > 0
    assert torch.equal(kv_cache, before)  # it stores nothing


def test_a_fresh_cpu_engine_weighs_its_first_disk_restore_with_a_timed_prefill(
        tmp_path: Path) -> None:
    """Nothing is compiled on the CPU, but with a disk tier the engine times one short
    prefill at start: a fresh engine over a disk that holds a short prompt computes it, as
    reading would save less than the gate's margin, and gives the same tokens. Without the
    timing (warm-up off) the rate is unknown and the same engine reads the prompt."""
    prompt = [3 + i % 250 for i in range(96)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    options = {"device": "cpu", "gpu_blocks": 16, "disk_cache_dir": tmp_path}
    with LLM("random:tiny-llama", **options) as llm:
        first = llm.generate([prompt], params)[0]
    with LLM("random:tiny-llama", **options) as llm:
        assert llm.warmup_report is None and llm.scheduler.gate.start_rate.tokens_per_s > 0
        # ... which sizes no restore: the prefill rate waits for a step of the engine's.
        assert llm.scheduler.prefill_rate.tokens_per_s is None
        computed = llm.generate([prompt], params)[0]
        assert llm.restore_counts().turned_away == 1
    with LLM("random:tiny-llama", warmup=False, **options) as llm:
        assert llm.scheduler.gate.start_rate.tokens_per_s is None
        read = llm.generate([prompt], params)[0]
    assert computed.metrics.cached_tokens_disk == 0
    assert read.metrics.cached_tokens_disk > 0
    assert computed.outputs[0].token_ids == read.outputs[0].token_ids \
        == first.outputs[0].token_ids


# --- GPU ----------------------------------------------------------------------------------


def _compiled_variants() -> dict[str, int]:
    """Compiled specialisations of every engine kernel in this process."""
    import kvtier.kernels  # noqa: F401 - loads every kernel module

    counts = {}
    for name in ("copy_blocks", "layer_ops", "paged_attention", "paged_decode", "store_kv"):
        # (kvtier.kernels re-exports launchers under some of these module names)
        module = sys.modules[f"kvtier.kernels.{name}"]
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if name.endswith("_kernel") and caches is not None:
                counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


@pytest.fixture(scope="module", params=["triton", "cudnn"])
def long_context_model(request: pytest.FixtureRequest) -> LoadedModel:
    """tiny-llama with a 4096-token context, so split-KV steps are reachable, on each GPU
    attention backend."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if request.param == "cudnn" and not cudnn_available():
        pytest.skip("needs nvidia-cudnn-frontend and cuDNN >= 9.6")
    config = dataclasses.replace(named_config("tiny-llama"), max_position_embeddings=4096)
    model = build_model(config, torch.device("cuda"), torch.bfloat16, request.param)
    init_random_weights(model, 0)
    return LoadedModel(model, None, config, f"tiny-llama-4k@seed=0:bf16:cuda:{request.param}")


def _serve(llm: LLM, prefix: list[int]) -> list[tuple[int, ...]]:
    """Every shape class: fresh prompts of many lengths batched with decodes, 16 requests
    at once, chunked prompts, and short questions after a long cached prefix."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist()
               for n in (1, 5, 16, 17, 37, 64, 300, 700, 1000, 2100)]
    prompts += [torch.randint(3, 256, (9,), generator=gen).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    llm.generate([prefix], params)
    outputs += llm.generate([prefix + [5, 6, 7, 8], prefix + list(range(20, 60))], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_warmup_serving_compiles_nothing(long_context_model: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN takes steps from 256 tokens here (2,048 by default), so full 512-token steps go
    # to it while shorter prompts, and steps of more than 16 requests, stay on Triton.
    monkeypatch.setattr(cudnn_backend, "MIN_STEP_TOKENS", 256)
    prefix = torch.randint(3, 256, (3000,), generator=torch.Generator().manual_seed(2))
    options = {"gpu_blocks": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 512,
               "host_cache": False, "disk_cache": False}
    # The warmed engine runs first: nothing in this process has compiled its shapes yet.
    with LLM(long_context_model, **options) as llm:
        report = llm.warmup_report
        assert report is not None and report.seconds > 0
        assert "long decode" in report.steps and report.num_graphs == 5
        # The timed prefill seeds the rate that sizes the first restore's fronts.
        assert report.prefill_tokens_per_s is not None and report.prefill_tokens_per_s > 0
        expected = PrefillRate()  # the engine's rate is what the timed steps teach
        for num_tokens, num_keys, seconds in report.prefill_steps:
            expected.observe(num_tokens, seconds, num_keys)
        rate = llm.scheduler.prefill_rate
        assert (rate.per_token_s, rate.per_key_s) == (expected.per_token_s, expected.per_key_s)
        assert len(report.prefill_steps) == 2  # with and without a context
        compiled = _compiled_variants()
        assert compiled.get("_paged_attention_kernel", 0) >= 4  # (decode, prefill) x split
        cudnn = long_context_model.model.attn_backend == "cudnn"
        assert (report.num_attention_graphs == 5) == cudnn  # 1, 2, 4, 8, 16 requests
        graphs = cudnn_backend._PREFILL.num_graphs
        tokens = _serve(llm, prefix.tolist())
        assert _compiled_variants() == compiled, "a request compiled a new kernel variant"
        assert cudnn_backend._PREFILL.num_graphs == graphs, "a request built a cuDNN graph"
    with LLM(long_context_model, warmup=False, **options) as llm:
        assert llm.warmup_report is None
        expected = _serve(llm, prefix.tolist())
    assert tokens == expected
