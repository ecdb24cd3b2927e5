"""`kvtier serve`'s app on a real uvicorn server (loopback, free port) over SmolLM2 on the
CPU, talked to with the official `openai` client and with raw HTTP.

- Greedy completions and chat equal `LLM.generate` token for token; streamed deltas add up
  to the non-streamed text; SSE ends with `data: [DONE]`.
- Errors are OpenAI-style JSON bodies: n > 1, unknown model, a prompt that cannot fit, bad
  values, a full engine (503).
- 32 concurrent streaming clients all complete with no token lost or duplicated, and the
  /metrics counters add up to what they received.
- 8 clients leaving mid-stream abort their requests: no block or host slot stays held.
- Two tenants' `cache_salt`s keep the same document's blocks apart.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from kvtier.cli.server.engine_output import read_output
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

from tests.cli.serve_harness import MODEL_NAME, RunningServer, sse_events, start_server

GPU_BLOCKS = 160
NUM_CLIENTS = 32


@pytest.fixture(scope="module")
def reference(model: LoadedModel):
    """The library, tiers off: what the server must reproduce (used while it is idle)."""
    with LLM(model, gpu_blocks=GPU_BLOCKS, host_cache=False, disk_cache=False,
             max_num_seqs=NUM_CLIENTS) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    disk = tmp_path_factory.mktemp("kv-disk")
    llm = LLM(model, gpu_blocks=GPU_BLOCKS, max_num_seqs=NUM_CLIENTS, host_cache_gb=0.05,
              disk_cache=True, disk_cache_dir=disk)
    server = start_server(llm)
    yield server
    server.stop()
    llm.close()


def client_for(served: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def expected_output(reference: LLM, prompt_ids: list[int], **params):
    [output] = reference.generate([prompt_ids], SamplingParams(**params))
    return read_output(output)


def chat_ids(model: LoadedModel, messages: list[dict]) -> list[int]:
    encoded = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True)
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


def check_pool_is_free(served: RunningServer) -> None:
    """No request, no transfer, every GPU block free, no host slot pinned or reserved."""
    served.wait_idle()

    def check(llm: LLM) -> tuple[int, int]:
        llm.manager.pool.check_invariants()
        if llm.manager.host is not None:
            llm.manager.host.check_invariants(idle=True)
        return llm.manager.pool.num_free_blocks, llm.manager.pool.num_blocks

    num_free, num_blocks = served.on_engine(check)
    assert num_free == num_blocks


def test_completions_match_the_library(served, reference, model) -> None:
    prompt = "The three primary colours are"
    expected = expected_output(reference, model.tokenizer.encode(prompt), max_tokens=10)
    client = client_for(served)
    [card] = client.models.list().data
    assert card.id == MODEL_NAME
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10,
                                       temperature=0, extra_body={"return_token_ids": True})
    [choice] = result.choices
    assert choice.token_ids == list(expected.token_ids)
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)
    pieces, ids, reasons = [], [], []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10,
                                           temperature=0, stream=True,
                                           extra_body={"return_token_ids": True}):
        pieces.append(chunk.choices[0].text)
        ids += chunk.choices[0].token_ids
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == choice.text
    assert ids == choice.token_ids
    assert reasons[-1] == choice.finish_reason and set(reasons[:-1]) == {None}


def test_chat_matches_the_library(served, reference, model) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is a river?"}]
    expected = expected_output(reference, chat_ids(model, messages), max_tokens=12)
    client = client_for(served)
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=12, temperature=0,
                                            extra_body={"return_token_ids": True})
    [choice] = result.choices
    assert choice.token_ids == list(expected.token_ids)
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    deltas, roles = [], []
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            roles.append(c.delta.role)
    assert "".join(deltas) == choice.message.content
    assert roles[0] == "assistant"
    assert usage.completion_tokens == len(expected.token_ids)


def test_raw_http_stream_stop_strings_and_errors(served, reference, model) -> None:
    url = f"{served.url}/v1/completions"
    prompt_ids = model.tokenizer.encode("Rivers flow into")
    body = {"model": MODEL_NAME, "prompt": prompt_ids, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    free = httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]
    stop = free[5:8]
    with httpx.stream("POST", url, json={**body, "stream": True, "stop": [stop]},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == free[:free.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    cut = httpx.post(url, json={**body, "stop": stop}, timeout=120).json()["choices"][0]
    assert cut["text"] == streamed and cut["finish_reason"] == "stop"

    def error(payload: dict, status: int) -> dict:
        response = httpx.post(url, json=payload, timeout=120)
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert error({**body, "n": 17}, 400)["param"] == "n"
    assert error({**body, "model": "other"}, 404)["code"] == "model_not_found"
    assert "temperature" in error({**body, "temperature": -1}, 400)["message"]
    assert "prompt" in error({"model": MODEL_NAME}, 400)["message"]
    too_long = error({**body, "prompt": [100] * (GPU_BLOCKS * 16 + 1)}, 400)
    assert "block budget" in too_long["message"]
    assert "must lie in [0, " in error({**body, "prompt": [10**7]}, 400)["message"]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    check_pool_is_free(served)


def test_a_full_engine_answers_503(model) -> None:
    with LLM(model, gpu_blocks=32, host_cache=False, disk_cache=False) as llm:
        server = start_server(llm, max_num_requests=1)
        try:
            url = f"{server.url}/v1/completions"
            long_body = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 200,
                         "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url, json=long_body, timeout=120) as response:
                lines = response.iter_lines()  # kept: dropping it would close the stream
                next(lines)  # admitted and streaming
                busy = httpx.post(url, json={**long_body, "stream": False}, timeout=120)
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "engine_full"
            check_pool_is_free(server)  # the stream left: its request was aborted
            ok = httpx.post(url, json={**long_body, "stream": False, "max_tokens": 2},
                            timeout=120)
            assert ok.status_code == 200, ok.text
        finally:
            server.stop()


def test_concurrent_streaming_clients(served, reference, model) -> None:
    prompts = [f"Client {i} asks: name a colour." for i in range(NUM_CLIENTS)]
    prompt_ids = [model.tokenizer.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [read_output(o) for o in reference.generate(prompt_ids, params)]
    before = served.metrics()

    async def one(client: openai.AsyncOpenAI, prompt: str) -> dict:
        ids, pieces, reasons, usage = [], [], [], None
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                ids += choice.token_ids
                pieces.append(choice.text)
                reasons.append(choice.finish_reason)
        return {"ids": ids, "text": "".join(pieces), "reason": reasons[-1], "usage": usage}

    async def run_all() -> list[dict]:
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused",
                                    max_retries=0, timeout=300)
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=600)

    results = asyncio.run(run_all())
    for result, want in zip(results, expected):
        assert result["ids"] == list(want.token_ids)  # nothing lost, duplicated or reordered
        assert result["text"] == model.tokenizer.decode(result["ids"], skip_special_tokens=True)
        assert result["reason"] == "length"
        assert result["usage"].completion_tokens == len(result["ids"]) == 8
    after = served.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    received = sum(len(r["ids"]) for r in results)
    assert grew('kvtier_requests_total{endpoint="completions",finish_reason="length"}') \
        == NUM_CLIENTS
    assert grew("kvtier_generation_tokens_total") == received
    assert grew("kvtier_prompt_tokens_total") == sum(r["usage"].prompt_tokens for r in results)
    assert grew("kvtier_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert grew("kvtier_time_per_output_token_seconds_count") == NUM_CLIENTS
    check_pool_is_free(served)


def test_clients_leaving_mid_stream_abort_their_requests(served) -> None:
    before = served.metrics()

    async def leave_early(client: httpx.AsyncClient, index: int) -> int:
        body = {"model": MODEL_NAME, "prompt": f"Story number {index}:", "max_tokens": 400,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        received = 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["token_ids"]:
                    received += 1
                    if received == 2:
                        break  # leaving the block closes the connection mid-stream
        return received

    async def run_all() -> list[int]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(leave_early(client, i) for i in range(8))), timeout=300)

    assert asyncio.run(run_all()) == [2] * 8
    check_pool_is_free(served)  # bounded wait: the 400-token requests must have stopped
    after = served.metrics()
    aborted = 'kvtier_requests_total{endpoint="completions",finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 8
    assert after["kvtier_generation_tokens_total"] == before["kvtier_generation_tokens_total"]


def test_a_client_leaving_a_plain_request_aborts_it(served) -> None:
    before = served.metrics()
    body = {"model": MODEL_NAME, "prompt": "A long list:", "max_tokens": 400,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{served.url}/v1/completions", json=body,
                   timeout=httpx.Timeout(120, read=1.0))
    check_pool_is_free(served)
    after = served.metrics()
    aborted = 'kvtier_requests_total{endpoint="completions",finish_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1


def test_seeded_sampling_repeats(served) -> None:
    body = {"model": MODEL_NAME, "prompt": "Pick a word:", "max_tokens": 8,
            "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7,
            "return_token_ids": True}
    url = f"{served.url}/v1/completions"
    runs = [httpx.post(url, json=body, timeout=120).json()["choices"][0]["token_ids"]
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) >= 1


def test_cache_salts_keep_tenants_apart(served, model) -> None:
    document = model.tokenizer.encode("Tenant document: the quarterly river survey notes "
                                      "that water levels rose in spring. " * 4)
    client = client_for(served)

    def cached_tokens(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        result = client.completions.create(model=MODEL_NAME, prompt=document, max_tokens=1,
                                           temperature=0, extra_body=extra)
        return result.usage.prompt_tokens_details.cached_tokens

    full_blocks = (len(document) - 1) // 16 * 16
    assert full_blocks >= 64
    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-b") == 0          # same document, other tenant: no hit
    assert cached_tokens(None) == 0                # no salt is a namespace of its own too
    assert cached_tokens("tenant-a") == full_blocks  # the same tenant again: every full block
    metrics = served.metrics()
    assert metrics['kvtier_gpu_blocks{state="total"}'] == GPU_BLOCKS
    for name in ('kvtier_cache_hits_total{tier="host"}',
                 'kvtier_transfer_bytes_total{direction="gpu->host"}',
                 'kvtier_host_slots{state="cached"}', "kvtier_disk_blocks",
                 'kvtier_prompt_tokens_cached_total{tier="gpu"}'):
        assert name in metrics, name
    assert metrics['kvtier_transfer_bytes_total{direction="gpu->host"}'] > 0
    assert metrics['kvtier_prompt_tokens_cached_total{tier="gpu"}'] >= full_blocks


def test_a_scrape_reads_the_disk_tier_off_the_engine_thread(served, monkeypatch) -> None:
    # The disk tier's figures read LMDB: here a slow read (held until released) is under
    # way in a scrape, and the engine must go on serving meanwhile.
    disk = served.on_engine(lambda llm: llm.manager.disk)
    release, entered, readers = threading.Event(), threading.Event(), []
    real_stats = disk.stats

    def slow_stats():
        readers.append(threading.current_thread())
        entered.set()
        assert release.wait(60), "the test never released the disk read"
        return real_stats()

    monkeypatch.setattr(disk, "stats", slow_stats)
    scrape: dict = {}
    scraper = threading.Thread(target=lambda: scrape.update(served.metrics()))
    try:
        scraper.start()
        assert entered.wait(60), "the scrape did not read the disk tier's stats"
        body = {"model": MODEL_NAME, "prompt": "While a scrape waits:", "max_tokens": 4,
                "ignore_eos": True}
        answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert scraper.is_alive()  # still reading the disk when the request was served
    finally:
        release.set()
        scraper.join(60)
        monkeypatch.undo()
    engine_thread = served.on_engine(lambda llm: threading.current_thread())
    assert readers and engine_thread not in readers
    assert "kvtier_disk_blocks" in scrape and 'kvtier_gpu_blocks{state="total"}' in scrape
