"""`kvtier serve`'s API as vLLM users expect it, on a real uvicorn server (loopback) over
SmolLM2 on the CPU, tiers off.

- n > 1, logprobs (completions and chat), repetition_penalty and min_p give what the
  library gives for the same parameters; stop_reason names the stop string.
- Fields kvtier does not honour are refused with a 400 naming them; their "unused" values
  are accepted.
- /tokenize, /detokenize, /version, /v1/models/{id}.
- Every error is OpenAI's error object (404 and 405 included); a body over the limit gets a
  413, each other limit a 400 naming it; a lone surrogate is a 400; a 500 carries no
  internal text and leaves the keep-alive connection usable.
"""

from __future__ import annotations

import json

import httpx
import pytest
from kvtier.cli.server.protocol import ServerLimits
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

from tests.cli.serve_harness import MODEL_NAME, RunningServer, sse_events, start_server

LIMITS = ServerLimits(max_body_bytes=200_000, max_prompt_chars=20_000, max_messages=8,
                      max_stop=3, max_stop_chars=50, max_n=4, max_logprobs=5)


@pytest.fixture(scope="module")
def reference(model: LoadedModel):
    with LLM(model, gpu_blocks=64, host_cache=False, disk_cache=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(model: LoadedModel):
    llm = LLM(model, gpu_blocks=64, host_cache=False, disk_cache=False)
    server = start_server(llm, limits=LIMITS)
    yield server
    server.stop()
    llm.close()


def post(served: RunningServer, path: str, body: dict, status: int = 200) -> dict:
    response = httpx.post(f"{served.url}{path}", json=body, timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def error(served: RunningServer, path: str, body: dict, status: int = 400) -> dict:
    return post(served, path, body, status)["error"]


PROMPT = "The three primary colours are"


def test_n_and_logprobs_equal_the_library(served, reference, model) -> None:
    ids = model.tokenizer.encode(PROMPT)
    params = dict(max_tokens=6, temperature=0.8, seed=7, n=2, logprobs=2)
    [expected] = reference.generate([ids], SamplingParams(**params))
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8,
            "seed": 7, "n": 2, "logprobs": 2, "return_token_ids": True}
    result = post(served, "/v1/completions", body)
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for choice, want in zip(result["choices"], expected.outputs):
        assert choice["token_ids"] == list(want.token_ids)
        assert choice["text"] == want.text
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(want.token_ids)
        for value, entry, token in zip(lp["token_logprobs"], want.logprobs, want.token_ids):
            assert value == pytest.approx(entry[token].logprob, abs=1e-5)
        assert all(len(top) >= 2 for top in lp["top_logprobs"])
    assert result["usage"]["completion_tokens"] == sum(len(o.token_ids)
                                                       for o in expected.outputs)
    # Streamed, the two completions interleave by index and add up to the same texts.
    with httpx.stream("POST", f"{served.url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as response:
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    texts = ["", ""]
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [o.text for o in expected.outputs]


def test_chat_logprobs_and_honoured_penalties(served, reference, model) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    encoded = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True)
    ids = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    params = dict(max_tokens=8, temperature=0, repetition_penalty=1.3, min_p=0.1, logprobs=3)
    [expected] = reference.generate([ids], SamplingParams(**params))
    result = post(served, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0,
        "repetition_penalty": 1.3, "min_p": 0.1, "logprobs": True, "top_logprobs": 3})
    [choice] = result["choices"]
    assert choice["message"]["content"] == expected.outputs[0].text
    content = choice["logprobs"]["content"]
    assert len(content) == len(expected.outputs[0].token_ids)
    assert all(len(entry["top_logprobs"]) == 3 and entry["bytes"] for entry in content)


def test_stop_reason_names_the_stop_string(served, model) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    free = post(served, "/v1/completions", body)["choices"][0]["text"]
    stop = free[4:7]
    [choice] = post(served, "/v1/completions", {**body, "stop": [stop]})["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    chat = post(served, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4, "temperature": 0})
    assert "stop_reason" in chat["choices"][0]


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"42": 5}), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("echo", True),
    ("best_of", 3), ("guided_json", {"type": "object"}), ("min_tokens", 3),
    ("prompt_logprobs", 1), ("suffix", "end")])
def test_fields_not_honoured_are_refused_by_name(served, field, value) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, field: value}
    assert error(served, "/v1/completions", body)["param"] == field


def test_unused_values_of_refused_fields_are_accepted(served) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "logit_bias": {}, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "echo": False, "an_unknown_field": 1}
    assert post(served, "/v1/chat/completions", body)["choices"]


def test_tokenize_detokenize_version_and_model_card(served, model) -> None:
    tokens = post(served, "/tokenize", {"model": MODEL_NAME, "prompt": PROMPT})
    assert tokens["tokens"] == list(model.tokenizer.encode(PROMPT))
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    chat = post(served, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > tokens["count"] // 4
    assert post(served, "/detokenize", {"tokens": tokens["tokens"]})["prompt"] == PROMPT
    assert error(served, "/detokenize", {"tokens": [10**9]})["param"] == "tokens"
    assert httpx.get(f"{served.url}/version").json()["version"]
    card = httpx.get(f"{served.url}/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["object"] == "model"
    missing = httpx.get(f"{served.url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_every_error_is_an_openai_error_object(served) -> None:
    for response, status in [
            (httpx.get(f"{served.url}/no/such/path"), 404),
            (httpx.get(f"{served.url}/v1/completions"), 405),
            (httpx.post(f"{served.url}/v1/completions", content=b"{not json"), 400),
            (httpx.post(f"{served.url}/v1/completions", content=b"[1, 2]"), 400),
            (httpx.post(f"{served.url}/v1/completions", json={"prompt": 5}), 400)]:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_lone_surrogate_is_a_400(served) -> None:
    raw = b'{"prompt": "a \\ud800 b", "max_tokens": 2}'
    response = httpx.post(f"{served.url}/v1/completions", content=raw)
    assert response.status_code == 400 and "surrogate" in response.json()["error"]["message"]
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    response = httpx.post(f"{served.url}/v1/chat/completions", content=chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("body, limit", [
    ({"prompt": "x" * 20_001}, "max_prompt_chars"),
    ({"messages": [{"role": "user", "content": "hi"}] * 9}, "max_messages"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d"]}, "max_stop"),
    ({"prompt": "hi", "stop": "s" * 51}, "max_stop_chars"),
    ({"prompt": "hi", "n": 5}, "max_n"),
    ({"prompt": "hi", "logprobs": 6}, "max_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
      "top_logprobs": 6}, "max_logprobs")])
def test_each_limit_is_named(served, body, limit) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    message = error(served, path, {"max_tokens": 1, **body})["message"]
    assert limit in message and "--" + limit.replace("_", "-") in message


def test_a_body_over_the_limit_is_a_413(served) -> None:
    big = json.dumps({"prompt": "x" * 300_000}).encode()
    response = httpx.post(f"{served.url}/v1/completions", content=big)
    assert response.status_code == 413
    assert "max_body_bytes" in response.json()["error"]["message"]

    def chunks():  # no content-length: the limit applies while reading
        for _ in range(30):
            yield b" " * 10_000

    response = httpx.post(f"{served.url}/v1/completions", content=chunks())
    assert response.status_code == 413


class BrokenTokenizer:
    """A tokenizer that fails on every call (a fault injected into the server)."""

    chat_template = "x"

    def encode(self, *args, **kwargs):
        raise RuntimeError("secret internal detail")


def test_a_500_has_no_internal_text_and_keeps_the_connection(served) -> None:
    state = served.server.config.app.state.kvtier
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        real, state.tokenizer = state.tokenizer, BrokenTokenizer()
        try:
            failed = client.post("/v1/completions", json=body)
        finally:
            state.tokenizer = real
        assert failed.status_code == 500
        assert "secret" not in failed.text and "RuntimeError" not in failed.text
        assert failed.json()["error"]["type"] == "internal_error"
        assert failed.headers.get("connection") != "close"
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
