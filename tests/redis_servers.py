"""Real Redis servers for the remote-tier tests: one standalone server and 3-master clusters
on free loopback ports, started from the system's `redis-server` and stopped afterwards.

Fixtures (imported by tests/conftest.py):

- `redis_server`: one standalone server for the whole test run; tests keep apart by key prefix.
- `redis_cluster`: one 3-master cluster for the whole test run (`cluster_state:ok` before use).
- `redis_factory`: starts private servers / clusters for one test (faults: a node killed,
  maxmemory with noeviction), stopped at its end.

Tests that use them are skipped, saying how to install it, where `redis-server` is missing.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_START_TIMEOUT_S = 20.0
_MISSING = ("redis-server is not installed; install it with `apt-get install -y redis-server` "
            "(Debian/Ubuntu) to run the remote-tier tests")


def _free_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair found")


@dataclass(slots=True)
class RedisServer:
    """One `redis-server` process on 127.0.0.1:port, data and logs under `workdir`."""

    port: int
    workdir: Path
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--logfile", str(self.workdir / "redis.log"), "--protected-mode", "no",
                *self.extra_args]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while self.cli("PING") not in ("PONG", "NOAUTH Authentication required."):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        """Run one redis-cli command against this server; its stripped output ('' when the
        server does not answer)."""
        done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    def kill(self) -> None:
        """Kill -9: a node that stops answering without a goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass(slots=True)
class RedisCluster:
    """Three masters, no replicas, slots split by `redis-cli --cluster create`."""

    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        created = subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}"
                               f"{created.stderr}")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all("cluster_state:ok" in node.cli("CLUSTER", "INFO")
                      for node in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class RedisFactory:
    """Starts servers and clusters under `root`; `stop_all` ends every one of them."""

    def __init__(self, root: Path) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            pytest.skip(_MISSING)
        self.root = root
        self._started: list[RedisServer | RedisCluster] = []

    def server(self, *extra_args: str) -> RedisServer:
        port = _free_port()
        server = RedisServer(port, self.root / f"server-{port}", tuple(extra_args))
        self._started.append(server)
        server.start()
        return server

    def cluster(self, *extra_args: str) -> RedisCluster:
        cluster_args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                        "--cluster-require-full-coverage", "no")
        nodes = []
        for _ in range(3):
            port = _free_port()
            nodes.append(RedisServer(port, self.root / f"node-{port}",
                                     cluster_args + ("--cluster-config-file",
                                                     f"nodes-{port}.conf") + extra_args))
        cluster = RedisCluster(nodes)
        self._started.append(cluster)
        cluster.start()
        return cluster

    def stop_all(self) -> None:
        for started in reversed(self._started):
            started.stop()


@pytest.fixture(scope="session")
def _session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisFactory]:
    factory = RedisFactory(tmp_path_factory.mktemp("redis-session"))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def redis_server(_session_redis: RedisFactory) -> RedisServer:
    return _session_redis.server()


@pytest.fixture(scope="session")
def redis_cluster(_session_redis: RedisFactory) -> RedisCluster:
    return _session_redis.cluster()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[RedisFactory]:
    factory = RedisFactory(tmp_path / "redis")
    yield factory
    factory.stop_all()
