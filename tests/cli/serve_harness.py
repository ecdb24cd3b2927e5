"""A real `kvtier serve` app on a free loopback port, run by uvicorn in a thread.

The engine behind it is reachable from the test (`on_engine`), so tests can check the
pool's and the host tier's invariants on the engine thread after the clients are gone.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
import uvicorn
from kvtier.cli.server.app import build_app
from kvtier.cli.server.protocol import ServerLimits
from kvtier.engine.async_llm import AsyncLLM
from kvtier.engine.llm import LLM

MODEL_NAME = "smollm2-135m"
T = TypeVar("T")


@dataclass(slots=True)
class RunningServer:
    url: str
    engine: AsyncLLM
    server: uvicorn.Server
    thread: threading.Thread

    def on_engine(self, fn: Callable[[LLM], T]) -> T:
        """Run `fn(llm)` on the engine thread, between two steps."""
        return asyncio.run(self.engine.call(fn))

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Wait until the engine holds no request and no transfer is in flight."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.on_engine(_is_idle):
                return
            time.sleep(0.05)
        raise AssertionError(f"the engine is still busy after {timeout_s} s")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()


def _is_idle(llm: LLM) -> bool:
    llm.manager.poll()
    stats = llm.manager.stats()
    return not llm.has_unfinished() and not stats.num_jobs_in_flight \
        and not stats.num_loads_in_flight


def start_server(llm: LLM, api_key: str | None = None, max_num_requests: int = 256,
                 limits: ServerLimits | None = None) -> RunningServer:
    """Serve `llm` on 127.0.0.1 at a free port; returns once the server accepts requests."""
    engine = AsyncLLM(llm, max_num_requests=max_num_requests)
    app = build_app(engine, MODEL_NAME, api_key=api_key, limits=limits)
    # IPPROTO_TCP: connections then get TCP_NODELAY (see kvtier.cli.serve.bind).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", engine, server, thread)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def wait_for_pair(prefill_url: str, timeout_s: float) -> None:
    """Wait until the prefill instance at `prefill_url` lists the nccl transport: its
    torch.distributed pair forms in the background after start."""
    deadline = time.monotonic() + timeout_s
    while "nccl" not in httpx.get(f"{prefill_url}/v1/handoff/info").json()["transports"]:
        assert time.monotonic() < deadline, f"the pair did not form in {timeout_s:g} s"
        time.sleep(0.2)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def sse_events(lines: list[str]) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def at_once(calls: list[Callable[[], T]], timeout_s: float) -> list[T]:
    """Run each of `calls` on a thread of its own, all at once; their results in order
    (AssertionError naming a call that raised or did not return within `timeout_s`)."""
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    def run(k: int) -> None:
        try:
            results[k] = calls[k]()
        except BaseException as exc:  # noqa: BLE001 (reported below, on the test's thread)
            errors[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    for k in range(len(calls)):
        assert k not in errors, f"call {k} raised {errors[k]!r}"
        assert k in results, f"call {k} did not return within {timeout_s} s"
    return [results[k] for k in range(len(calls))]
