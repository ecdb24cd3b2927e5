"""The deterministic mode: a token's logits are the same bits whatever its batch, its prompt's
chunking, and which part of its prefix came from a tier (CPU float32 and bf16, and the GPU
where there is one).

Every engine here records the float32 logits each request sampled from, keyed by (prompt,
output position); runs that differ only in how the work was cut must record equal tensors
(`torch.equal`, not a tolerance). The model is a seeded random-weight tiny Llama, whose flat
logits make any difference in rounding visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel, load_model
from kvtier.engine.outputs import RequestOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 6
BLOCK_SIZE = 4
Key = tuple[tuple[int, ...], int]


@pytest.fixture(scope="module", params=[
    ("cpu", "float32"), ("cpu", "bfloat16"),
    # The Triton kernels, CUDA graphs (decode rows, short chunks as rows) included.
    pytest.param(("cuda", "bfloat16"), marks=pytest.mark.gpu),
    pytest.param(("cuda", "float32"), marks=pytest.mark.gpu)], ids=lambda p: "-".join(p))
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    device, dtype = request.param
    return load_model("random:tiny-llama", device, dtype, seed=3)


def prompts_of(lengths: Sequence[int], seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Prompts of the given lengths (token ids 3..255), the first `shared` tokens common."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 256, (shared,), generator=generator).tolist()
    return [head + torch.randint(3, 256, (n - shared,), generator=generator).tolist()
            for n in lengths]


def run(model: LoadedModel, batches: Sequence[Sequence[list[int]]],
        **options) -> tuple[dict[Key, torch.Tensor], list[RequestOutput]]:
    """Generate each batch in turn on one deterministic engine; returns the logits every
    request sampled from by (prompt, output position), and the outputs."""
    options = {"block_size": BLOCK_SIZE, "max_num_seqs": 8, "host_cache": False,
               "disk_cache": False, "deterministic": True, "warmup": False, **options}
    logits: dict[Key, torch.Tensor] = {}
    outputs: list[RequestOutput] = []
    with LLM(model, **options) as llm:
        sample = llm.runner.sample_fn

        def recording(rows: torch.Tensor, requests) -> torch.Tensor:
            for row, request in zip(rows, requests):
                key = (tuple(request.prompt_token_ids), len(request.output_token_ids))
                logits[key] = row.clone()
            return sample(rows, requests)

        llm.runner.sample_fn = recording
        for batch in batches:
            outputs += llm.generate([{"prompt_token_ids": p} for p in batch],
                                    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return logits, outputs


def assert_same_logits(a: dict[Key, torch.Tensor], b: dict[Key, torch.Tensor]) -> None:
    common = a.keys() & b.keys()
    assert common, "the runs share no sampled position"
    for key in sorted(common):
        assert torch.equal(a[key], b[key]), \
            f"logits differ at output {key[1]} of a {len(key[0])}-token prompt: max " \
            f"{(a[key] - b[key]).abs().max().item():.3g}"


def test_batch_composition_does_not_change_a_token(tiny: LoadedModel) -> None:
    prompts = prompts_of([37, 52, 9, 70])
    alone, _ = run(tiny, [[p] for p in prompts])
    together, _ = run(tiny, [prompts])
    pairs, _ = run(tiny, [prompts[2:], prompts[:2]], max_num_seqs=2)
    assert len(alone) == len(prompts) * MAX_TOKENS
    assert_same_logits(alone, together)
    assert_same_logits(alone, pairs)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunk_size_does_not_change_a_token(tiny: LoadedModel, budget: int) -> None:
    prompts = prompts_of([45, 61, 20], seed=1)
    whole, _ = run(tiny, [prompts], max_num_batched_tokens=512)
    chunked, _ = run(tiny, [prompts], max_num_batched_tokens=budget)
    assert_same_logits(whole, chunked)


def test_prefix_restored_from_host_or_computed_gives_the_same_tokens(tiny: LoadedModel) -> None:
    # Three prompts on one 44-token document. With a 40-block pool (160 tokens) the first
    # prompts' blocks leave the GPU for the host; the last prompt then takes the document
    # back from the host while it is computed cold in the reference run.
    prompts = prompts_of([60, 64, 58, 66], seed=2, shared=44)
    cold, cold_out = run(tiny, [[p] for p in prompts], gpu_blocks=400)
    reference = {k: v for k, v in cold.items() if k[0] == tuple(prompts[-1])}
    filler = prompts_of([150], seed=5)
    warm, warm_out = run(tiny, [[prompts[0]], filler, [prompts[-1]]], gpu_blocks=48,
                         host_cache=True, host_cache_gb=0.01)
    assert warm_out[-1].metrics.cached_tokens_host > 0, "the document was not restored"
    assert_same_logits(reference, warm)
    assert warm_out[-1].outputs[0].token_ids == cold_out[-1].outputs[0].token_ids


@pytest.mark.parametrize("budget", [8, 512])
def test_prefix_restored_from_disk_gives_the_same_tokens(tiny: LoadedModel, tmp_path: Path,
                                                         budget: int) -> None:
    # A first engine writes its blocks through to disk (closing flushes them); a second
    # engine restores the shared document from that disk while its compute front runs from
    # the head (in chunks of `budget` tokens), then the same prompt again with the prefix
    # on its GPU.
    prompts = prompts_of([64, 72], seed=4, shared=48)
    cold, _ = run(tiny, [[p] for p in prompts], gpu_blocks=400)
    disk = {"host_cache": True, "disk_cache": True, "disk_cache_dir": tmp_path / "kv",
            "restore_min_saving_s": 0.0, "gpu_blocks": 400, "max_num_batched_tokens": budget}
    run(tiny, [[prompts[0]]], **disk)
    warm, outputs = run(tiny, [[prompts[1]], [prompts[1]]], **disk)
    assert outputs[0].metrics.cached_tokens_disk > 0, "nothing came from the disk"
    assert outputs[1].metrics.cached_tokens_gpu > 0
    assert_same_logits(cold, warm)


def test_prefix_restored_from_the_remote_tier_gives_the_same_tokens(
        tiny: LoadedModel, tmp_path: Path, redis_server) -> None:
    # Engine A computes a prompt and writes its blocks to Redis (closing flushes them);
    # engine B, with empty GPU and host tiers and no disk, takes the shared document from
    # Redis while it computes the rest.
    from kvtier.tiers.remote.config import RemoteConfig

    if tiny.model.attn_backend != "torch":
        pytest.skip("the remote tier's test server runs beside the CPU tests")
    prompts = prompts_of([64, 72], seed=7, shared=48)
    cold, _ = run(tiny, [[p] for p in prompts], gpu_blocks=400)
    shared = {"host_cache": True, "restore_min_saving_s": 0.0, "gpu_blocks": 400,
              "remote_cache": RemoteConfig(redis_server.url, key_prefix=f"det{id(tmp_path)}")}
    run(tiny, [[prompts[0]]], **shared)
    warm, outputs = run(tiny, [[prompts[1]]], **shared)
    assert outputs[0].metrics.cached_tokens_remote > 0, "nothing came from the remote tier"
    assert_same_logits(cold, warm)


def test_default_mode_is_unchanged_by_the_switch(tiny: LoadedModel) -> None:
    # Turning the mode on and off again restores the default kernels exactly.
    prompts = prompts_of([30, 41], seed=6)
    first, _ = run(tiny, [prompts], deterministic=False)
    run(tiny, [prompts])
    again, _ = run(tiny, [prompts], deterministic=False)
    assert_same_logits(first, again)
    assert not tiny.model.deterministic


def test_the_mode_is_set_by_keyword_variable_or_file(tmp_path: Path) -> None:
    from kvtier.engine.config_sources import load_engine_config

    assert not load_engine_config({}, environ={}).deterministic
    assert load_engine_config({}, environ={"KVTIER_DETERMINISTIC": "1"}).deterministic
    assert not load_engine_config({"deterministic": False},
                                  environ={"KVTIER_DETERMINISTIC": "true"}).deterministic
    settings = tmp_path / "kvtier.yaml"
    settings.write_text("deterministic: true\n")
    assert load_engine_config({}, settings, environ={}).deterministic
    with pytest.raises(ValueError, match="deterministic"):
        load_engine_config({}, environ={"KVTIER_DETERMINISTIC": "sometimes"})
