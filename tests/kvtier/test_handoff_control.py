"""The decode side's control verbs over HTTP (`HttpControl`) against a real HTTP server on
loopback: a call whose kept-alive connection the server drops unanswered is made once more
on a fresh one, and a server that cannot be reached is one ControlError."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from kvtier.cli.bench.cluster import free_port

from kvtier.handoff.control import ControlError, HttpControl

INFO = {"role": "decode", "model": "m", "transports": ["nccl"], "block_size": 16,
        "layout": "00"}


class _DroppingServer(ThreadingHTTPServer):
    """Answers the first request of each connection and keeps the connection open (HTTP/1.1,
    no `Connection: close`), then drops it at its next request without an answer: what a
    client sees when the server closes an idle connection just as the client reuses it."""

    daemon_threads = True

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.num_requests = 0

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.num_requests += 1
                server: _DroppingServer = self.server  # type: ignore[assignment]
                if self.num_requests > 1:
                    with server.lock:
                        server.dropped += 1
                    self.close_connection = True
                    return
                # Counted before the answer goes: the client may read it and the test
                # assert before this thread runs again.
                with server.lock:
                    server.answered += 1
                body = json.dumps(INFO).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def dropping() -> Iterator[_DroppingServer]:
    server = _DroppingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_call_whose_kept_alive_connection_is_dropped_is_made_again(
        dropping: _DroppingServer) -> None:
    url = f"http://127.0.0.1:{dropping.server_address[1]}"
    with httpx.Client() as client:
        control = HttpControl(url, 10.0, client=client)
        assert control.info() == INFO
        # The pooled connection is reused and dropped unanswered: the call goes again on
        # a new one (a commit lost so would leave an NCCL pair out of step).
        assert control.info() == INFO
    assert (dropping.answered, dropping.dropped) == (2, 1)


def test_a_decode_instance_that_cannot_be_reached_is_a_control_error() -> None:
    control = HttpControl(f"http://127.0.0.1:{free_port()}", 5.0)
    with pytest.raises(ControlError, match="cannot reach the decode instance") as error:
        control.info()
    assert error.value.status is None and not error.value.timed_out
    control.close()
