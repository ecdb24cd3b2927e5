"""ModelRunner: zeroing the blocks a step starts (what the cudnn backend's masked reads of a
request's last block rely on), on the CPU with the torch backend."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from kvtier.engine.loader import load_model
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.step_plan import ScheduledRequest

from kvtier.device_cache import allocate_kv_cache
from kvtier.free_queue import KVCacheBlock


def scheduled(block_ids: list[int], token_ids: list[int], start: int,
              num_new_tokens: int) -> ScheduledRequest:
    request = SimpleNamespace(request_id="r", token_ids=token_ids,
                              block_table=[KVCacheBlock(b) for b in block_ids])
    return ScheduledRequest(request, start, num_new_tokens, True)  # type: ignore[arg-type]


def test_a_step_zeroes_the_blocks_it_starts_and_nothing_else() -> None:
    loaded = load_model("random:tiny-llama", "cpu", "float32", attn_backend="torch", seed=1)
    block_size = 16
    cache = allocate_kv_cache(loaded.config.kv_layout(block_size, torch.float32), 8, "cpu")
    cache.fill_(float("nan"))  # what earlier owners left, at worst
    runner = ModelRunner(loaded.model, cache, block_size, sample_fn=lambda logits, reqs:
                         logits.argmax(-1), zero_started_blocks=True)
    tokens = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # Request blocks 5, 2, 6: a 20-token chunk starts blocks 5 and 2 ...
    runner.execute([scheduled([5, 2, 6], tokens, 0, 20)])
    assert not cache[[5, 2]].isnan().any(), "started blocks hold finite values"
    assert (cache[2, :, :, 4:] == 0).all(), "their unwritten slots are zero"
    assert cache[[0, 1, 3, 4, 6, 7]].isnan().all(), "no other block was touched"
    written = cache[2, :, :, :4].clone()
    # ... a chunk continuing inside block 2 starts nothing (its K/V stay), then block 6.
    runner.execute([scheduled([5, 2, 6], tokens, 20, 10)])
    assert torch.equal(cache[2, :, :, :4], written)
    assert cache[6].isnan().all()
    runner.execute([scheduled([5, 2, 6], tokens, 30, 3)])
    assert not cache[6].isnan().any() and (cache[6, :, :, 1:] == 0).all()


def test_by_default_only_the_cudnn_backend_zeroes_blocks() -> None:
    loaded = load_model("random:tiny-llama", "cpu", "float32", attn_backend="torch", seed=1)
    cache = allocate_kv_cache(loaded.config.kv_layout(16, torch.float32), 4, "cpu")
    assert not ModelRunner(loaded.model, cache, 16, sample_fn=None)._zero_started
    loaded.model.attn_backend = "cudnn"
    assert ModelRunner(loaded.model, cache, 16, sample_fn=None)._zero_started


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_work_runs_in_turns_while_the_gpu_computes_the_sampled_ids() -> None:
    loaded = load_model("random:tiny-llama", "cuda", "float32", seed=1)
    cache = allocate_kv_cache(loaded.config.kv_layout(16, torch.float32), 8, "cuda")
    runner = ModelRunner(loaded.model, cache, 16, sample_fn=lambda logits, reqs:
                         logits.argmax(-1))
    tokens = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    [expected] = runner.execute([scheduled([1, 2, 3], tokens, 0, 40)])
    calls = {"waiting": 0, "blocked": 0}

    def blocked() -> None:
        assert calls["waiting"] == 1, "the one-off host work comes first"
        calls["blocked"] += 1
        time.sleep(0.001)

    torch.cuda._sleep(1_000_000_000)  # the GPU is busy for a while before the step
    [token] = runner.execute([scheduled([4, 5, 6], tokens, 0, 40)],
                             lambda: calls.__setitem__("waiting", calls["waiting"] + 1),
                             blocked)
    assert token == expected and calls["waiting"] == 1 and calls["blocked"] > 1
