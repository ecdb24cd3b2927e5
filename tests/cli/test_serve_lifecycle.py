"""`kvtier serve`'s start and end, on real uvicorn servers (loopback) over SmolLM2 on the CPU.

- A busy port fails before the model is loaded, with a message saying what to do.
- A graceful shutdown that outlasts --shutdown-timeout ends the streams still running with
  an error event and `[DONE]` (not a cut connection).
- If the engine thread dies, /health says so and the server stops (the command then exits
  with status 1).
- Before serving, garbage is collected and what is alive frozen out of later collections.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import weakref

import httpx
import pytest
import uvicorn
from kvtier.cli.main import app
from kvtier.cli.serve import _exit_if_engine_fails, _server_class, settle_heap
from kvtier.cli.server.app import build_app
from kvtier.engine import LLM
from kvtier.engine.async_llm import AsyncLLM
from kvtier.engine.loader import LoadedModel
from typer.testing import CliRunner

from tests.cli.serve_harness import MODEL_NAME, sse_events, start_server


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = CliRunner().invoke(app, ["serve", "no-such-model-is-loaded", "--port",
                                          str(port), "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert f"port {port} on 127.0.0.1 is already in use" in result.output
    assert "--port" in result.output
    assert time.monotonic() - started < 60  # no model was looked for


def test_the_model_is_given_once() -> None:
    result = CliRunner().invoke(app, ["serve", "a-model", "--model", "another"])
    assert result.exit_code == 1 and "given twice" in result.output


class Abort(BaseException):
    """Ends the engine thread (what an unrecoverable engine failure does)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_reported_and_stops_the_server(model: LoadedModel) -> None:
    with LLM(model, gpu_blocks=32, host_cache=False, disk_cache=False) as llm:
        server = start_server(llm)
        watcher = threading.Thread(target=_exit_if_engine_fails,
                                   args=(server.engine, server.server), daemon=True)
        watcher.start()
        try:
            assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}

            def fail() -> None:
                raise Abort("injected")

            server.engine._post(fail)
            assert server.engine.wait_ended(30)
            watcher.join(30)
            server.thread.join(30)
            assert not server.thread.is_alive()  # the HTTP server stopped
            assert isinstance(server.engine.failure, Abort)
        finally:
            server.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_failed_engine(model: LoadedModel) -> None:
    with LLM(model, gpu_blocks=32, host_cache=False, disk_cache=False) as llm:
        server = start_server(llm)
        try:
            def fail() -> None:
                raise Abort("injected")

            server.engine._post(fail)
            assert server.engine.wait_ended(30)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
        finally:
            server.stop()


def test_streams_outlasting_the_shutdown_timeout_end_with_an_error(model: LoadedModel) -> None:
    with LLM(model, gpu_blocks=64, host_cache=False, disk_cache=False) as llm:
        engine = AsyncLLM(llm)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(engine, MODEL_NAME), log_level="warning",
                                timeout_graceful_shutdown=30)
        server = _server_class()(config, engine, 0.5)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        try:
            body = {"prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body,
                              timeout=120) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                server.should_exit = True  # what SIGTERM does
                events = [first.removeprefix("data: ")] + sse_events(list(lines))
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert "shutting down" in last["error"]["message"]
            assert len(events) < 2000
            thread.join(60)
            assert not thread.is_alive()
        finally:
            server.should_exit = True
            thread.join(30)
            engine.shutdown()


class _Node:
    """An object that can point at itself: a cycle only the collector frees."""

    me: _Node | None = None


def test_settling_the_heap_collects_the_garbage_then_freezes_what_is_alive() -> None:
    garbage = _Node()
    garbage.me = garbage
    freed = weakref.ref(garbage)
    del garbage
    try:
        settle_heap()
        assert freed() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > 0  # what is alive is left out of later collections
    finally:
        gc.unfreeze()  # this test process collects as before
