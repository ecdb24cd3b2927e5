"""The OpenAI-compatible HTTP app of `kvtier serve` (FastAPI over an `AsyncLLM`).

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics.
With an API key, /v1/* needs `Authorization: Bearer KEY` (401 otherwise). Every error is
an OpenAI-style JSON body `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request or a prompt that cannot fit, 401, 404 for another model name, 503 when the engine
is full or shutting down, 500 for anything unexpected (logged, never a traceback in the
body). A client that disconnects aborts its request, streamed or not.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvtier.cli.server.engine_output import FinishedRequest, read_output
from kvtier.cli.server.metrics import EngineSnapshot, ServerMetrics
from kvtier.cli.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvtier.engine.async_llm import AsyncLLM, EngineClosedError, EngineFullError, RequestStream
from kvtier.engine.llm import LLM
from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger("kvtier.serve")


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What /v1/models reports about the served model (kvtier adds sizes to OpenAI's)."""

    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    created: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "kvtier", "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "block_size": self.block_size}


@dataclass(slots=True)
class _Result:
    """What a request produced, gathered from its deltas."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: FinishedRequest | None = None


class _Server:
    """The routes' shared state: the engine, the model's tokenizer, metrics, the key."""

    def __init__(self, engine: AsyncLLM, model_name: str, api_key: str | None,
                 metrics: ServerMetrics) -> None:
        llm: LLM = engine.llm
        self.engine = engine
        self.metrics = metrics
        self.api_key = api_key
        # The engine thread decodes with the engine's tokenizer; requests are encoded here,
        # on the event loop, with a copy of it, so no tokenizer object is shared by threads.
        self.tokenizer = copy.deepcopy(llm.tokenizer)
        self.card = ModelCard(model_name, llm.max_model_len, llm.model_config.vocab_size,
                              llm.config.block_size, int(time.time()))

    # ---- requests -> token ids -----------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.card.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.card.name!r}", param="model", code="model_not_found")

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids",
                               param="prompt")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.card.name} has no chat template; use "
                           "/v1/completions", param="messages")
        try:
            encoded = self.tokenizer.apply_chat_template(
                body.chat_messages(), add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 (a template that rejects the conversation)
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from None
        if not isinstance(encoded, list):  # transformers 5 returns a BatchEncoding
            encoded = encoded["input_ids"]
        return list(encoded)

    async def submit(self, body: Any, prompt_ids: list[int], request_id: str) -> RequestStream:
        params = body.sampling_params(default_max_tokens=self.card.max_model_len)
        try:
            return await self.engine.submit(prompt_ids, params, request_id=request_id,
                                            cache_salt=body.cache_salt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None
        except EngineFullError as exc:
            raise APIError(503, str(exc), type_="server_busy", code="engine_full") from None
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None


def usage(finished: FinishedRequest | None, num_completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, with the prompt tokens served from the KV cache."""
    prompt = len(finished.prompt_token_ids) if finished else 0
    cached = finished.cached_tokens if finished else 0
    return {"prompt_tokens": prompt, "completion_tokens": num_completion_tokens,
            "total_tokens": prompt + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _collect(stream: RequestStream) -> _Result:
    result = _Result()
    parts: list[str] = []
    ids: list[int] = []
    async for delta in stream:
        parts.append(delta.text)
        ids.extend(delta.token_ids)
        if delta.output is not None:
            result.finished = read_output(delta.output)
    result.text, result.token_ids = "".join(parts), tuple(ids)
    return result


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(request: Request, stream: RequestStream) -> _Result | None:
    """All of a request's output, or None (the request aborted) if its client left."""
    collect = asyncio.ensure_future(_collect(stream))
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not collect.done()
        if gone:
            stream.abort()
            collect.cancel()
    return None if gone else collect.result()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. The caller owns the engine (and
    shuts it down after the HTTP server stopped)."""
    server = _Server(engine, model_name, api_key, metrics or ServerMetrics())
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None)
    app.state.kvtier = server

    def authorize(request: Request) -> None:
        if server.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
            raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer "
                           "<key>'", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        server.metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                             for e in exc.errors())
        return await api_error(request, APIError(400, f"invalid request: {problems}"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: "
                                                 f"{exc}", type_="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        try:
            snapshot, manager = await engine.call(lambda llm: (EngineSnapshot(
                llm.stats(lower_tiers=False), len(llm.scheduler.running),
                len(llm.scheduler.waiting)), llm.manager))
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None
        # The disk tier's figures read LMDB (disk reads when its pages are cold): on a worker
        # thread, so that a scrape never stalls an engine step.
        disk, remote = await asyncio.to_thread(manager.lower_tiers.stats)
        snapshot = replace(snapshot, stats=replace(snapshot.stats, disk=disk, remote=remote))
        return Response(server.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [server.card.to_dict()]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_ids = server.completion_prompt(body)
        stream = await server.submit(body, prompt_ids, request_id)
        created = int(time.time())

        def choice(text: str, token_ids: tuple[int, ...], reason: str | None,
                   stop_reason: Any = None) -> dict[str, Any]:
            entry: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": reason, "stop_reason": stop_reason}
            if body.return_token_ids:
                entry["token_ids"] = list(token_ids)
            return entry

        def response(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created,
                    "model": server.card.name, "choices": choices, **extra}

        if body.stream:
            return _streaming_response(server, "completions", stream, body, lambda d: (
                response([choice(d.text, d.token_ids, d.finish_reason, d.stop_reason)])),
                lambda usage_: response([], usage=usage_), first=None)
        result = await _collect_unless_gone(request, stream)
        if result is None:
            server.metrics.requests.labels("completions", "abort").inc()
            return Response(status_code=499)
        _observe(server, "completions", result)
        extra = {"prompt_token_ids": list(prompt_ids)} if body.return_token_ids else {}
        return JSONResponse(response(
            [choice(result.text, result.token_ids, _finish_reason(result))],
            usage=usage(result.finished, len(result.token_ids)), **extra))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt_ids = server.chat_prompt(body)
        stream = await server.submit(body, prompt_ids, request_id)
        created = int(time.time())

        def chunk(delta: dict[str, Any], reason: str | None, token_ids: tuple[int, ...] = (),
                  stop_reason: Any = None) -> dict[str, Any]:
            entry: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": reason, "stop_reason": stop_reason}
            if body.return_token_ids:
                entry["token_ids"] = list(token_ids)
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": server.card.name, "choices": [entry]}

        if body.stream:
            def usage_chunk(usage_: dict[str, Any]) -> dict[str, Any]:
                return {"id": request_id, "object": "chat.completion.chunk",
                        "created": created, "model": server.card.name, "choices": [],
                        "usage": usage_}

            return _streaming_response(
                server, "chat", stream, body,
                lambda d: chunk({"content": d.text} if d.text or not d.finished else {},
                                d.finish_reason, d.token_ids, d.stop_reason),
                usage_chunk, first=chunk({"role": "assistant", "content": ""}, None))
        result = await _collect_unless_gone(request, stream)
        if result is None:
            server.metrics.requests.labels("chat", "abort").inc()
            return Response(status_code=499)
        _observe(server, "chat", result)
        entry: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                         "content": result.text},
                                 "logprobs": None, "finish_reason": _finish_reason(result)}
        if body.return_token_ids:
            entry["token_ids"] = list(result.token_ids)
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                             "model": server.card.name, "choices": [entry],
                             "usage": usage(result.finished, len(result.token_ids))})

    return app


def _finish_reason(result: _Result) -> str | None:
    return result.finished.finish_reason if result.finished else None


def _observe(server: _Server, endpoint: str, result: _Result) -> None:
    if result.finished is not None:
        server.metrics.observe_finished(endpoint, result.finished, len(result.token_ids))


def _streaming_response(server: _Server, endpoint: str, stream: RequestStream, body: Any,
                        make_chunk: Any, make_usage_chunk: Any,
                        first: dict[str, Any] | None) -> StreamingResponse:
    """Server-sent events: one chunk per delta that carries something, an optional usage
    chunk, then `data: [DONE]`. Leaving early (the client disconnected) aborts."""

    async def events() -> AsyncIterator[str]:
        result = _Result()
        sent: list[int] = []
        finished = False
        try:
            if first is not None:
                yield _sse(first)
            async for delta in stream:
                sent.extend(delta.token_ids)
                if delta.output is not None:
                    result.finished = read_output(delta.output)
                if delta.text or delta.token_ids or delta.finished:
                    yield _sse(make_chunk(delta))
            finished = True
            result.token_ids = tuple(sent)
            _observe(server, endpoint, result)
            if body.include_usage:
                yield _sse(make_usage_chunk(usage(result.finished, len(sent))))
        except EngineClosedError as exc:
            yield _sse(APIError(503, str(exc), type_="server_unavailable").body())
        finally:
            if not finished:  # the client left (or the engine stopped): abort it
                stream.abort()
                server.metrics.requests.labels(endpoint, "abort").inc()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
