"""kvtier commands (`kvtier serve`, `kvtier router`) as processes on loopback ports: what
`kvtier bench disagg` starts, and the router's tests with it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class Process:
    """A kvtier command running on a loopback port, its output in a log file."""

    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (a graceful stop), SIGKILL if that takes longer than `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as a crash would end it."""
        self.proc.kill()
        self.proc.wait()


def launch(name: str, args: list[str], logs: Path, cache_dir: Path | None = None,
           num_threads: int | None = 1) -> Process:
    """Start `kvtier ARGS --port P` (P a free port), its output in `logs/NAME.log`;
    returns at once (see `wait_healthy`). num_threads: its OMP_NUM_THREADS (None: as
    inherited)."""
    port = free_port()
    env = dict(os.environ)
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    if cache_dir is not None:
        env["KVTIER_CACHE_DIR"] = str(cache_dir)
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", *args, "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return Process(name, proc, f"http://127.0.0.1:{port}", log)


def wait_healthy(processes: list[Process], timeout_s: float = 240.0) -> None:
    """Wait until every process answers /health with 200; RuntimeError with the output of
    one that exited or did not come up."""
    deadline = time.monotonic() + timeout_s
    waiting = list(processes)
    while waiting:
        process = waiting[0]
        if process.proc.poll() is not None:
            raise RuntimeError(f"{process.name} exited: {process.output()}")
        try:
            if httpx.get(f"{process.url}/health", timeout=2).status_code == 200:
                waiting.pop(0)
                continue
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} did not become healthy in {timeout_s} s: "
                                 f"{process.output()}")
        time.sleep(0.3)
