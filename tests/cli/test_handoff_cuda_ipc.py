"""The CUDA IPC handoff: `kvtier serve --role prefill` on cuda:0 hands prompts to `kvtier
serve --role decode` on the last GPU (cuda:1 on a two-GPU machine, the same GPU on one)
through copy engines, in float32 in the deterministic mode on a random model of Llama 3.2
1B's shape (1 MiB blocks), so the decode instance answers with the tokens of one engine
that computed everything, bit for bit.

- A 16 MiB receive buffer lends a handoff 4 rows: two turns of two blocks, so a prompt is
  many sends whose rows are written again after each commit.
- Handoffs one after another and three at once each land where they belong.
- A commit lost on its way fails that handoff (502) and gives its rows back: the next
  handoff lands.
- With two GPUs and CUDA IPC on by default, a buffer too small for every handoff at once
  makes the ones it refuses go over NCCL instead, and every prompt still lands.

Needs a CUDA device (two for the last case); skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch
from kvtier.cli.bench.cluster import Process, free_port, launch, wait_healthy
from kvtier.engine import LLM, SamplingParams

from tests.cli.handoff_proxy import EndingProxy
from tests.cli.serve_harness import at_once, parse_metrics, wait_for_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]

MODEL = "random:llama3-1b"
ENGINE = ["--dtype", "float32", "--deterministic", "--max-model-len", "2048",
          "--no-host-cache", "--no-disk-cache", "--handoff-mooncake", "off",
          "--gpu-memory-utilization", "0.3"]
MAX_TOKENS = 8
BS = 16


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 30000, (n,), generator=generator).tolist() for n in lengths]


def _hand_over(prefill: Process, decode_url: str, model: str, prompt: list[int],
               transport: str | None = "cuda_ipc") -> httpx.Response:
    return httpx.post(f"{prefill.url}/v1/handoff/prefill", json={
        "endpoint": "/v1/completions",
        "request": {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0},
        "decode": decode_url, "transport": transport, "timeout_s": 120}, timeout=300)


def _decode(decode: Process, model: str, prompt: list[int]) -> tuple[list[int], int]:
    answer = httpx.post(f"{decode.url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True}, timeout=300).json()
    return (answer["choices"][0]["token_ids"],
            answer["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture
def no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels compile at their first launch rather than in a warm-up of every shape: the
    # instances start in seconds (the handoffs' timeout covers the compiles).
    monkeypatch.setenv("KVTIER_WARMUP", "0")


@pytest.fixture
def colocated_tokens() -> Iterator:
    """A function giving the tokens of one engine that computed every prompt (run once
    the instances are gone, so that their GPU memory is free)."""
    def tokens(prompts: list[list[int]]) -> list[list[int]]:
        with LLM(MODEL, device="cuda:0", dtype="float32", deterministic=True,
                 max_model_len=2048, host_cache=False, disk_cache=False) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(max_tokens=MAX_TOKENS))
        return [list(output.outputs[0].token_ids) for output in outputs]

    yield tokens


def test_prompts_handed_over_through_cuda_ipc_give_the_colocated_tokens(
        tmp_path: Path, no_warmup: None, colocated_tokens) -> None:
    last = f"cuda:{torch.cuda.device_count() - 1}"
    ipc = ["--handoff-cuda-ipc", "on", "--handoff-cuda-ipc-mib", "16"]
    decode = launch("decode", ["serve", MODEL, "--device", last, "--role", "decode",
                               *ENGINE, *ipc], tmp_path, num_threads=None)
    prefill = launch("prefill", ["serve", MODEL, "--device", "cuda:0", "--role", "prefill",
                                 *ENGINE, *ipc], tmp_path, num_threads=None)
    one_by_one = _prompts([300, 517, 130], seed=5)
    together = _prompts([200, 260, 333], seed=6)
    after_loss = _prompts([280], seed=7)
    answers: list[tuple[list[int], int]] = []
    try:
        wait_healthy([decode, prefill], 600)
        assert "cuda_ipc" in httpx.get(f"{decode.url}/v1/handoff/info").json()["transports"]
        model = httpx.get(f"{decode.url}/v1/models").json()["data"][0]["id"]
        handed = [_hand_over(prefill, decode.url, model, p) for p in one_by_one]
        handed += at_once([partial(_hand_over, prefill, decode.url, model, p)
                           for p in together], 300)
        with EndingProxy(decode.url, end_at=1, lose=True) as proxy:
            lost = _hand_over(prefill, proxy.url, model, _prompts([240], seed=8)[0])
        assert lost.status_code == 502, lost.text
        handed += [_hand_over(prefill, decode.url, model, p) for p in after_loss]
        prompts = one_by_one + together + after_loss
        for prompt, response in zip(prompts, handed):
            assert response.status_code == 200, response.text
            result = response.json()
            num_full = len(prompt) // BS
            assert result["transport"] == "cuda_ipc"
            # Two rows a turn: a send of at most two blocks each, timed on the copy engines.
            assert (result["blocks_sent"], result["groups"]) == (num_full, -(-num_full // 2))
            assert result["wire_s"] > 0
            answers.append(_decode(decode, model, prompt))
        metrics = parse_metrics(httpx.get(f"{decode.url}/metrics").text)
        rejected = 'kvtier_handoff_blocks_total{kind="rejected",role="decode",' \
            'transport="cuda_ipc"}'
        assert metrics.get(rejected, 0) == 0
    finally:
        for process in (prefill, decode):
            process.stop()
    for prompt, (tokens, cached), expected in zip(prompts, answers, colocated_tokens(prompts)):
        assert tokens == expected
        assert cached == (len(prompt) - 1) // BS * BS  # handed over, none computed again


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_handoffs_the_receive_buffer_cannot_take_go_over_nccl(
        tmp_path: Path, no_warmup: None, colocated_tokens) -> None:
    nccl = ["--handoff-nccl", f"tcp://127.0.0.1:{free_port()}"]
    # CUDA IPC on unless told (both roles on GPUs). A 2 MiB buffer: two rows, one per
    # handoff: two handoffs at once over CUDA IPC, the rest refused.
    decode = launch("decode", ["serve", MODEL, "--device", "cuda:1", "--role", "decode",
                               *ENGINE, *nccl, "--handoff-cuda-ipc-mib", "2"], tmp_path,
                    num_threads=None)
    prefill = launch("prefill", ["serve", MODEL, "--device", "cuda:0", "--role", "prefill",
                                 *ENGINE, *nccl], tmp_path, num_threads=None)
    prompts = _prompts([300, 310, 320, 330, 340, 350], seed=9)
    answers: list[tuple[list[int], int]] = []
    try:
        wait_healthy([decode, prefill], 600)
        wait_for_pair(prefill.url, 120)  # it forms in the background
        model = httpx.get(f"{decode.url}/v1/models").json()["data"][0]["id"]
        handed = at_once([partial(_hand_over, prefill, decode.url, model, p, None)
                          for p in prompts], 300)
        used = set()
        for prompt, response in zip(prompts, handed):
            assert response.status_code == 200, response.text
            used.add(response.json()["transport"])
            answers.append(_decode(decode, model, prompt))
        assert used == {"cuda_ipc", "nccl"}
    finally:
        for process in (prefill, decode):
            process.stop()
    for prompt, (tokens, cached), expected in zip(prompts, answers, colocated_tokens(prompts)):
        assert tokens == expected
        assert cached == (len(prompt) - 1) // BS * BS
