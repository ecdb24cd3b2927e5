"""`kvtier router` over a prefill and a decode instance (real `kvtier serve --role`
processes on loopback, SmolLM2, float32, CPU, the KV handed over through a torch.distributed
pair on gloo).

Greedy tokens through the router equal those of one colocated engine (the prefill instance
answering by itself), stream and not, completions and chat, and the decode instance finds
the prompt's blocks handed over; a killed prefill instance makes the decode instance compute
the prompts itself, with the same tokens, the fallback counted.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from kvtier.cli.bench.cluster import Process, free_port, launch, wait_healthy
from kvtier.cli.main import app
from typer.testing import CliRunner

from tests.cli.serve_harness import MODEL_NAME, parse_metrics, sse_events
from tests.model_cache import seed_model_cache

pytestmark = pytest.mark.slow

SERVE = ["serve", MODEL_NAME, "--device", "cpu", "--dtype", "float32", "--gpu-blocks", "64",
         "--host-cache-gb", "0.05", "--no-disk-cache"]
#: Over three 16-token blocks of SmolLM2's tokens: full blocks to hand over.
DOCUMENT = ("A key-value cache keeps the attention keys and values of the tokens a model "
            "has already read, so that each new token only attends to them instead of "
            "computing them again. The cache grows with the context, one block of sixteen "
            "tokens at a time, and a block that is full gets a hash that chains its parent.")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, smollm2_conversion: Path):
    """A prefill and a decode instance paired over gloo, and a router over them."""
    cache = seed_model_cache(tmp_path_factory.mktemp("kvtier-cache"), smollm2_conversion)
    logs = tmp_path_factory.mktemp("logs")
    rendezvous = ["--handoff-nccl", f"tcp://127.0.0.1:{free_port()}"]
    instances = [launch(role, [*SERVE, "--role", role, *rendezvous], logs, cache)
                 for role in ("prefill", "decode")]
    router: Process | None = None
    try:
        wait_healthy(instances)
        router = launch("router", ["router", "--prefill", instances[0].url, "--decode",
                                   instances[1].url, "--prefill-timeout", "60",
                                   "--down-for", "60"], logs)
        wait_healthy([router])
        yield router, instances[0], instances[1]
    finally:
        for process in [router, *instances]:
            if process is not None:
                process.stop()


def answer(url: str, prompt: str, stream: bool, chat: bool = False
           ) -> tuple[list[int], dict[str, str], int]:
    """Greedy token ids, the response headers and the cached prompt tokens of one request."""
    body: dict = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True, "stream": stream,
                  "stream_options": {"include_usage": True} if stream else None}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if not stream:
        response = httpx.post(f"{url}{path}", json=body, timeout=180)
        assert response.status_code == 200, response.text
        data = response.json()
        return (data["choices"][0]["token_ids"], dict(response.headers),
                data["usage"]["prompt_tokens_details"]["cached_tokens"])
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=180) as response:
        assert response.status_code == 200
        events = sse_events(list(response.iter_lines()))
        headers = dict(response.headers)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    token_ids = [t for c in chunks for choice in c["choices"]
                 for t in choice.get("token_ids", [])]
    usage = chunks[-1]["usage"]
    return token_ids, headers, usage["prompt_tokens_details"]["cached_tokens"]


def test_disaggregated_tokens_equal_one_colocated_engine(pair) -> None:
    router, prefill, _ = pair
    cases = [(f"Question {i}. {DOCUMENT} What does it keep?", stream, chat)
             for i, (stream, chat) in enumerate([(False, False), (True, False),
                                                 (False, True), (True, True)])]
    for prompt, stream, chat in cases:
        expected, _, _ = answer(prefill.url, prompt, stream=False, chat=chat)
        got, headers, cached = answer(router.url, prompt, stream=stream, chat=chat)
        assert got == expected, (prompt, stream, chat)
        handoff = json.loads(headers["x-kvtier-handoff"])
        assert "fallback" not in handoff, handoff
        # Chats share the template's system prompt: its blocks go over once.
        assert handoff["blocks_sent"] + handoff["blocks_skipped"] == handoff["blocks_total"]
        assert handoff["blocks_total"] >= 3 and handoff["blocks_sent"] >= 1
        assert handoff["blocks_skipped"] == 0 or chat
        assert handoff["bytes"] > 0
        # The decode instance computed only the prompt's last partial block.
        assert cached == 16 * handoff["blocks_total"]
    # A prompt the decode instance holds already: no block goes over again.
    prompt, _, _ = cases[0]
    got, headers, cached = answer(router.url, prompt, stream=False)
    assert got == answer(prefill.url, prompt, stream=False)[0]
    handoff = json.loads(headers["x-kvtier-handoff"])
    assert handoff["blocks_skipped"] == handoff["blocks_total"] and handoff["bytes"] == 0
    metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
    assert metrics["kvtier_router_handoffs_total"] == 5
    assert metrics["kvtier_router_handoff_bytes_total"] > 0
    assert not any(k.startswith("kvtier_router_fallbacks_total") for k in metrics)


def test_a_bad_request_comes_back_from_the_prefill_instance(pair) -> None:
    router, prefill, _ = pair
    bad = {"model": MODEL_NAME, "prompt": DOCUMENT, "max_tokens": 4, "logit_bias": {"1": 5}}
    via_router = httpx.post(f"{router.url}/v1/completions", json=bad, timeout=60)
    direct = httpx.post(f"{prefill.url}/v1/completions", json=bad, timeout=60)
    assert via_router.status_code == direct.status_code == 400
    assert via_router.json() == direct.json()


def test_instances_that_do_not_fit_their_options_are_one_line_errors(pair) -> None:
    _, prefill, decode = pair
    runner = CliRunner()
    for args, message in [
        (["--both", prefill.url], f"the --both instance at {prefill.url} has role 'prefill'"),
        (["--prefill", decode.url, "--decode", prefill.url],
         f"the --prefill instance at {decode.url} has role 'decode'"),
        (["--prefill", prefill.url, "--decode", decode.url, "--transport", "carrier-pigeon"],
         "--transport carrier-pigeon is not offered by both"),
    ]:
        result = runner.invoke(app, ["router", *args])
        assert result.exit_code == 1 and message in result.output, result.output


def test_a_handoff_past_its_timeout_falls_back(pair, tmp_path) -> None:
    """A router whose --prefill-timeout no handoff can meet: the prefill instance gives up
    (504) and the decode instance computes the prompt itself, with the same tokens."""
    _, prefill, decode = pair
    router = launch("hasty-router", ["router", "--prefill", prefill.url, "--decode",
                                     decode.url, "--prefill-timeout", "0.000001"], tmp_path)
    try:
        wait_healthy([router])
        prompt = f"In a hurry. {DOCUMENT} Is it quick?"
        got, headers, _ = answer(router.url, prompt, stream=True)
        assert got == answer(prefill.url, prompt, stream=False)[0]
        assert json.loads(headers["x-kvtier-handoff"]) == {"fallback": "timeout"}
        metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
        assert metrics['kvtier_router_fallbacks_total{reason="timeout"}'] == 1
    finally:
        router.stop()


def test_past_the_prefill_queue_limit_the_decode_instance_computes(pair, tmp_path) -> None:
    """Six requests at once through a router that lets the prefill instance hold one: the
    first is handed over, those that find it busy are computed by the decode instance, and
    every answer has the tokens the prefill instance gives by itself."""
    _, prefill, decode = pair
    router = launch("limited-router", ["router", "--prefill", prefill.url, "--decode",
                                       decode.url, "--prefill-queue-limit", "1"], tmp_path)
    try:
        wait_healthy([router])
        prompts = [f"At once {i}. {DOCUMENT} Who waits?" for i in range(6)]
        expected = [answer(prefill.url, p, stream=False)[0] for p in prompts]
        start = threading.Barrier(len(prompts))

        def ask(prompt: str) -> tuple[list[int], dict[str, str], int]:
            start.wait()
            return answer(router.url, prompt, stream=False)

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        assert [tokens for tokens, _, _ in answers] == expected
        handoffs = [json.loads(headers["x-kvtier-handoff"]) for _, headers, _ in answers]
        busy = [h for h in handoffs if h == {"fallback": "busy"}]
        handed = [h for h in handoffs if "fallback" not in h]
        assert len(busy) + len(handed) == len(prompts), handoffs
        assert busy and handed, handoffs
        metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
        assert metrics['kvtier_router_fallbacks_total{reason="busy"}'] == len(busy)
        assert metrics["kvtier_router_handoffs_total"] == len(handed)
        # One request at a time never finds the prefill instance busy.
        prompt = f"Alone. {DOCUMENT} Who waits?"
        got, headers, _ = answer(router.url, prompt, stream=True)
        assert got == answer(prefill.url, prompt, stream=False)[0]
        assert "fallback" not in json.loads(headers["x-kvtier-handoff"])
    finally:
        router.stop()


def test_a_killed_prefill_instance_falls_back_to_the_decode_instance(pair) -> None:
    """Last in this module: it kills the fixture's prefill instance."""
    router, prefill, _ = pair
    prompts = [f"Afterwards {i}. {DOCUMENT} Why is it faster?" for i in range(2)]
    expected = [answer(prefill.url, p, stream=False)[0] for p in prompts]
    prefill.kill()
    for prompt, tokens, stream in zip(prompts, expected, (False, True)):
        got, headers, _ = answer(router.url, prompt, stream=stream)
        assert got == tokens
        assert json.loads(headers["x-kvtier-handoff"]) == {"fallback": "unreachable"}
    metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
    assert metrics['kvtier_router_fallbacks_total{reason="unreachable"}'] == 2
    health = httpx.get(f"{router.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded"


def test_a_dead_prefill_instance_is_retried_on_another(tmp_path) -> None:
    """Two prefill instances and one decode instance over Mooncake (tiny random model): the
    first prefill instance killed, the request is handed over by the second, counted as a
    retry and not as a fallback."""
    from kvtier.handoff.mooncake import mooncake_available

    if mooncake_available() is not None:
        pytest.skip(mooncake_available())
    tiny = ["serve", "random:tiny-llama", "--device", "cpu", "--dtype", "float32",
            "--no-disk-cache", "--handoff-mooncake", "127.0.0.1"]
    instances = [launch(name, [*tiny, "--role", role], tmp_path)
                 for name, role in (("prefill-a", "prefill"), ("prefill-b", "prefill"),
                                    ("decode", "decode"))]
    router: Process | None = None
    try:
        wait_healthy(instances)
        first, second, decode = instances
        router = launch("router", ["router", "--prefill", first.url, "--prefill", second.url,
                                   "--decode", decode.url, "--transport", "mooncake"],
                        tmp_path)
        wait_healthy([router])
        body = {"prompt": list(range(1, 60)), "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        expected = httpx.post(f"{second.url}/v1/completions", json=body,
                              timeout=60).json()["choices"][0]["token_ids"]
        first.kill()  # the router picks it first: it has never been picked
        response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["choices"][0]["token_ids"] == expected
        handoff = json.loads(response.headers["x-kvtier-handoff"])
        assert handoff["transport"] == "mooncake" and handoff["blocks_sent"] == 3
        metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
        assert metrics['kvtier_router_retries_total{part="prefill"}'] == 1
        assert not any(k.startswith("kvtier_router_fallbacks_total") for k in metrics)
    finally:
        for process in [router, *instances]:
            if process is not None:
                process.stop()
