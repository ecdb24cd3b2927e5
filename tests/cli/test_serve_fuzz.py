"""A fuzz test of the request schema against a live `kvtier serve` (loopback, SmolLM2 on the
CPU, host and disk tiers on): hypothesis generates request bodies of every field OpenAI and
vLLM know, and others, with extreme numbers (int64 and float edges, NaN, 1e-50), odd
unicode (lone surrogates, controls, astral planes), wrong types, huge sizes and broken
JSON; after each, the server must still answer a fixed greedy request exactly as before
and /health must be ok. No answer may be a 500 (the server's fault).

The default run is short; the goal run sets KVTIER_FUZZ_EXAMPLES (e.g. 5000).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier.cli.server.protocol import REFUSED_FIELDS, ServerLimits
from kvtier.engine import LLM
from kvtier.engine.loader import LoadedModel

from tests.cli.serve_harness import MODEL_NAME, RunningServer, start_server

NUM_EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "120"))
#: A file that gets one line per request ("path status") when set, for the long run's tally.
TALLY = os.environ.get("KVTIER_FUZZ_TALLY")
MAX_MODEL_LEN = 48  # bounds every request's generation, whatever max_tokens says
LIMITS = ServerLimits(max_body_bytes=1_000_000, max_prompt_chars=200_000)

PROBE = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
         "temperature": 0}


@pytest.fixture(scope="module")
def served(model: LoadedModel, tmp_path_factory: pytest.TempPathFactory):
    llm = LLM(model, gpu_blocks=48, max_model_len=MAX_MODEL_LEN, host_cache_gb=0.01,
              disk_cache=True, disk_cache_dir=tmp_path_factory.mktemp("kv-disk"))
    server = start_server(llm, limits=LIMITS)
    yield server
    server.stop()
    llm.close()


_INTS = st.one_of(
    st.integers(-5, 40),
    st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -2**63, 2**64, 10**30,
                     -10**30]),
    st.integers())
_FLOATS = st.one_of(
    st.floats(-3, 3),
    st.sampled_from([0.0, -0.0, 1e-50, 5e-324, 1e-8, 1e308, -1e308, float("nan"),
                     float("inf"), float("-inf"), 2.0, 1.0, 0.01]),
    st.floats())
_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\U0001F600" * 30, "\u202e", "\n" * 50,
                     "<|im_end|>", "<|endoftext|>", "{{ raise_exception('x') }}"]),
    st.integers(1, 200_000).map(lambda n: "ab " * (n // 3)))
_SCALAR = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXT)
_JSON = st.recursive(_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(_TEXT, inner, max_size=5)), max_leaves=12)

_MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]),
                       _TEXT),
     "content": st.one_of(_TEXT, st.none(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": _SCALAR}), max_size=3))},
    optional={"name": _TEXT, "tool_calls": _JSON})

_FIELDS = {
    "model": st.one_of(st.just(MODEL_NAME), _TEXT, _JSON),
    "prompt": st.one_of(_TEXT, st.lists(_INTS, max_size=30),
                        st.lists(st.integers(0, 49151), min_size=1, max_size=80),
                        st.lists(_TEXT, max_size=3), st.lists(st.lists(_INTS, max_size=4),
                                                              max_size=2), _JSON),
    "messages": st.one_of(st.lists(_MESSAGE, min_size=1, max_size=6),
                          st.integers(0, 10_000).map(
                              lambda n: [{"role": "user", "content": "hi"}] * n),
                          _JSON),
    "max_tokens": st.one_of(st.integers(-2, 8), _INTS, _FLOATS, _JSON),
    "max_completion_tokens": st.one_of(st.integers(1, 8), _INTS),
    "temperature": _FLOATS, "top_p": _FLOATS, "top_k": _INTS, "min_p": _FLOATS,
    "repetition_penalty": _FLOATS, "presence_penalty": _FLOATS,
    "frequency_penalty": _FLOATS, "seed": _INTS,
    "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=20), _JSON),
    "stop_token_ids": st.one_of(st.lists(_INTS, max_size=20), _JSON),
    "ignore_eos": st.one_of(st.booleans(), _JSON),
    "n": st.one_of(st.integers(0, 4), _INTS), "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                _JSON),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), _JSON),
    "top_logprobs": st.one_of(st.integers(-1, 25), _JSON),
    "cache_salt": st.one_of(_TEXT, _JSON), "return_token_ids": st.booleans(),
    "user": _JSON, "tokens": st.one_of(st.lists(_INTS, max_size=20), _JSON),
    "add_special_tokens": _JSON, "add_generation_prompt": _JSON,
    **{name: _JSON for name in REFUSED_FIELDS},
}

# Requests that mostly pass validation, so that the engine samples with edge values.
_SAMPLING = {name: st.one_of(st.none(), strategy) for name, strategy in {
    "temperature": st.one_of(st.sampled_from([0.0, 1e-50, 5e-324, 1e-8, 0.01, 2.0, 1e4]),
                             st.floats(0, 5)),
    "top_p": st.one_of(st.sampled_from([1e-300, 1e-8, 0.5, 1.0]), st.floats(0, 1)),
    "top_k": st.sampled_from([-1, 0, 1, 2, 49152, 49153, 2**31 - 1]),
    "min_p": st.one_of(st.sampled_from([0.0, 1e-300, 0.999999, 1.0]), st.floats(0, 1)),
    "repetition_penalty": st.sampled_from([1e-3, 0.5, 1.0, 2.0, 1e3]),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "seed": st.sampled_from([0, 1, 2**63 - 1]),
    "n": st.integers(1, 3), "logprobs": st.integers(0, 5),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "return_token_ids": st.booleans(), "cache_salt": st.text(min_size=1, max_size=8),
}.items()}
_CHAT_SAMPLING = {**{k: v for k, v in _SAMPLING.items() if k != "logprobs"},
                  "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}
_SERVABLE = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(min_size=1, max_size=60),
                             st.lists(st.integers(0, 49151), min_size=1, max_size=40)),
         "max_tokens": st.integers(1, 8)}, optional=_SAMPLING)),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]),
             "content": st.text(max_size=60)}), min_size=1, max_size=4),
         "max_tokens": st.integers(1, 8)}, optional=_CHAT_SAMPLING)))

_BODY = st.one_of(
    st.fixed_dictionaries({}, optional=_FIELDS),
    st.fixed_dictionaries({"prompt": _FIELDS["prompt"]},
                          optional={k: v for k, v in _FIELDS.items() if k != "prompt"}),
    st.fixed_dictionaries({"messages": _FIELDS["messages"]},
                          optional={k: v for k, v in _FIELDS.items() if k != "messages"}),
    _JSON)
_PATHS = st.sampled_from(["/v1/completions"] * 4 + ["/v1/chat/completions"] * 4
                         + ["/tokenize", "/detokenize"])
_RAW = st.one_of(st.binary(max_size=200), st.sampled_from([
    b"{", b'{"prompt": "\\ud800"}', b'{"prompt": NaN, "max_tokens": Infinity}',
    b"[" * 100_000, b'{"prompt": "x", "max_tokens": 1e999}', b"\xff\xfe",
    b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 2}']))


def send(client: httpx.Client, path: str, content: bytes) -> httpx.Response | None:
    """POST `content`; a stream is read to its end (which must be `data: [DONE]`). None when
    the server closed the connection on a body over its limit (HTTP allows it to answer 413
    and close before the body is read: the client may see the reset first)."""
    try:
        with client.stream("POST", path, content=content,
                           headers={"content-type": "application/json"}) as response:
            body = response.read()
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        if len(content) <= LIMITS.max_body_bytes:
            raise
        return None
    if response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"):
        assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    return response


def check_still_serving(served: RunningServer, client: httpx.Client, expected: str) -> None:
    assert served.engine.is_running
    assert client.get("/health").json() == {"status": "ok"}
    answer = client.post("/v1/completions", json=PROBE)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected


@pytest.fixture(scope="module")
def client(served: RunningServer):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def expected(client: httpx.Client) -> str:
    return client.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=NUM_EXAMPLES <= 200,
          suppress_health_check=list(HealthCheck))
@given(request=st.one_of(
    _SERVABLE.map(lambda r: (r[0], "json", r[1])),
    st.tuples(_PATHS, st.just("json"), _BODY),
    st.tuples(_PATHS, st.just("raw"), _RAW)))
def test_no_request_stops_the_server_or_changes_another_answer(served, client, expected,
                                                               request) -> None:
    path, kind, value = request
    content = json.dumps(value).encode() if kind == "json" else value
    response = send(client, path, content)
    if response is None:
        pass
    elif response.status_code not in (200, 400, 404, 413):
        raise AssertionError((response.status_code, response.text[:500]))
    elif response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    check_still_serving(served, client, expected)
    if TALLY:
        with open(TALLY, "a", encoding="utf-8") as tally:
            tally.write(f"{path} {response.status_code if response else 'closed'}\n")
