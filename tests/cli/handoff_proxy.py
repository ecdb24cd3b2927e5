"""A proxy on loopback in front of a decode instance that ends or loses a handoff's commit:
the faults of the handoff tests, on the CPU (tests/cli/test_handoff.py) and between two GPUs
(tests/cli/test_handoff_two_gpus.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class EndingProxy:
    """The decode instance behind a proxy on loopback that, before forwarding the commit
    numbered `end_at` of a handoff, asks the decode instance to abort that handoff: the
    commit, and those after it, are answered 404 as for a reservation that expired
    mid-handoff (the decode side consumes their bytes first). With `lose`, that commit is
    answered 502 and never forwarded: a commit lost on its way, whose send the decode
    instance never receives."""

    def __init__(self, decode_url: str, end_at: int, lose: bool = False) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/internal/handoff/commit":
                    commit = json.loads(body)
                    if commit.get("part") == end_at:
                        proxy.ended.append(commit["handoff_id"])
                        if lose:
                            self.send_error(502)
                            return
                        httpx.post(f"{decode_url}/internal/handoff/abort",
                                   json={"handoff_id": commit["handoff_id"]}, timeout=30)
                answer = httpx.request(method, f"{decode_url}{self.path}", content=body,
                                       headers={"Content-Type": "application/json"},
                                       timeout=60)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._forward("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._forward("POST")

        self.ended: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> EndingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
