"""The handoff's side of `kvtier serve`: roles, endpoints and metrics
(`kvtier.handoff` is the library; the HTTP contract with the router is
`GET /v1/handoff/info` and `POST /v1/handoff/prefill`).

    GET  /v1/handoff/info            every instance: role, model, transports, block size,
                                     layout fingerprint
    POST /v1/handoff/prefill         prefill (or both): compute a request's prompt and hand
                                     its full blocks to the decode instance named
    POST /internal/handoff/reserve   decode (or both): the control verbs the prefill side
    POST /internal/handoff/commit    calls (`kvtier.handoff.control`); only the block bytes
    POST /internal/handoff/abort     go over the transport

The prefill endpoint answers 200 only once the decode instance has accepted every block
sent (placed where its prefix lookup finds them); 400 for a bad body (the OpenAI error
object), 503 when it cannot now (role decode, no common transport, engine full), 502 when
the decode instance refused or could not be reached or the transport failed, 504 when the
handoff ran out of `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import httpx
from fastapi import Depends, FastAPI, Request
from kvtier.cli.server.protocol import (
    CLIENT_KEEPALIVE_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from kvtier.engine.async_llm import AsyncLLM, EngineClosedError, EngineFullError
from kvtier.engine.block_taps import BlockTap
from kvtier.engine.sampler import SamplingParams
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.handoff.base import HandoffTransport, TransportError
from kvtier.handoff.config import PREFERENCE, HandoffConfig, open_transports
from kvtier.handoff.control import ControlError, HttpControl
from kvtier.handoff.placement import PoolPlacement
from kvtier.handoff.receiver import HandoffReceiver, UnknownHandoff
from kvtier.handoff.sender import HandoffFailed, PrefillHandoff
from kvtier.handoff.stats import HandoffCounters
from kvtier.handoff.torch_dist import TorchDistTransport
from kvtier.hashing import namespace_hash

log = logging.getLogger("kvtier.serve")
T = TypeVar("T")

#: Seconds between two sweeps of expired reservations and claimed holds.
_SWEEP_S = 0.2
_ENDPOINTS = {"/v1/completions": CompletionRequest,
              "/v1/chat/completions": ChatCompletionRequest}


class HandoffService:
    """One instance's handoff: its transports, its receiver (decode or both), and the
    prefill endpoint's work (prefill or both). `close` stops the sweeper and releases what
    is reserved; call it before the engine shuts down."""

    def __init__(self, engine: AsyncLLM, config: HandoffConfig, api_key: str | None) -> None:
        llm = engine.llm
        self.engine, self.config, self.api_key = engine, config, api_key
        self.layout = llm.layout
        self.block_size = llm.config.block_size
        self.counters = HandoffCounters()
        self.transports: dict[str, HandoffTransport] = open_transports(
            config, llm.layout, llm.manager.kv_cache.device)
        self.receiver: HandoffReceiver | None = None
        if config.receives and (config.mooncake_host or config.redis_url or config.nccl_init
                                or "cuda_ipc" in self.transports):
            def namespace(salt: str | None) -> bytes:
                return namespace_hash(llm.model_fingerprint, llm.layout,
                                      llm.config.hash_algorithm,
                                      salt if salt is not None else llm.config.cache_salt)

            self.receiver = HandoffReceiver(
                PoolPlacement(llm.manager), self._on_engine, namespace, self.block_size,
                llm.config.hash_algorithm, self.transports, config.timeout_s, config.hold_s,
                self.counters)
        #: The prefill side's one HTTP client to decode instances: its connections (one
        #: pool per decode instance) are kept from one handoff to the next. No cap on
        #: connections: a commit announcing a posted send must never queue for one behind
        #: other handoffs' calls, since the decode instance receives in send order and
        #: waits for it.
        self._http = httpx.Client(limits=httpx.Limits(max_connections=None,
                                                      max_keepalive_connections=32,
                                                      keepalive_expiry=CLIENT_KEEPALIVE_S))
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if self.receiver is not None:
            self._sweeper = threading.Thread(target=self._sweep, name="kvtier-handoff-sweep",
                                             daemon=True)
            self._sweeper.start()

    def _on_engine(self, fn: Any) -> Any:
        return self.engine.call_blocking(lambda _: fn(), timeout_s=60.0)

    def _sweep(self) -> None:
        assert self.receiver is not None
        while not self._stop.wait(_SWEEP_S):
            try:
                self.receiver.sweep()
            except EngineClosedError:
                return
            except Exception:  # noqa: BLE001 (logged; the next sweep tries again)
                log.exception("the handoff sweep failed")

    def request_tap(self) -> BlockTap | None:
        """The block tap of a request this instance is about to run (None: no handoff
        waits for its request): it tells the receiver which blocks the request took, so
        that a handoff's holds go back as soon as their request has its own references,
        however short it is (the sweep's own check sees only requests that outlive it)."""
        receiver, engine = self.receiver, self.engine
        if receiver is None or not receiver.num_awaited:
            return None

        def tap(first_index: int, metas: list, blocks: list) -> None:
            receiver.taken([meta.block_hash for meta in metas])
            engine.post(lambda llm: llm.manager.free(blocks))  # the tap's own references

        return tap

    def transport_names(self) -> list[str]:
        """What this instance can send or receive over now, fastest first."""
        names = []
        for name in PREFERENCE:
            transport = self.transports.get(name)
            if transport is None:
                continue
            can_send = self.config.sends and (name != "nccl" or transport.ready)
            can_receive = self.config.receives and transport.ready
            if can_send or can_receive:
                names.append(name)
        return names

    def info(self, model_name: str) -> dict[str, Any]:
        described = {name: transport.peer_info() for name, transport in self.transports.items()}
        return {"role": self.config.role, "model": model_name,
                "transports": self.transport_names(), "block_size": self.block_size,
                "layout": self.layout.fingerprint().hex(),
                "transport_info": {name: info for name, info in described.items()
                                   if info is not None}}

    def close(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(5)
        if self.receiver is not None:
            try:
                self.receiver.close()
            except Exception:  # noqa: BLE001 (the engine is gone: nothing left to hold)
                log.debug("closing the handoff receiver failed", exc_info=True)
        for transport in self.transports.values():
            transport.close()
        self._http.close()

    # ---- the prefill endpoint ------------------------------------------------------------

    async def prefill(self, server: Any, raw: Any, model_name: str) -> dict[str, Any]:
        """`POST /v1/handoff/prefill` (see the module docstring). Raises APIError."""
        if not self.config.sends:
            raise APIError(503, "this instance is --role decode; send handoffs to a prefill "
                           "instance", type_="server_unavailable", code="wrong_role")
        endpoint, request, decode_url, wanted, timeout_s = _check_prefill_body(raw)
        body = await asyncio.to_thread(parse_body, _ENDPOINTS[endpoint], request,
                                       server.limits)
        check = getattr(body, "check_supported", None)
        if check is not None:
            check(server.limits)
        server.check_model(body.model)
        if endpoint == "/v1/completions":
            prompt_ids = await server.tokenizing(lambda: server.completion_prompt(body))
        else:
            messages = body.chat_messages(server.limits)
            prompt_ids = await server.tokenizing(lambda: server.chat_prompt(messages))
        control = HttpControl(decode_url, timeout_s, self.api_key, client=self._http)
        engine = self.engine

        def release(blocks: list) -> None:
            if blocks:
                engine.post(lambda llm: llm.manager.free(blocks))

        handoff = PrefillHandoff(control, engine.llm.manager.kv_cache, release, self.counters,
                                 timeout_s)
        try:
            result, prefill_s = await self._run(handoff, control, wanted, prompt_ids,
                                                body.cache_salt, timeout_s)
        except HandoffFailed as exc:
            name = handoff.transport.name if handoff.transport is not None else wanted or "none"
            self.counters.add_handoff("prefill", name,
                                      "timeout" if exc.status == 504 else "failed")
            raise APIError(exc.status, str(exc), type_="handoff_error",
                           code="handoff_timeout" if exc.status == 504 else "handoff_failed"
                           ) from None
        finally:
            control.close()
        name = result.transport
        self.counters.add_handoff("prefill", name, "ok")
        return {"handoff_id": result.handoff_id, "transport": name,
                "prompt_tokens": len(prompt_ids), "blocks_total": result.blocks_total,
                "blocks_sent": result.blocks_sent, "blocks_skipped": result.blocks_skipped,
                "bytes": result.bytes, "prefill_s": prefill_s,
                "transfer_s": result.transfer_s, "wait_s": result.wait_s,
                "phases_s": result.phases, "groups": result.num_groups,
                "wire_s": result.wire_s}

    def _choose(self, wanted: str | None, info: dict[str, Any]) -> list[str]:
        """The transports to reserve over, in turn: `wanted` alone, else every one both
        instances have, fastest first."""
        theirs = info.get("transports") if isinstance(info, dict) else None
        if not isinstance(theirs, list):
            raise HandoffFailed("the decode instance's /v1/handoff/info has no transports")
        if info.get("block_size") != self.block_size \
                or info.get("layout") != self.layout.fingerprint().hex():
            raise HandoffFailed(f"the decode instance's KV layout differs from this one's "
                                f"(block_size {info.get('block_size')} vs {self.block_size}, "
                                "or another model or dtype): its blocks cannot be handed over")
        ours = self.transport_names()
        if wanted is not None:
            if wanted not in ours or wanted not in theirs:
                raise APIError(503, f"transport {wanted!r} is not available on both "
                               f"instances (this one: {ours}, the decode instance: {theirs})",
                               type_="server_unavailable", code="transport_unavailable")
            return [wanted]
        described = info.get("transport_info")
        described = described if isinstance(described, dict) else {}
        # A transport both have that cannot reach that instance (CUDA IPC to a GPU of
        # another host) is left out.
        common = [name for name in ours if name in theirs
                  and self.transports[name].reaches(described.get(name))]
        if not common:
            raise APIError(503, f"no transport both instances support (this one: {ours}, "
                           f"the decode instance: {theirs})", type_="server_unavailable",
                           code="transport_unavailable")
        return common

    async def _reserve(self, control: HttpControl, wanted: str | None,
                       prompt_ids: list[int], cache_salt: str | None
                       ) -> tuple[HandoffTransport, Any]:
        """The decode instance's info, the transport chosen and its reservation (the calls
        on one worker thread: one hop off the event loop, not several). A transport that
        has no room now at the decode instance (503: its receive slots all lent) gives way
        to the next one both have, unless the request named it."""
        def reserve() -> tuple[HandoffTransport, Any]:
            *earlier, last = self._choose(wanted, control.info())
            for name in earlier:
                try:
                    return self.transports[name], control.reserve(prompt_ids, cache_salt,
                                                                  name)
                except ControlError as exc:
                    if exc.status != 503:
                        raise
                    log.info("handoff over %s refused for now (%s); trying the next "
                             "transport", name, exc)
            return self.transports[last], control.reserve(prompt_ids, cache_salt, last)

        return await _control(reserve)

    async def _run(self, handoff: PrefillHandoff, control: HttpControl, wanted: str | None,
                   prompt_ids: list[int], cache_salt: str | None,
                   timeout_s: float) -> tuple[Any, float]:
        """Prefill `prompt_ids` with `handoff` tapping its blocks; (result, prefill_s: from
        the engine's start to the prompt's end). The prefill starts first and the
        reservation is made while it computes (its first blocks wait in the handoff's queue
        meanwhile): the two control round trips to the decode instance are off the
        request's path whenever the prefill takes longer."""
        engine = self.engine
        began = time.monotonic()
        stream = None
        prefill: asyncio.Future | None = None
        pump: asyncio.Future | None = None
        try:
            try:
                stream = await engine.submit(prompt_ids, SamplingParams(max_tokens=1),
                                             request_id=f"handoff-{uuid.uuid4().hex}",
                                             cache_salt=cache_salt, block_tap=handoff.tap)
            except (EngineFullError, EngineClosedError) as exc:
                raise APIError(503, str(exc), type_="server_unavailable") from None
            except ValueError as exc:  # a prompt this engine cannot hold (its block budget)
                raise APIError(400, str(exc), param="prompt") from None

            async def drain(stream: Any) -> float:
                async for _ in stream:
                    pass
                handoff.prompt_done()
                return time.monotonic()

            prefill = asyncio.ensure_future(drain(stream))
            transport, reservation = await self._reserve(control, wanted, prompt_ids,
                                                         cache_salt)
            try:
                handoff.start(transport, reservation)
            except (KeyError, TypeError, ValueError, TransportError) as exc:
                if isinstance(reservation, dict):
                    await asyncio.to_thread(control.abort,
                                            str(reservation.get("handoff_id", "")))
                raise HandoffFailed(f"cannot use the decode instance's reservation: "
                                    f"{exc}") from exc
            pump = _on_own_thread(handoff.pump, "kvtier-handoff-pump")
            ended = await asyncio.wait_for(
                prefill, max(0.0, timeout_s - (time.monotonic() - began)))
        except asyncio.TimeoutError:
            handoff.cancel()  # the pump fails with a 504
            if pump is None:
                raise HandoffFailed("the handoff ran out of time", 504) from None
            ended = time.monotonic()
        except BaseException:
            handoff.cancel()
            if prefill is not None and not prefill.done():
                prefill.cancel()
            await asyncio.gather(*(f for f in (prefill, pump) if f is not None),
                                 return_exceptions=True)
            raise
        finally:
            if stream is not None:
                stream.abort()
            if pump is None:
                handoff.discard()
        return await pump, ended - began

    # ---- the decode side's internal endpoints --------------------------------------------

    def _require_receiver(self) -> HandoffReceiver:
        if self.receiver is None:
            raise APIError(503, f"this instance (--role {self.config.role}) receives no "
                           "handoffs", type_="server_unavailable", code="wrong_role")
        return self.receiver

    async def reserve(self, raw: Any) -> dict[str, Any]:
        receiver = self._require_receiver()
        if not isinstance(raw, dict) or not isinstance(raw.get("token_ids"), list) \
                or not isinstance(raw.get("transport"), str) \
                or not isinstance(raw.get("cache_salt"), (str, type(None))):
            raise APIError(400, "reserve needs token_ids (a list), transport (a string) and "
                           "cache_salt (a string or null)")
        try:
            return await asyncio.to_thread(receiver.reserve, raw["token_ids"],
                                           raw["cache_salt"], raw["transport"])
        except (TypeError, ValueError) as exc:
            status = 503 if "does not receive" in str(exc) else 400
            raise APIError(status, str(exc)) from None
        except TransportError as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None

    async def commit(self, raw: Any) -> dict[str, Any]:
        receiver = self._require_receiver()
        if not isinstance(raw, dict) or not isinstance(raw.get("handoff_id"), str) \
                or not isinstance(raw.get("blocks"), list) \
                or not all(isinstance(b, dict) for b in raw["blocks"]) \
                or not isinstance(raw.get("last"), bool):
            raise APIError(400, "commit needs handoff_id, blocks (a list of objects) and last")
        transport = raw.get("transport") if isinstance(raw.get("transport"), str) else None
        part = raw.get("part")
        if part is not None and (not isinstance(part, int) or isinstance(part, bool)
                                 or part < 0):
            raise APIError(400, f"a commit's part must be an integer >= 0 or null, got "
                                f"{part!r}")
        try:
            # A thread of its own: a commit may wait up to the handoff timeout for the
            # commits and sends before it, and waiting ones on the default executor (cores
            # + 4 threads) left the commit they waited for queued behind them until they
            # timed out, and the NCCL pair out of step (under a burst of handoffs).
            return await _on_own_thread(
                partial(receiver.commit, raw["handoff_id"], raw["blocks"], raw["last"],
                        transport, part), "kvtier-handoff-commit")
        except UnknownHandoff:
            raise APIError(404, f"no handoff {raw['handoff_id']} here (never reserved, "
                           "expired or ended)", type_="not_found_error") from None
        except (TypeError, ValueError, KeyError) as exc:
            raise APIError(400, f"bad commit: {exc}") from None
        except (TransportError, EngineClosedError) as exc:
            raise APIError(503, str(exc), type_="server_unavailable") from None

    async def abort(self, raw: Any) -> dict[str, Any]:
        receiver = self._require_receiver()
        if not isinstance(raw, dict) or not isinstance(raw.get("handoff_id"), str):
            raise APIError(400, "abort needs handoff_id")
        try:
            await asyncio.to_thread(receiver.abort, raw["handoff_id"])
        except UnknownHandoff:
            pass
        return {}


def _on_own_thread(fn: Callable[[], T], name: str) -> asyncio.Future:
    """A future of `fn()` run on a thread of its own. For work that blocks as long as a
    handoff lasts (the pump) or waits for other calls (a commit waiting for its turn): on
    the default executor (cores + 4 threads) a few of those would leave the short calls
    (control, JSON, tokenizing) of every other request, or the very call they wait for,
    queued behind them."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as error:  # noqa: BLE001 (handed to the awaiting caller)
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the event loop is closed: nobody awaits it any more

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def _control(fn: Any, *args: Any) -> Any:
    """A control call on a worker thread; its ControlError as HandoffFailed."""
    try:
        return await asyncio.to_thread(fn, *args)
    except ControlError as exc:
        raise HandoffFailed(f"the decode instance: {exc}",
                            504 if exc.timed_out else 502) from None


def _check_prefill_body(raw: Any) -> tuple[str, dict, str, str | None, float]:
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    endpoint, request = raw.get("endpoint"), raw.get("request")
    if endpoint not in _ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {sorted(_ENDPOINTS)}", param="endpoint")
    if not isinstance(request, dict):
        raise APIError(400, "request must be the client's request body (an object)",
                       param="request")
    decode = raw.get("decode")
    if not isinstance(decode, str) or not decode.startswith(("http://", "https://")):
        raise APIError(400, "decode must be the decode instance's base URL (http://host:port)",
                       param="decode")
    transport = raw.get("transport")
    if transport is not None and transport not in PREFERENCE:
        raise APIError(400, f"transport must be one of {list(PREFERENCE)} or null",
                       param="transport")
    timeout_s = raw.get("timeout_s", 30.0)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 < timeout_s <= 3600:
        raise APIError(400, "timeout_s must be a number of seconds in (0, 3600]",
                       param="timeout_s")
    return endpoint, request, decode, transport, float(timeout_s)


class HandoffCollector(Collector):
    """The handoff counters in /metrics (names in `kvtier.handoff.stats`), and the state
    of the torch.distributed pair where there is one:

        kvtier_handoff_pair_ready        1 while handoffs can go over the pair, else 0
        kvtier_handoff_pair_generation   its generation: how often it formed again since
                                         the prefill instance started (after breaks, or
                                         a new decode instance)
        kvtier_handoff_pair_landed       decode side: sends received ahead of their
                                         commits and not taken yet (one that stays up
                                         says commits are being lost)
    """

    def __init__(self, counters: HandoffCounters,
                 transports: dict[str, HandoffTransport]) -> None:
        self.counters = counters
        pair = transports.get("nccl")
        self.pair = pair if isinstance(pair, TorchDistTransport) else None

    def collect(self) -> Iterator[Metric]:
        stats = self.counters.snapshot()
        handoffs = CounterMetricFamily("kvtier_handoffs", "KV handoffs by outcome",
                                       labels=["role", "transport", "outcome"])
        for labels, value in sorted(stats.handoffs.items()):
            handoffs.add_metric(list(labels), value)
        moved = CounterMetricFamily("kvtier_handoff_bytes", "KV block bytes handed over",
                                    labels=["role", "transport"])
        for labels, value in sorted(stats.bytes.items()):
            moved.add_metric(list(labels), value)
        blocks = CounterMetricFamily("kvtier_handoff_blocks", "KV blocks of handoffs",
                                     labels=["role", "transport", "kind"])
        for labels, value in sorted(stats.blocks.items()):
            blocks.add_metric(list(labels), value)
        yield from (handoffs, moved, blocks)
        if self.pair is not None:
            yield GaugeMetricFamily("kvtier_handoff_pair_ready", "Whether handoffs can go "
                                    "over the torch.distributed pair now",
                                    value=int(self.pair.ready))
            yield GaugeMetricFamily("kvtier_handoff_pair_generation", "How often the "
                                    "torch.distributed pair formed again since its prefill "
                                    "instance started", value=self.pair.generation or 0)
            yield GaugeMetricFamily("kvtier_handoff_pair_landed", "Sends received over the "
                                    "torch.distributed pair ahead of their commits and not "
                                    "taken yet", value=self.pair.landed_ahead)


def add_handoff_routes(app: FastAPI, server: Any, service: HandoffService,
                       authorize: Any) -> None:
    """The handoff's routes on `app` (see the module docstring)."""
    server.metrics.registry.register(HandoffCollector(service.counters,
                                                        service.transports))

    async def read_json(request: Request) -> Any:
        import json

        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > server.limits.max_body_bytes:
                raise APIError(413, "the request body is larger than the server's limit "
                               "max_body_bytes", code="limit_exceeded")
        try:
            return await asyncio.to_thread(json.loads, data)
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None

    @app.get("/v1/handoff/info", dependencies=[Depends(authorize)])
    async def handoff_info() -> dict[str, Any]:
        return service.info(server.card.name)

    @app.post("/v1/handoff/prefill", dependencies=[Depends(authorize)])
    async def handoff_prefill(request: Request) -> dict[str, Any]:
        return await service.prefill(server, await read_json(request), server.card.name)

    @app.post("/internal/handoff/reserve", dependencies=[Depends(authorize)])
    async def handoff_reserve(request: Request) -> dict[str, Any]:
        return await service.reserve(await read_json(request))

    @app.post("/internal/handoff/commit", dependencies=[Depends(authorize)])
    async def handoff_commit(request: Request) -> dict[str, Any]:
        return await service.commit(await read_json(request))

    @app.post("/internal/handoff/abort", dependencies=[Depends(authorize)])
    async def handoff_abort(request: Request) -> dict[str, Any]:
        return await service.abort(await read_json(request))
