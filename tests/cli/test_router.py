"""`kvtier router` over real `kvtier serve` processes on loopback (SmolLM2, float32, CPU).

Colocated: two instances of role both behind the router answer exactly what one instance
answers, stream and not; requests are shared between them; a bad request comes back as
the instance wrote it; an instance killed is passed over. An unreachable instance at start
is a one-line error.
"""

from __future__ import annotations

import json
import time
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
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_conversion: Path) -> Path:
    return seed_model_cache(tmp_path_factory.mktemp("kvtier-cache"), smollm2_conversion)


@pytest.fixture(scope="module")
def colocated(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two `kvtier serve` instances (role both) and a router over them."""
    logs = tmp_path_factory.mktemp("logs")
    instances = [launch(f"both{i}", SERVE, logs, cache_dir) for i in range(2)]
    router: Process | None = None
    try:
        wait_healthy(instances)
        router = launch("router", ["router", "--both", instances[0].url, "--both",
                                   instances[1].url, "--down-for", "60"], logs)
        wait_healthy([router])
        yield router, instances
    finally:
        for process in [router, *instances]:
            if process is not None:
                process.stop()


def completion(url: str, stream: bool = False, **extra) -> tuple[list[int], list[str]]:
    """Greedy token ids of PROMPT from `url` (and the SSE payloads when streamed)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}
    if not stream:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["token_ids"], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        events = sse_events(list(answer.iter_lines()))
    assert events[-1] == "[DONE]"
    token_ids = [t for e in events[:-1] for c in json.loads(e)["choices"]
                 for t in c.get("token_ids", [])]
    return token_ids, events


def served_requests(instance: Process) -> float:
    metrics = parse_metrics(httpx.get(f"{instance.url}/metrics", timeout=30).text)
    return sum(v for k, v in metrics.items() if k.startswith("kvtier_requests_total{"))


def _aborted(instance: Process) -> float:
    metrics = parse_metrics(httpx.get(f"{instance.url}/metrics", timeout=30).text)
    return metrics.get('kvtier_requests_total{endpoint="completions",finish_reason="abort"}',
                       0.0)


def test_colocated_router_answers_as_one_instance(colocated) -> None:
    router, instances = colocated
    direct, _ = completion(instances[0].url)
    assert len(direct) == 8
    before = [served_requests(i) for i in instances]
    # Idle instances take sequential requests in turn.
    for _ in range(2):
        assert completion(router.url)[0] == direct
        streamed, events = completion(router.url, stream=True)
        assert streamed == direct
        assert len(events) >= 9  # the tokens came as events, relayed one by one
    assert [served_requests(i) - b for i, b in zip(instances, before)] == [2, 2]

    chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    models = httpx.get(f"{router.url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["vocab_size"] > 0

    # A bad request comes back exactly as the instance answered it.
    bad = {"model": MODEL_NAME, "prompt": PROMPT, "n": 999}
    via_router = httpx.post(f"{router.url}/v1/completions", json=bad, timeout=30)
    assert via_router.status_code == 400
    assert via_router.json() == httpx.post(f"{instances[0].url}/v1/completions", json=bad,
                                           timeout=30).json()
    other = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=30)
    assert other.status_code == 400 and "not valid JSON" in other.json()["error"]["message"]

    # A client that leaves mid-stream: the router closes its stream from the instance,
    # which aborts the request there.
    aborted_before = sum(_aborted(i) for i in instances)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      timeout=120) as answer:
        lines = answer.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 60
    while sum(_aborted(i) for i in instances) == aborted_before:
        assert time.monotonic() < deadline, "the instance did not abort the request"
        time.sleep(0.2)
    health = httpx.get(f"{router.url}/health", timeout=30).json()
    assert [i["in_flight"] for i in health["instances"]] == [0, 0]

    metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
    assert metrics['kvtier_router_requests_total{outcome="abort",path="/v1/completions"}'] == 1
    assert metrics['kvtier_router_requests_total{outcome="ok",path="/v1/completions"}'] == 4
    assert metrics['kvtier_router_requests_total{outcome="client_error",'
                   'path="/v1/completions"}'] == 1
    health = httpx.get(f"{router.url}/health", timeout=30).json()
    assert health["status"] == "ok" and len(health["instances"]) == 2


def test_router_api_key_guards_v1(colocated, tmp_path) -> None:
    _, instances = colocated
    router = launch("keyed-router", ["router", "--both", instances[0].url,
                                     "--api-key", "router-key"], tmp_path)
    try:
        wait_healthy([router])
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.get(f"{router.url}/v1/models", headers=headers, timeout=30)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        keyed = {"Authorization": "Bearer router-key"}
        assert httpx.get(f"{router.url}/v1/models", headers=keyed, timeout=30).status_code \
            == 200
        answer = httpx.post(f"{router.url}/v1/completions", headers=keyed, timeout=120,
                            json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200
        assert httpx.get(f"{router.url}/metrics", timeout=30).status_code == 200  # open
    finally:
        router.stop()


def test_router_options_and_unreachable_instances_are_one_line_errors() -> None:
    runner = CliRunner()
    dead = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["router", "--both", dead])
    assert result.exit_code == 1
    assert f"cannot reach the --both instance at {dead}" in result.output
    assert "start it or fix the URL" in result.output
    result = runner.invoke(app, ["router", "--prefill", dead])
    assert result.exit_code == 1 and "at least one --prefill and one --decode" in result.output
    result = runner.invoke(app, ["router", "--both", "127.0.0.1:8000"])
    assert result.exit_code == 1 and "base URL such as http://" in result.output
    result = runner.invoke(app, ["router", "--both", dead, "--prefill-queue-limit", "2"])
    assert result.exit_code == 1 and "--prefill-queue-limit applies to --prefill/--decode" \
        in result.output
    result = runner.invoke(app, ["router", "--prefill", dead, "--decode", dead,
                                 "--prefill-queue-limit", "0"])
    assert result.exit_code == 1 and "prefill_queue_limit must be at least 1" in result.output


def test_a_killed_instance_is_passed_over(colocated) -> None:
    """Last in this module: it kills the fixture's instances one after the other."""
    router, instances = colocated
    # An instance killed while it streams: the stream ends with an error event.
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      timeout=120) as answer:
        lines = answer.iter_lines()
        assert next(lines).startswith("data: ")
        busy = [i["in_flight"] for i in httpx.get(f"{router.url}/health",
                                                  timeout=30).json()["instances"]]
        assert sorted(busy) == [0, 1]
        streaming, other = (instances[0], instances[1]) if busy[0] else \
            (instances[1], instances[0])
        streaming.kill()
        events = sse_events(list(lines))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "upstream_failed"

    # The dead instance is passed over: requests go to the other one.
    direct, _ = completion(other.url)
    for stream in (False, True):
        assert completion(router.url, stream=stream)[0] == direct
    metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
    assert metrics['kvtier_router_requests_total{outcome="error",path="/v1/completions"}'] == 1
    health = httpx.get(f"{router.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded"

    # Both dead: a clear 502, no hang.
    other.kill()
    gone = httpx.post(f"{router.url}/v1/completions", timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 502 and gone.json()["error"]["code"] == "upstream_unavailable"
    metrics = parse_metrics(httpx.get(f"{router.url}/metrics", timeout=30).text)
    assert metrics['kvtier_router_retries_total{part="decode"}'] == 1
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 503
