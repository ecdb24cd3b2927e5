"""An asyncio front for `LLM`: the engine loop runs in one background thread.

    engine = AsyncLLM(llm)
    stream = await engine.submit(token_ids, SamplingParams(max_tokens=32))
    async for delta in stream:          # RequestDelta: new tokens, new text, finish reason
        ...
    engine.shutdown()

Only the engine thread touches the `LLM`: `submit`, `abort` and `call` post commands that it
runs between two steps, and it hands each step's deltas to the event loop of the caller
that submitted the request. Leaving a stream early (a client gone, a task cancelled) aborts
its request, so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.engine.block_taps import BlockTap
from kvtier.engine.llm import LLM
from kvtier.engine.sampler import SamplingParams
from kvtier.engine.streaming import RequestDelta

from kvtier.cuda_device import bind_thread

T = TypeVar("T")
log = logging.getLogger("kvtier.engine")

#: How long (seconds) the idle engine thread sleeps on its command queue between checks.
_IDLE_POLL_S = 0.05


class EngineFullError(RuntimeError):
    """The engine already holds its maximum number of requests; retry later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or its loop failed; no new request is taken."""


class RequestFailedError(RuntimeError):
    """A computation of this request failed in the engine (its message says which); the
    engine and the other requests go on."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue  # RequestDelta items, or an exception that ends the stream
    parent_id: str = ""
    failed: bool = False  # a completion failed: the others' deltas are dropped


class RequestStream:
    """The deltas of one request, as an async iterator that ends after the last completion's
    finishing delta (with n > 1 the completions' deltas interleave; `delta.index` says
    whose). A completion that fails raises RequestFailedError from the iterator.

    Closing it early (break, cancellation, `aclose`) aborts the request.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, deltas: asyncio.Queue,
                 num_completions: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self._deltas = deltas
        self._num_open = num_completions
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        try:
            while not self._done:
                item = await self._deltas.get()
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                if item.finished:
                    self._num_open -= 1
                    self._done = self._num_open == 0
                yield item
        finally:
            if not self._done:
                self.abort()

    def abort(self) -> None:
        """Abort the request (no-op once it finished). Never blocks."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncLLM:
    """Runs `llm` in a background thread and streams each request's deltas to asyncio.

    max_num_requests: requests held at once (queued, loading or running); `submit` raises
    EngineFullError beyond it. The `LLM` must not be used from other threads meanwhile.
    """

    def __init__(self, llm: LLM, max_num_requests: int = 256) -> None:
        if max_num_requests < 1:
            raise ValueError(f"max_num_requests must be at least 1, got {max_num_requests}")
        self.llm = llm
        self.max_num_requests = max_num_requests
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._ids = itertools.count()
        self._accepting = True
        self._failure: BaseException | None = None
        self._ended = threading.Event()  # the engine thread has returned
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side (any thread with a running event loop) ------------------------

    @property
    def is_running(self) -> bool:
        """False once shut down or after the engine loop failed."""
        return self._thread.is_alive() and self._failure is None

    @property
    def failure(self) -> BaseException | None:
        """The error that ended the engine thread (None while it runs or after a shutdown)."""
        return self._failure

    def wait_ended(self, timeout_s: float | None = None) -> bool:
        """Block until the engine thread has ended (shutdown or failure); False on timeout."""
        return self._ended.wait(timeout_s)

    @property
    def num_requests(self) -> int:
        """Engine requests (completions) held now (read without locking; for display)."""
        return len(self._streams)

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str | None = None,
                     cache_salt: str | None = None,
                     block_tap: BlockTap | None = None) -> RequestStream:
        """Queue a request given as token ids; returns its stream once the engine took it.
        `block_tap`: see `LLM.add_request` (it runs on the engine thread).

        Raises ValueError for a bad prompt or one that cannot fit (the engine's checks),
        EngineFullError when `max_num_requests` are held, EngineClosedError after shutdown.
        """
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        token_ids = list(prompt_token_ids)

        def add() -> str:
            if len(self._streams) >= self.max_num_requests:
                raise EngineFullError(f"the engine holds {len(self._streams)} requests, its "
                                      "maximum; retry later")
            added = self.llm.add_request(token_ids, params, request_id=rid,
                                         cache_salt=cache_salt, block_tap=block_tap)
            stream = _Stream(loop, deltas, added)
            for completion_id in self.llm.completion_ids(added):
                self._streams[completion_id] = stream
            return added

        added = await self.call_soon(add)
        return RequestStream(self, added, deltas, params.n)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, never blocks; unknown or finished ids are ignored)."""
        self._post(lambda: self.llm.abort(request_id))

    async def call(self, fn: Callable[[LLM], T]) -> T:
        """Run `fn(llm)` on the engine thread between two steps; return its result (or raise
        its exception). For consistent reads of engine state (stats, invariants)."""
        return await self.call_soon(lambda: fn(self.llm))

    def call_blocking(self, fn: Callable[[LLM], T], timeout_s: float | None = None) -> T:
        """`call` for a thread without an event loop: run `fn(llm)` on the engine thread and
        block until it returns (its exception is raised here). Raises EngineClosedError
        after shutdown, TimeoutError after `timeout_s`. Never call it on the engine thread."""
        if not self._accepting or not self.is_running:
            raise EngineClosedError("the engine is shutting down or stopped; no new work")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                if self._stopping.is_set():
                    raise EngineClosedError("the engine is shutting down; no new work")
                future.set_result(fn(self.llm))
            except Exception as exc:  # noqa: BLE001 (handed to the caller, who raises it)
                future.set_exception(exc)

        self._post(run)
        return future.result(timeout_s)

    def post(self, fn: Callable[[LLM], None]) -> None:
        """Run `fn(llm)` on the engine thread soon, without waiting (thread-safe; its
        errors are logged). Dropped once the engine thread has ended."""
        self._post(lambda: fn(self.llm))

    async def call_soon(self, fn: Callable[[], T]) -> T:
        if not self._accepting or not self.is_running:
            raise EngineClosedError("the engine is shutting down or stopped; no new work")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                if self._stopping.is_set():
                    raise EngineClosedError("the engine is shutting down; no new work")
                result = fn()
            except Exception as exc:  # noqa: BLE001 (handed to the caller, who raises it)
                _resolve(loop, future, exc, failed=True)
            else:
                _resolve(loop, future, result, failed=False)

        self._post(run)
        return await future

    def stop_accepting(self) -> None:
        """Refuse new requests (EngineClosedError); those in flight go on."""
        self._accepting = False

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop taking requests, abort those still in flight, and stop the engine thread
        (blocking, at most about `timeout_s`). The `LLM` is left open for its owner to
        close (which flushes the host tier to disk)."""
        self._accepting = False
        self._stopping.set()
        self._post(lambda: None)  # wake the thread
        self._thread.join(timeout_s)

    # ---- the engine thread ---------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    def _run(self) -> None:
        try:
            bind_thread(self.llm.manager.kv_cache.device)
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        try:
            while True:
                self._run_commands(block=not self.llm.has_unfinished())
                if self._stopping.is_set():
                    self._abort_all()
                    break
                if self.llm.has_unfinished():
                    self._deliver(self.llm.stream_step())
        except BaseException as exc:  # noqa: BLE001 (every waiting caller must hear of it)
            self._failure = exc
            self._fail_all(exc)
            raise

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # noqa: BLE001 (an abort of a broken request: log, go on)
                log.exception("an engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # added through the LLM directly, not through this front
            if delta.finished:
                del self._streams[delta.request_id]
            if stream.failed:
                continue
            if delta.error is not None:
                stream.failed = True
                self.llm.abort(stream.parent_id)  # its other completions, if any
                _put(stream, RequestFailedError(delta.error))
            else:
                _put(stream, delta)

    def _abort_all(self) -> None:
        """Abort every request and hand out their last deltas (finish reason "abort")."""
        for parent_id in {stream.parent_id for stream in self._streams.values()}:
            self.llm.abort(parent_id)
        while self._streams and self.llm.has_unfinished():
            self._deliver(self.llm.stream_step())
        self._fail_all(EngineClosedError("the engine shut down"))
        # Commands posted meanwhile (a submit racing the shutdown) fail, so no caller hangs.
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break

    def _fail_all(self, exc: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            _put(stream, exc)
        self._streams.clear()


def _put(stream: _Stream, item: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.deltas.put_nowait, item)
    except RuntimeError:
        pass  # the caller's event loop is closed: nobody is listening any more


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any,
             failed: bool) -> None:
    def settle() -> None:
        if future.done():
            return  # the caller was cancelled meanwhile
        if failed:
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
