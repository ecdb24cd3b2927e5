"""The NCCL handoff between two GPUs: `kvtier serve --role prefill` on cuda:0 hands prompts
to `kvtier serve --role decode` on cuda:1 over NCCL, every block a group of its own and
three sends awaiting their commits, several handoffs at once. The decode instance answers
with the tokens of one engine that computed everything, bit for bit: both run the
deterministic mode, in float32, on a random model of Llama 3.2 1B's shape (1 MiB blocks).
A commit lost on its way then breaks the pair: it forms again, and a handoff over it lands.

Needs two CUDA devices (the device tool's multi-GPU machines); skipped elsewhere.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch
from kvtier.cli.bench.cluster import Process, free_port, launch, wait_healthy
from kvtier.engine import LLM, SamplingParams

from tests.cli.handoff_proxy import EndingProxy
from tests.cli.serve_harness import at_once, parse_metrics, wait_for_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices")]

MODEL = "random:llama3-1b"
ENGINE = ["--dtype", "float32", "--deterministic", "--max-model-len", "2048",
          "--no-host-cache", "--no-disk-cache", "--handoff-mooncake", "off"]
MAX_TOKENS = 8
BS = 16


def _prompts() -> list[list[int]]:
    """Three handed over at once, one whose commit is lost, one after the pair formed
    again."""
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1000, 30000, (n,), generator=generator).tolist()
            for n in (300, 517, 130, 200, 260)]


def _hand_over(prefill: Process, decode_url: str, model: str, prompt: list[int]
               ) -> httpx.Response:
    return httpx.post(f"{prefill.url}/v1/handoff/prefill", json={
        "endpoint": "/v1/completions",
        "request": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0},
        "decode": decode_url, "transport": "nccl", "timeout_s": 120}, timeout=300)


def _pair_generation(instance: Process) -> float:
    """`instance`'s pair generation once it is ready (waits up to 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = parse_metrics(httpx.get(f"{instance.url}/metrics").text)
        if metrics.get("kvtier_handoff_pair_ready") == 1:
            return metrics["kvtier_handoff_pair_generation"]
        time.sleep(0.2)
    raise AssertionError(f"the NCCL pair of {instance.name} is not ready")


def test_prompts_handed_over_between_two_gpus_give_the_colocated_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels compile at their first launch rather than in a warm-up of every shape: the
    # test then starts in seconds (the handoffs' timeout covers the compiles).
    monkeypatch.setenv("KVTIER_WARMUP", "0")
    nccl = ["--handoff-nccl", f"tcp://127.0.0.1:{free_port()}"]
    decode = launch("decode", ["serve", MODEL, "--device", "cuda:1", "--role", "decode",
                               *ENGINE, *nccl], tmp_path, num_threads=None)
    prefill = launch("prefill", ["serve", MODEL, "--device", "cuda:0", "--role", "prefill",
                                 *ENGINE, *nccl, "--handoff-nccl-group-mib", "1",
                                 "--handoff-nccl-in-flight", "3"], tmp_path, num_threads=None)
    prompts = _prompts()
    answers: list[tuple[list[int], int]] = []
    try:
        wait_healthy([decode, prefill], 600)
        wait_for_pair(prefill.url, 120)  # it forms in the background
        model = httpx.get(f"{decode.url}/v1/models").json()["data"][0]["id"]
        handed = at_once([partial(_hand_over, prefill, decode.url, model, prompt)
                          for prompt in prompts[:3]], 300)
        before = _pair_generation(prefill)
        with EndingProxy(decode.url, end_at=1, lose=True) as proxy:
            lost = _hand_over(prefill, proxy.url, model, prompts[3])
        assert lost.status_code == 502, lost.text
        # The prefill instance found the send never committed before it answered: both
        # instances end the broken generation (NCCL aborts its posted sends) and form the
        # next, the prefill's ready only once the decode's has joined.
        assert _pair_generation(prefill) == _pair_generation(decode) == before + 1
        handed.append(_hand_over(prefill, decode.url, model, prompts[4]))
        prompts = prompts[:3] + prompts[4:]
        for k, prompt in enumerate(prompts):
            assert handed[k].status_code == 200, handed[k].text
            result = handed[k].json()
            num_full = len(prompt) // BS
            assert (result["blocks_sent"], result["groups"]) == (num_full, num_full)
            answer = httpx.post(f"{decode.url}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}, timeout=300).json()
            answers.append((answer["choices"][0]["token_ids"],
                            answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
    finally:
        for process in (prefill, decode):
            process.stop()
    # The servers are gone: cuda:0 has room for the engine that computes everything.
    with LLM(MODEL, device="cuda:0", dtype="float32", deterministic=True, max_model_len=2048,
             host_cache=False, disk_cache=False) as colocated:
        outputs = colocated.generate([{"prompt_token_ids": p} for p in prompts],
                                     SamplingParams(max_tokens=MAX_TOKENS))
    for prompt, (tokens, cached), output in zip(prompts, answers, outputs):
        assert tokens == list(output.outputs[0].token_ids)
        assert cached == (len(prompt) - 1) // BS * BS  # handed over, none computed again
