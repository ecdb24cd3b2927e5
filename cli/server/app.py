"""The OpenAI-compatible HTTP app of `kvtier serve` (FastAPI over an `AsyncLLM`).

Routes, as vLLM's server has them: POST /v1/completions and /v1/chat/completions (with
`stream: true` as server-sent events ending in `data: [DONE]`), GET /v1/models and
/v1/models/{id}, POST /tokenize and /detokenize, GET /health, /version and /metrics. With
an API key, /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` (401
otherwise).

Every error is an OpenAI-style JSON body `{"error": {"message", "type", "param", "code"}}`:
400 for a bad request, a field kvtier does not honour, a limit exceeded (`ServerLimits`) or
a prompt that cannot fit; 401; 404 for another model name or an unknown path; 405; 413 for
a body over the limit; 503 when the engine is full or shutting down; 500 when the engine
failed this request, or for anything unexpected (logged; the body never carries internal
text, and the connection stays usable). A stream that fails after it started ends with an
error event and `data: [DONE]`. A client that disconnects aborts its request.

Untrusted work stays off the event loop: the body is parsed and validated on a worker
thread, and prompts are tokenized and templated on a thread of their own, so /health and
the other requests are answered meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvtier.cli.server.handoff import HandoffService, add_handoff_routes
from kvtier.cli.server.metrics import EngineSnapshot, ServerMetrics
from kvtier.cli.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ServerLimits,
    TokenizeRequest,
    chat_messages,
    check_api_key,
    check_prompt_text,
    parse_body,
)
from kvtier.cli.server.responses import Result, chat_logprobs, completion_logprobs, usage
from kvtier.engine.async_llm import (
    AsyncLLM,
    EngineClosedError,
    EngineFullError,
    RequestFailedError,
    RequestStream,
)
from kvtier.engine.llm import LLM
from kvtier.engine.scheduler import BlockTap
from kvtier.engine.streaming import RequestDelta
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvtier.handoff.config import HandoffConfig

log = logging.getLogger("kvtier.serve")
T = TypeVar("T")

_SHUTTING_DOWN = "the server is shutting down; the request was aborted, retry it elsewhere"


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
                "owned_by": "kvtier", "root": self.name, "parent": None,
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "block_size": self.block_size}


class _Server:
    """The routes' shared state: the engine, the model's tokenizer, metrics, the key."""

    def __init__(self, engine: AsyncLLM, model_name: str, api_key: str | None,
                 metrics: ServerMetrics, limits: ServerLimits) -> None:
        llm: LLM = engine.llm
        self.engine = engine
        self.metrics = metrics
        self.api_key = api_key
        self.limits = limits
        # The engine thread decodes with the engine's tokenizer; requests are encoded with a
        # copy of it, on one thread of its own: no tokenizer object is used by two threads,
        # and a long prompt never holds up the event loop.
        self.tokenizer = copy.deepcopy(llm.tokenizer)
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tokenize")
        self.card = ModelCard(model_name, llm.max_model_len, llm.model_config.vocab_size,
                              llm.config.block_size, int(time.time()))
        #: The block tap of a request about to be submitted (the handoff's receiver).
        self.request_tap: Callable[[], BlockTap | None] = lambda: None

    async def tokenizing(self, fn: Callable[[], T]) -> T:
        """Run `fn` (tokenizer work) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn)

    async def read(self, request: Request, model: type[T]) -> T:
        """The request's body as `model`, checked against the limits; the JSON is decoded
        and validated on a worker thread."""
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.limits.max_body_bytes:
                raise _body_too_large(self.limits)
        return await asyncio.to_thread(self._parse, data, model)

    def _parse(self, data: bytes | bytearray, model: type[T]) -> T:
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        body = parse_body(model, raw, self.limits)
        check = getattr(body, "check_supported", None)
        if check is not None:
            check(self.limits)
        return body

    # ---- requests -> token ids -----------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.card.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.card.name!r}", type_="not_found_error", param="model",
                           code="model_not_found")

    def _require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", param=param)
        return self.tokenizer

    def check_prompt_ids(self, token_ids: list[int], param: str = "prompt") -> list[int]:
        if len(token_ids) >= self.card.max_model_len:
            raise APIError(400, f"the prompt has {len(token_ids)} tokens; the model's context "
                           f"is {self.card.max_model_len} and at least one token must be "
                           "generated; shorten the prompt", param=param)
        return token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (on the tokenizer's thread)."""
        tokenizer = self._require_tokenizer("prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt(self.limits)
        if isinstance(prompt, str):
            return self.check_prompt_ids(self.encode(prompt))
        return self.check_prompt_ids(list(prompt))

    def chat_prompt(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the chat template (tokenizer's thread)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.card.name} has no chat template; use "
                           "/v1/completions", param="messages")
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as exc:  # noqa: BLE001 (a template that rejects the conversation)
            raise APIError(400, "the chat template rejected the messages: "
                           f"{type(exc).__name__}", param="messages") from None
        if not isinstance(encoded, list):  # transformers 5 returns a BatchEncoding
            encoded = encoded["input_ids"]
        return self.check_prompt_ids(list(encoded), "messages")

    async def submit(self, body: Any, prompt_ids: list[int], request_id: str) -> RequestStream:
        params = body.sampling_params(default_max_tokens=self.card.max_model_len)
        try:
            return await self.engine.submit(prompt_ids, params, request_id=request_id,
                                            cache_salt=body.cache_salt,
                                            block_tap=self.request_tap())
        except EngineFullError as exc:
            raise APIError(503, str(exc), type_="server_busy", code="engine_full") from None
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None


def _body_too_large(limits: ServerLimits) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit max_body_bytes "
                    f"= {limits.max_body_bytes} (kvtier serve --max-body-bytes)",
                    code="limit_exceeded")


async def _collect(stream: RequestStream, num_completions: int) -> Result:
    result = Result.empty(num_completions)
    async for delta in stream:
        result.add(delta)
    return result


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T],
                      on_gone: Callable[[], None] | None = None) -> T | None:
    """The result of `work`, or None if the request's client left first: then `on_gone`
    runs (e.g. aborting the engine request) and `work` is cancelled. Raises what `work`
    raises."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not task.done()
        if gone:
            if on_gone is not None:
                on_gone()
            task.cancel()
    if gone:
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type_="internal_error", code="request_failed")
    return APIError(503, _SHUTTING_DOWN if isinstance(exc, EngineClosedError) else str(exc),
                    type_="server_unavailable")


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class _Guard:
    """The outermost layer of the app: a body whose declared size is over the limit gets a
    413 before it is read, and an unexpected exception becomes a 500 with no internal text
    (logged with its traceback) instead of reaching uvicorn, which would close the
    keep-alive connection and print an ASGI traceback."""

    def __init__(self, app: Any, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() \
                and int(declared) > self.limits.max_body_bytes:
            await self._answer(send, _body_too_large(self.limits), close=True)
            return
        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            log.debug("the client of %s %s left while sending its body", scope.get("method"),
                      scope.get("path"))
        except Exception:  # noqa: BLE001 (answered as a 500; the server goes on)
            incident = uuid.uuid4().hex[:12]
            log.exception("request %s %s failed (incident %s)", scope.get("method"),
                          scope.get("path"), incident)
            if not started:
                await self._answer(send, APIError(
                    500, f"internal server error (incident {incident}; details are in the "
                    "server's log)", type_="internal_error"))

    async def _answer(self, send: Any, error: APIError, close: bool = False) -> None:
        self.metrics.errors.labels(str(error.status)).inc()
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if close:  # the unread body stays on the connection
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None,
              limits: ServerLimits | None = None,
              handoff: HandoffService | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. The caller owns the engine (and
    shuts it down after the HTTP server stopped). `handoff`: the instance's role in
    prefill/decode disaggregation and its transports (`kvtier.cli.server.handoff`; None:
    role both, no transport), closed by the caller."""
    server = _Server(engine, model_name, api_key, metrics or ServerMetrics(),
                     limits or ServerLimits())
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvtier = server
    app.add_middleware(_Guard, limits=server.limits, metrics=server.metrics)

    def authorize(request: Request) -> None:
        check_api_key(request.headers.get("authorization", ""), server.api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        server.metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                             for e in exc.errors()[:5])
        return await api_error(request, APIError(400, f"invalid request: {problems}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no route {request.url.path}; this server serves "
                             "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                             "/detokenize, /health, /version, /metrics and /v1/handoff/*",
                             type_="not_found_error")
        elif exc.status_code == 405:
            error = APIError(405, f"{request.method} is not allowed on {request.url.path}",
                             type_="invalid_request_error")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        response = await api_error(request, error)
        response.headers.update(exc.headers or {})
        return response

    if handoff is None:
        handoff = HandoffService(engine, HandoffConfig(), api_key)
    app.state.handoff = handoff
    server.request_tap = handoff.request_tap
    add_handoff_routes(app, server, handoff, authorize)

    @app.get("/health")
    async def health() -> Response:
        failure = engine.failure
        if failure is not None:
            return JSONResponse({"status": "failed", "error": "the engine thread failed "
                                 f"({type(failure).__name__}); the server exits"},
                                status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        from kvtier import __version__
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_text() -> Response:
        try:
            snapshot, manager = await engine.call(lambda llm: (EngineSnapshot(
                llm.stats(lower_tiers=False), len(llm.scheduler.running),
                len(llm.scheduler.waiting), llm.restore_counts()), llm.manager))
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

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model_card(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return server.card.to_dict()

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await server.read(request, TokenizeRequest)
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if body.messages is not None:
            messages = chat_messages(body.messages, server.limits)
            token_ids = await server.tokenizing(
                lambda: server.chat_prompt(messages, body.add_generation_prompt))
        else:
            prompt = body.prompt
            check_prompt_text(prompt, server.limits)
            token_ids = await server.tokenizing(
                lambda: server.encode(prompt, body.add_special_tokens))
        strs = None
        if body.return_token_strs:
            strs = await server.tokenizing(
                lambda: server.tokenizer.convert_ids_to_tokens(token_ids))
        return {"count": len(token_ids), "max_model_len": server.card.max_model_len,
                "tokens": token_ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await server.read(request, DetokenizeRequest)
        server.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < server.card.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary [0, "
                           f"{server.card.vocab_size})", param="tokens")
        tokenizer = server._require_tokenizer("tokens")
        text = await server.tokenizing(lambda: tokenizer.decode(body.tokens))
        return {"prompt": text}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        body = await server.read(request, CompletionRequest)
        server.check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_ids = await server.tokenizing(lambda: server.completion_prompt(body))
        stream = await server.submit(body, prompt_ids, request_id)
        created = int(time.time())
        num = body.n or 1
        num_top = body.logprobs
        offsets = [0] * num  # where each completion's streamed text has got to

        def choice(index: int, text: str, token_ids: list[int] | tuple[int, ...],
                   logprobs: Any, reason: str | None, stop_reason: Any) -> dict[str, Any]:
            entry: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                     "finish_reason": reason, "stop_reason": stop_reason}
            if num_top is not None:
                entry["logprobs"] = completion_logprobs(token_ids, logprobs or (), num_top,
                                                        offsets[index])
                offsets[index] += len(text)
            if body.return_token_ids:
                entry["token_ids"] = list(token_ids)
            return entry

        def response(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created,
                    "model": server.card.name, "choices": choices, **extra}

        if body.stream:
            def delta_chunk(d: RequestDelta) -> dict[str, Any]:
                return response([choice(d.index, d.text, d.token_ids, d.logprobs,
                                        d.finish_reason, d.stop_reason)])

            return _streaming_response(server, "completions", stream, body, num,
                                       lambda d: [delta_chunk(d)],
                                       lambda usage_: response([], usage=usage_), first=None)
        result = await _finish(server, "completions", request, stream, num)
        if isinstance(result, Response):
            return result
        extra = {"prompt_token_ids": list(prompt_ids)} if body.return_token_ids else {}
        choices = [choice(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason,
                          c.stop_reason) for c in result.completions]
        return JSONResponse(response(choices, usage=usage(
            result.finished, result.num_completion_tokens), **extra))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        body = await server.read(request, ChatCompletionRequest)
        server.check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = body.chat_messages(server.limits)
        prompt_ids = await server.tokenizing(lambda: server.chat_prompt(messages))
        stream = await server.submit(body, prompt_ids, request_id)
        created = int(time.time())
        num = body.n or 1
        num_top = body.num_logprobs()

        def logprobs_of(token_ids: Any, logprobs: Any) -> dict[str, Any] | None:
            if num_top is None:
                return None
            return chat_logprobs(token_ids, logprobs or (), num_top)

        def chunk(index: int, delta: dict[str, Any], reason: str | None,
                  token_ids: tuple[int, ...] = (), logprobs: Any = None,
                  stop_reason: Any = None) -> dict[str, Any]:
            entry: dict[str, Any] = {"index": index, "delta": delta,
                                     "logprobs": logprobs_of(token_ids, logprobs),
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

            first = [chunk(i, {"role": "assistant", "content": ""}, None) for i in range(num)]
            return _streaming_response(
                server, "chat", stream, body, num,
                lambda d: [chunk(d.index, {"content": d.text} if d.text or not d.finished
                                 else {}, d.finish_reason, d.token_ids, d.logprobs,
                                 d.stop_reason)],
                usage_chunk, first=first)
        result = await _finish(server, "chat", request, stream, num)
        if isinstance(result, Response):
            return result
        choices = []
        for c in result.completions:
            entry: dict[str, Any] = {
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_of(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                entry["token_ids"] = list(c.token_ids)
            choices.append(entry)
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                             "model": server.card.name, "choices": choices,
                             "usage": usage(result.finished, result.num_completion_tokens)})

    return app


async def _finish(server: _Server, endpoint: str, request: Request, stream: RequestStream,
                  num_completions: int) -> Result | Response:
    """A non-streamed request's result, or the response that ends it early (its client
    left: 499; the server shuts down: 503; the engine failed it: 500)."""
    try:
        result = await unless_gone(request, _collect(stream, num_completions),
                                   on_gone=stream.abort)
    except (RequestFailedError, EngineClosedError) as exc:
        server.metrics.requests.labels(endpoint, "error").inc()
        raise _engine_error(exc) from None
    if result is None:
        server.metrics.requests.labels(endpoint, "abort").inc()
        return Response(status_code=499)
    if result.aborted:  # nobody but the shutdown aborts a request whose client is here
        server.metrics.requests.labels(endpoint, "abort").inc()
        raise APIError(503, _SHUTTING_DOWN, type_="server_unavailable")
    _observe(server, endpoint, result)
    return result


def _observe(server: _Server, endpoint: str, result: Result) -> None:
    if result.finished is not None:
        server.metrics.observe_finished(endpoint, result.finished,
                                        result.num_completion_tokens)


def _streaming_response(server: _Server, endpoint: str, stream: RequestStream, body: Any,
                        num_completions: int,
                        make_chunks: Callable[[RequestDelta], list[dict[str, Any]]],
                        make_usage_chunk: Callable[[dict[str, Any]], dict[str, Any]],
                        first: list[dict[str, Any]] | None) -> StreamingResponse:
    """Server-sent events: one chunk per delta that carries something, an optional usage
    chunk, then `data: [DONE]`. A request the engine failed, or the shutdown aborted, ends
    with an error event before `[DONE]`. Leaving early (the client disconnected) aborts."""

    async def events() -> AsyncIterator[str]:
        result = Result.empty(num_completions)
        finished = False
        try:
            for chunk in first or ():
                yield _sse(chunk)
            async for delta in stream:
                result.add(delta)
                if delta.finish_reason == "abort":
                    raise EngineClosedError(_SHUTTING_DOWN)
                if delta.text or delta.token_ids or delta.finished:
                    for chunk in make_chunks(delta):
                        yield _sse(chunk)
            finished = True
            _observe(server, endpoint, result)
            if body.include_usage:
                yield _sse(make_usage_chunk(usage(result.finished,
                                                  result.num_completion_tokens)))
        except (RequestFailedError, EngineClosedError) as exc:
            finished = True
            server.metrics.requests.labels(endpoint, "error").inc()
            yield _sse(_engine_error(exc).body())
        except Exception:  # noqa: BLE001 (the stream has started: end it with an error)
            finished = True
            log.exception("a %s stream failed", endpoint)
            yield _sse(APIError(500, "internal server error while streaming (details are in "
                                "the server's log)", type_="internal_error").body())
        finally:
            if not finished:  # the client left: abort it
                stream.abort()
                server.metrics.requests.labels(endpoint, "abort").inc()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
