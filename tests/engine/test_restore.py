"""Restores must never change an answer: SmolLM2 greedy outputs equal transformers' while
blocks come back from the GPU pool after a preemption, from the host tier, from a tiny host
tier backed by the disk tier, and from a warm disk tier in a second process.

Every scenario asserts that the path it is about was taken (preemptions, host or disk
tokens in the request metrics), not only that the answers are right.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from kvtier.engine import LLM, SamplingParams, sizing
from kvtier.engine.loader import LoadedModel, converted_model_dir

from kvtier.config import TierConfig
from kvtier.stats import Direction, Tier

MAX_TOKENS = 6
REPO_ROOT = Path(__file__).resolve().parents[2]

_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "iris",
          "juniper", "kelp", "lagoon", "meadow", "nectar", "orchard", "pebble", "quartz",
          "river", "saffron", "tundra", "umber", "valley", "willow", "yarrow", "zephyr")


def document(seed: int, num_sentences: int) -> str:
    """Invented sentences, different for every seed and sentence."""
    sentences = []
    for i in range(num_sentences):
        a, b, c = (_WORDS[(seed * 7 + i * k) % len(_WORDS)] for k in (1, 3, 5))
        sentences.append(f"In year {1900 + seed * 50 + i}, the {a} path led past the {b} "
                         f"stones toward a {c} shore.")
    return " ".join(sentences)


def hf_greedy(hf_model, prompt_token_ids) -> list[int]:
    input_ids = torch.tensor([list(prompt_token_ids)])
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, input_ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2: LoadedModel) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(converted_model_dir()), dtype=torch.float32, local_files_only=True).eval()


@pytest.fixture(scope="module")
def block_prompts(smollm2: LoadedModel, smollm2_hf) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of exactly 20 blocks (320 tokens), and their reference outputs."""
    prompts = [smollm2.tokenizer.encode(document(seed, 15))[:320] for seed in (1, 2, 3)]
    assert all(len(p) == 320 for p in prompts)
    return prompts, [hf_greedy(smollm2_hf, p) for p in prompts]


def test_preempted_request_resumes_from_gpu_and_host(smollm2, block_prompts) -> None:
    prompts, references = block_prompts
    params = SamplingParams(max_tokens=MAX_TOKENS)
    # 61 blocks: the three prompts fill 60. Their first decodes each need a 21st block: a
    # takes the free one, then c (the newest) is preempted so that b can have one of its
    # blocks. c comes back with 19 blocks still cached on the GPU and 1 from the host.
    with LLM(smollm2, gpu_blocks=61, host_cache_gb=0.1, disk_cache=False) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.stats()
    for output, reference in zip(outputs, references):
        assert list(output.outputs[0].token_ids) == reference
    a, b, c = (o.metrics for o in outputs)
    assert a.num_preemptions == b.num_preemptions == 0
    assert c.num_preemptions == 1
    assert c.cached_tokens_gpu == 19 * 16 and c.cached_tokens_host == 16
    # Nothing was recomputed: every computed block came back from the GPU or the host.
    assert c.computed_tokens == a.computed_tokens == 320 + MAX_TOKENS - 1
    assert stats.transfers[Direction.HOST_TO_GPU].num_bytes == llm.layout.bytes_per_block


def test_tiny_host_tier_spills_to_disk_and_restores_from_it(smollm2, block_prompts,
                                                            tmp_path: Path) -> None:
    prompts, references = block_prompts
    params = SamplingParams(max_tokens=MAX_TOKENS)
    bytes_per_block = smollm2.config.kv_layout(16, torch.float32).bytes_per_block
    # 8 host slots and 30 GPU blocks: one prompt at a time fits on the GPU, and the host
    # keeps only the latest blocks; the rest is written back to disk before it is evicted.
    with LLM(smollm2, gpu_blocks=30, host_cache_gb=8 * bytes_per_block / 2**30,
             disk_cache_dir=tmp_path / "kv", max_num_batched_tokens=128) as llm:
        first = [llm.generate([p], params)[0] for p in prompts]
        again = llm.generate([prompts[0]], params)[0]
        stats = llm.stats()
    for output, reference in zip([*first, again], [*references, references[0]]):
        assert list(output.outputs[0].token_ids) == reference
    assert all(o.metrics.cached_tokens == 0 for o in first)
    # The first prompt's blocks left the GPU and the host; its prefix was found on disk and
    # read back from the tail while its head was computed. With 8 host slots to stage
    # through, the disk gives a few blocks per step: where the fronts meet is the restore's
    # business (tests/engine/test_bidirectional_restore.py pins the meeting points down).
    assert stats.tiers[Tier.DISK].hits > 0


def test_restores_from_a_directory_tier_alone(smollm2, block_prompts, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory tier (kvtier.tiers.directory) as the only tier below the GPU: blocks go
    through the staging slab into its files, and come back out of them, token for token."""
    prompts, references = block_prompts
    params = SamplingParams(max_tokens=MAX_TOKENS)
    tier_config = sizing.tier_config

    def with_directory(*args) -> TierConfig:
        config = tier_config(*args)
        assert config.disk_path is None and config.remote is None and not config.host_enabled
        return TierConfig(**{**config.model_dump(), "directory_path": tmp_path / "blocks"})

    monkeypatch.setattr(sizing, "tier_config", with_directory)
    # 30 GPU blocks: one prompt at a time; the first prompt's blocks are gone from the GPU
    # when it comes again, and only the directory holds them.
    with LLM(smollm2, gpu_blocks=30, host_cache=False, disk_cache=False,
             max_num_batched_tokens=128) as llm:
        assert [tier.name for tier in llm.manager.lower_tiers] == ["directory"]
        first = [llm.generate([p], params)[0] for p in prompts]
        llm.manager.flush()
        again = llm.generate([prompts[0]], params)[0]
        stats = llm.stats()
    for output, reference in zip([*first, again], [*references, references[0]]):
        assert list(output.outputs[0].token_ids) == reference
    assert stats.tiers[Tier.DISK].hits > 0 and again.metrics.cached_tokens_disk > 0
    assert stats.tiers[Tier.DISK].failures == 0


def test_second_process_restores_from_the_warm_disk_tier(smollm2, smollm2_hf,
                                                         kvtier_cache_dir: Path,
                                                         tmp_path: Path) -> None:
    disk_dir = tmp_path / "kv"
    texts = [document(4, 95), "Summarize: " + document(5, 12)]  # ~2,100 and ~300 tokens
    params = SamplingParams(max_tokens=MAX_TOKENS)
    with LLM(smollm2, gpu_blocks=200, host_cache_gb=0.25, disk_cache_dir=disk_dir) as llm:
        warm = llm.generate(texts, params)
    # close() flushed every host block to disk.
    assert len(warm[0].prompt_token_ids) > 2000
    references = [hf_greedy(smollm2_hf, o.prompt_token_ids) for o in warm]
    for output, reference in zip(warm, references):
        assert list(output.outputs[0].token_ids) == reference

    prompt_file = tmp_path / "prompts.json"
    prompt_file.write_text(json.dumps(texts))
    env = dict(os.environ, KVTIER_CACHE_DIR=str(kvtier_cache_dir))
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "generate", "--prompt-file", str(prompt_file),
         "--device", "cpu", "--dtype", "float32", "--max-tokens", str(MAX_TOKENS),
         "--gpu-blocks", "200", "--host-cache-gb", "0.25", "--disk-cache", str(disk_dir),
         "--raw", "--json"],  # raw prompts, as LLM.generate sends them
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["model"] == smollm2.model_id
    for entry, output, reference in zip(report["outputs"], warm, references):
        assert entry["prompt_token_ids"] == list(output.prompt_token_ids)
        assert entry["outputs"][0]["token_ids"] == reference
        # Every full prompt block came from disk or was computed (the two fronts of the
        # restore met where the disk and the CPU's compute put them); nothing came from the
        # (new, empty) GPU pool or host tier. tests/engine/test_bidirectional_restore.py
        # pins the meeting points down.
        num_full = (len(output.prompt_token_ids) - 1) // 16
        cached = entry["cached_tokens"]
        assert cached["gpu"] == cached["host"] == 0
        assert cached["disk"] % 16 == 0 and cached["disk"] <= num_full * 16
        assert entry["computed_tokens"] == len(output.prompt_token_ids) - cached["disk"] \
            + MAX_TOKENS - 1
