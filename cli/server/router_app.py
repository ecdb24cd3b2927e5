"""The HTTP app of `kvtier router`: one OpenAI-compatible front over `kvtier serve` instances.

Disaggregated (prefill and decode instances): each completion or chat request goes to a
prefill instance's `POST /v1/handoff/prefill` with the client's body and the chosen decode
instance's URL; once the prefill instance answers that the prompt's KV blocks have landed,
the client's body goes unchanged to the decode instance, whose answer is relayed (a stream
event by event, as each arrives). Colocated (`both` instances): the whole request goes to
one instance. Instances are picked by fewest requests in flight (`instances.py`).

A prefill instance that holds `prefill_queue_limit` requests already (every one does, when
there are several) is not given another: the decode instance computes that prompt itself,
so that a burst past what the prefill GPUs serve spills onto the decode GPUs instead of
queueing (conditional disaggregation; off unless the limit is set).

Faults never cost a wrong token or a hang (every wait has a timeout setting):
- a prefill instance that errors, times out or cannot be reached: the next prefill instance
  is tried; when none is left the request goes straight to the decode instance, which then
  computes the prompt itself (a fallback, counted with its reason);
- a 4xx from a prefill instance (a bad request) goes back to the client unchanged;
- a decode instance that fails before the first byte of its answer: the next one is tried;
  once a stream has started, a failure ends it with an error event and `data: [DONE]`.

Errors are the server's (`APIError`'s OpenAI body, the same body-size guard); /metrics
counts requests, retries, fallbacks and the handoffs' bytes and seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvtier.cli.server.app import _Guard, _sse, unless_gone
from kvtier.cli.server.instances import Instance, InstancePool
from kvtier.cli.server.protocol import (
    CLIENT_KEEPALIVE_S,
    APIError,
    ServerLimits,
    check_api_key,
)
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvtier.router")

#: The response header carrying the prefill instance's handoff figures (JSON) and the
#: handoff's wall time at the router (`router_s`), or {"fallback": reason} when the decode
#: instance computed the prompt itself.
HANDOFF_HEADER = "x-kvtier-handoff"
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Seconds the router waits for a prefill answer beyond the `timeout_s` it gives the
#: prefill instance, so that the instance's own 504 arrives before the router gives up.
_PREFILL_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The router's timeouts (seconds) and options.

    connect_timeout_s: to open a connection to an instance. prefill_timeout_s: a whole
    handoff (prefill and transfer), given to the prefill instance as `timeout_s`.
    decode_timeout_s: for the first byte of a decode instance's answer and between two
    bytes of it (a non-streamed answer comes whole, so this bounds its generation).
    down_for_s: how long an instance that failed is passed over. transport: the handoff
    transport asked of prefill instances (None: the best both sides have).
    instance_api_key: sent to the instances as `Authorization: Bearer`.
    """

    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 60.0
    decode_timeout_s: float = 600.0
    down_for_s: float = 10.0
    transport: str | None = None
    instance_api_key: str | None = None
    prefill_queue_limit: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the router's {name} must be > 0 seconds, got "
                                 f"{getattr(self, name)}")
        if self.down_for_s < 0:
            raise ValueError(f"the router's down_for_s must be >= 0, got {self.down_for_s}")
        if self.prefill_queue_limit is not None and self.prefill_queue_limit < 1:
            raise ValueError("the router's prefill_queue_limit must be at least 1 request "
                             f"(None: no limit), got {self.prefill_queue_limit}")


class RouterMetrics:
    """The router's own registry: requests, retries, fallbacks, handoffs."""

    def __init__(self, instances: list[Instance]) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests", "Requests answered, by path and "
                                "outcome (ok, client_error, error, abort)",
                                ["path", "outcome"], registry=reg)
        self.retries = Counter("kvtier_router_retries", "Requests sent again to another "
                               "instance after one failed", ["part"], registry=reg)
        self.fallbacks = Counter("kvtier_router_fallbacks", "Requests sent to a decode "
                                 "instance without a handoff, by reason", ["reason"],
                                 registry=reg)
        self.handoffs = Counter("kvtier_router_handoffs", "Handoffs that completed",
                                registry=reg)
        self.handoff_bytes = Counter("kvtier_router_handoff_bytes", "Bytes the completed "
                                     "handoffs sent", registry=reg)
        self.handoff_seconds = Counter("kvtier_router_handoff_seconds", "Seconds of the "
                                       "completed handoffs, by phase, as the prefill "
                                       "instances report them", ["phase"], registry=reg)
        self.errors = Counter("kvtier_request_errors", "Requests answered with an error by "
                              "the router itself", ["status"], registry=reg)
        in_flight = Gauge("kvtier_router_in_flight", "Requests in flight on each instance",
                          ["part", "url"], registry=reg)
        for instance in instances:
            in_flight.labels(instance.part, instance.url).set_function(
                lambda i=instance: i.num_in_flight)


class _Failure(Exception):
    """An instance failed a request in a way another instance may not (retry elsewhere)."""

    def __init__(self, reason: str, error: APIError,
                 response: tuple[int, bytes, str] | None = None) -> None:
        super().__init__(error.message)
        self.reason = reason  # unreachable, timeout or error
        self.error = error
        self.response = response  # (status, body, content type) of an instance's 5xx


class _Router:
    """The routes' shared state: the pools, the HTTP client to the instances, metrics."""

    def __init__(self, pools: dict[str, InstancePool], cards: list[dict[str, Any]],
                 settings: RouterSettings, api_key: str | None,
                 client: httpx.AsyncClient) -> None:
        self.pools = pools
        self.cards = cards
        self.settings = settings
        self.api_key = api_key
        self.client = client
        self.disaggregated = "prefill" in pools
        self.decoders = pools["decode"] if self.disaggregated else pools["both"]
        self.metrics = RouterMetrics([i for p in pools.values() for i in p.instances])
        self.headers = {"content-type": "application/json"}
        if settings.instance_api_key:
            self.headers["authorization"] = f"Bearer {settings.instance_api_key}"

    def timeout(self, read_s: float) -> httpx.Timeout:
        return httpx.Timeout(read_s, connect=self.settings.connect_timeout_s)

    # ---- the prefill half --------------------------------------------------------------

    async def hand_off(self, path: str, body: dict[str, Any], decode: Instance
                       ) -> dict[str, Any] | Response:
        """Have a prefill instance compute the prompt and hand its KV to `decode`. Returns
        the handoff's figures, {"fallback": reason} when no prefill instance could, or the
        response to send back as it is (a prefill instance's 4xx)."""
        pool = self.pools["prefill"]
        limit = self.settings.prefill_queue_limit
        if limit is not None and (least := pool.least_loaded()).num_in_flight >= limit:
            # Every prefill instance is busy: the decode GPU computes this prompt now rather
            # than after the prompts queued ahead of it.
            log.debug("prefill instance %s holds %d requests: the decode instance computes "
                      "the prompt", least.url, least.num_in_flight)
            self.metrics.fallbacks.labels("busy").inc()
            return {"fallback": "busy"}
        payload = json.dumps({"endpoint": path, "request": body, "decode": decode.url,
                              "transport": self.settings.transport,
                              "timeout_s": self.settings.prefill_timeout_s}).encode()
        tried: list[Instance] = []
        reason = "unreachable"
        while (prefill := pool.pick(exclude=tried)) is not None:
            if tried:
                self.metrics.retries.labels("prefill").inc()
            tried.append(prefill)
            started = time.perf_counter()
            try:
                with pool.holding(prefill):
                    response = await self.client.post(
                        f"{prefill.url}/v1/handoff/prefill", content=payload,
                        headers=self.headers, timeout=self.timeout(
                            self.settings.prefill_timeout_s + _PREFILL_GRACE_S))
            except httpx.TimeoutException:
                reason = "timeout"
            except httpx.TransportError:
                reason = "unreachable"
            else:
                if response.status_code == 200:
                    pool.succeeded(prefill)
                    return self._handed_off(response, time.perf_counter() - started)
                if 400 <= response.status_code < 500:
                    return _relay(response.status_code, response.content,
                                  response.headers.get("content-type"))
                reason = "timeout" if response.status_code == 504 else "error"
                log.warning("prefill instance %s answered %d: %s", prefill.url,
                            response.status_code, response.text[:300])
            pool.failed(prefill)
        self.metrics.fallbacks.labels(reason).inc()
        return {"fallback": reason}

    def _handed_off(self, response: httpx.Response, elapsed_s: float) -> dict[str, Any]:
        """The prefill instance's figures, with `router_s`: the handoff's wall time as the
        router saw it (the HTTP round trips included)."""
        try:
            figures = dict(response.json())
            num_bytes = int(figures.get("bytes", 0))
        except (ValueError, TypeError, AttributeError):
            figures, num_bytes = {}, 0
        figures["router_s"] = elapsed_s
        self.metrics.handoffs.inc()
        self.metrics.handoff_bytes.inc(num_bytes)
        for phase in ("prefill", "transfer", "wait"):
            seconds = figures.get(f"{phase}_s")
            if isinstance(seconds, (int, float)) and seconds >= 0:
                self.metrics.handoff_seconds.labels(phase).inc(seconds)
        return figures

    # ---- the decode half ---------------------------------------------------------------

    async def open_decode(self, path: str, content: bytes, first: Instance
                          ) -> tuple[Instance, httpx.Response, _Stream | None]:
        """Send the client's body to `first` (then to the other decode instances while one
        fails before its first byte). Returns the instance, its open response, and its
        events with the first one read for a 200 stream (None otherwise: the caller reads
        the body). The
        instance is counted in flight until the caller closes the response. Raises
        `_Failure` when every instance failed."""
        pool = self.decoders
        tried: list[Instance] = []
        failure: _Failure | None = None
        instance: Instance | None = first
        while instance is not None:
            if tried:
                self.metrics.retries.labels("decode").inc()
            tried.append(instance)
            instance.num_in_flight += 1
            response = None
            try:
                request = self.client.build_request(
                    "POST", f"{instance.url}{path}", content=content, headers=self.headers,
                    timeout=self.timeout(self.settings.decode_timeout_s))
                response = await self.client.send(request, stream=True)
                if response.status_code >= 500:
                    body = await response.aread()
                    raise _Failure("error", APIError(
                        response.status_code, f"a decode instance answered "
                        f"{response.status_code}", type_="server_unavailable"),
                        (response.status_code, body, response.headers.get("content-type")))
                stream = None
                if response.status_code == 200 and _is_event_stream(response):
                    events = _events(response)
                    first_event = await anext(events, None)
                    if first_event is None:
                        raise _Failure("error", APIError(
                            502, "a decode instance closed its stream before any event",
                            type_="server_unavailable"))
                    stream = _Stream(first_event, events)
                pool.succeeded(instance)
                return instance, response, stream
            except (httpx.TransportError, _Failure) as exc:
                if response is not None:
                    await response.aclose()
                instance.num_in_flight -= 1
                failure = exc if isinstance(exc, _Failure) else _transport_failure(exc)
                log.warning("decode instance %s failed a request before answering (%s)",
                            instance.url, failure.reason)
                pool.failed(instance)
            except BaseException:
                if response is not None:
                    await response.aclose()
                instance.num_in_flight -= 1
                raise
            instance = pool.pick(exclude=tried)
        assert failure is not None
        raise failure


@dataclass(frozen=True, slots=True)
class _Stream:
    """A decode instance's event stream whose first event has been read."""

    first_event: bytes
    rest: AsyncIterator[bytes]


def _transport_failure(exc: httpx.TransportError) -> _Failure:
    if isinstance(exc, httpx.TimeoutException):
        return _Failure("timeout", APIError(504, "no decode instance answered in time "
                                            "(kvtier router --decode-timeout)",
                                            type_="server_unavailable", code="upstream_timeout"))
    return _Failure("unreachable", APIError(502, "no decode instance could be reached; retry "
                                            "later", type_="server_unavailable",
                                            code="upstream_unavailable"))


def _is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


async def _events(response: httpx.Response) -> AsyncIterator[bytes]:
    """The server-sent events of `response`, each whole (up to and with its blank line), as
    they arrive. A tail cut off by a failure is never yielded."""
    pending = b""
    async for chunk in response.aiter_raw():
        pending += chunk
        while (end := pending.find(b"\n\n")) >= 0:
            yield pending[:end + 2]
            pending = pending[end + 2:]


def _relay(status: int, body: bytes, content_type: str | None) -> Response:
    return Response(body, status_code=status, media_type=content_type or "application/json")


def build_router_app(pools: dict[str, InstancePool], cards: list[dict[str, Any]],
                     settings: RouterSettings, api_key: str | None = None) -> FastAPI:
    """The router's FastAPI app over `pools` ({"prefill", "decode"} or {"both"}), serving
    the model `cards` (/v1/models' data, as the instances answer it)."""
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64,
                                                   keepalive_expiry=CLIENT_KEEPALIVE_S))
    router = _Router(pools, cards, settings, api_key, client)
    app = FastAPI(title="kvtier router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    app.add_middleware(_Guard, limits=settings.limits, metrics=router.metrics)
    app.router.add_event_handler("shutdown", client.aclose)

    def authorize(request: Request) -> None:
        check_api_key(request.headers.get("authorization", ""), api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        router.metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"no route {request.url.path}; the router serves "
                             "/v1/completions, /v1/chat/completions, /v1/models, /health "
                             "and /metrics", type_="not_found_error")
        else:
            error = APIError(exc.status_code, str(exc.detail))
        return await api_error(request, error)

    @app.get("/health")
    async def health() -> JSONResponse:
        async def alive(instance: Instance) -> bool:
            try:
                answer = await client.get(f"{instance.url}/health",
                                          timeout=settings.connect_timeout_s)
                return answer.status_code == 200
            except httpx.TransportError:
                return False

        instances = [i for pool in pools.values() for i in pool.instances]
        states = await asyncio.gather(*(alive(i) for i in instances))
        listing = [{**i.to_dict(), "healthy": ok} for i, ok in zip(instances, states)]
        serving = any(ok for i, ok in zip(instances, states) if i.part in ("decode", "both"))
        status = "ok" if all(states) else "degraded" if serving else "unavailable"
        return JSONResponse({"status": status, "instances": listing},
                            status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(generate_latest(router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model_card(model_id: str) -> dict[str, Any]:
        for card in cards:
            if card.get("id") == model_id:
                return card
        raise APIError(404, f"the model {model_id!r} does not exist; this router serves "
                       f"{', '.join(repr(c.get('id')) for c in cards)}",
                       type_="not_found_error", param="model", code="model_not_found")

    async def generate(request: Request) -> Response:
        path = request.url.path
        content = await _read_body(request, settings.limits)
        body = await asyncio.to_thread(_parse_object, content)
        decode = router.decoders.pick()
        assert decode is not None, "a router has at least one decode instance"
        handoff: dict[str, Any] | None = None
        if router.disaggregated:
            # The handoff holds the decode instance's blocks for it: count it in flight.
            with router.decoders.holding(decode):
                outcome = await unless_gone(request, router.hand_off(path, body, decode))
            if outcome is None:
                router.metrics.requests.labels(path, "abort").inc()
                return Response(status_code=499)
            if isinstance(outcome, Response):
                router.metrics.requests.labels(path, "client_error").inc()
                return outcome
            handoff = outcome
        extra = {HANDOFF_HEADER: json.dumps(handoff, separators=(",", ":"))} if handoff \
            else {}
        try:
            opened = await unless_gone(request, router.open_decode(path, content, decode))
        except _Failure as failure:
            router.metrics.requests.labels(path, "error").inc()
            if failure.response is not None:
                return _relay(*failure.response)
            raise failure.error from None
        if opened is None:
            router.metrics.requests.labels(path, "abort").inc()
            return Response(status_code=499)
        instance, response, stream = opened
        if stream is None:  # a whole answer (JSON, or an error of any status)
            try:
                answer = await unless_gone(request, response.aread())
            except httpx.TransportError:
                router.metrics.requests.labels(path, "error").inc()
                raise APIError(502, "the decode instance failed while answering; retry the "
                               "request", type_="server_unavailable",
                               code="upstream_failed") from None
            finally:
                await response.aclose()
                instance.num_in_flight -= 1
            if answer is None:
                router.metrics.requests.labels(path, "abort").inc()
                return Response(status_code=499)
            outcome = "ok" if response.status_code < 400 else \
                "client_error" if response.status_code < 500 else "error"
            router.metrics.requests.labels(path, outcome).inc()
            return Response(answer, status_code=response.status_code, headers=extra,
                            media_type=response.headers.get("content-type"))
        return StreamingResponse(_relay_stream(router, path, instance, response, stream),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **extra})

    for path in _GENERATION_PATHS:
        app.add_api_route(path, generate, methods=["POST"], dependencies=[Depends(authorize)])
    return app


async def _relay_stream(router: _Router, path: str, instance: Instance,
                        response: httpx.Response, stream: _Stream) -> AsyncIterator[bytes]:
    """The decode instance's events as they arrive; a stream cut short (the instance died or
    went silent past --decode-timeout) ends with an error event and `data: [DONE]`. The
    client leaving closes the connection to the instance, which aborts the request there."""
    outcome = "abort"
    try:
        yield stream.first_event
        done = stream.first_event.startswith(b"data: [DONE]")
        try:
            async for event in stream.rest:
                yield event
                done = event.startswith(b"data: [DONE]")
        except httpx.TransportError as exc:
            log.warning("decode instance %s failed mid-stream: %s", instance.url,
                        type(exc).__name__)
            router.decoders.failed(instance)
        if done:
            outcome = "ok"
        else:
            outcome = "error"
            yield _sse(APIError(502, "the decode instance failed while streaming; the "
                                "answer is incomplete", type_="server_unavailable",
                                code="upstream_failed").body()).encode()
            yield b"data: [DONE]\n\n"
    finally:
        router.metrics.requests.labels(path, outcome).inc()
        instance.num_in_flight -= 1
        await response.aclose()


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limits.max_body_bytes:
            raise APIError(413, "the request body is larger than the router's limit "
                           f"max_body_bytes = {limits.max_body_bytes} (kvtier router "
                           "--max-body-bytes)", code="limit_exceeded")
    return bytes(data)


def _parse_object(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
