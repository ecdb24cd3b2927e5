"""Disk trouble under a serving engine stays in the disk tier (loopback server, SmolLM2 on
the CPU, a host tier small enough that blocks go to the disk).

- data.mdb truncated, removed, replaced or made unreadable while the server runs: no process
  death (a SIGBUS would end this test process), the answers stay those of the library with
  tiers off, and /metrics stops counting blocks that are gone.
- A frozen disk (every write, read and lookup of the tier blocks) stalls only the disk's
  own threads: while it is frozen, and a 10 MB body and a 200,000-message chat arrive over
  and over, /health answers in under a second (a liveness bound, not a benchmark) and the
  prompts are answered; released, the server goes on. Run with `-s`, the test prints the
  /health latency percentiles it saw (the issue's goal is p99 < 100 ms).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.loader import LoadedModel

from kvtier.tiers.disk.tier import DiskTier
from tests.cli.serve_harness import MODEL_NAME, RunningServer, start_server

PROMPTS = [f"Document {i}: " + " ".join(f"{w}{i}" for w in ("river", "stone", "leaf", "cloud")
                                         * 12) + " Summary:" for i in range(4)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def expected(model: LoadedModel) -> list[str]:
    with LLM(model, gpu_blocks=64, host_cache=False, disk_cache=False) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outputs]


def serving_llm(model: LoadedModel, disk_dir: Path) -> LLM:
    bytes_per_block = model.config.kv_layout(16, torch.float32).bytes_per_block
    return LLM(model, gpu_blocks=24, host_cache_gb=6 * bytes_per_block / 2**30,
               disk_cache=True, disk_cache_dir=disk_dir)


def ask(served: RunningServer, prompt: str, timeout: float = 120) -> str:
    response = httpx.post(f"{served.url}/v1/completions", timeout=timeout, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def environments(disk_dir: Path) -> list[Path]:
    """The directories holding a data.mdb: the tier's root, or each shard's (the engine
    splits a tier of its default budget over shards)."""
    return sorted(data.parent for data in disk_dir.glob("**/data.mdb"))


def damage(disk_dir: Path, case: str) -> None:
    """Do `case` to the data.mdb of every environment of the tier in `disk_dir`."""
    roots = environments(disk_dir)
    assert roots, f"no data.mdb under {disk_dir}"
    for root in roots:
        data = root / "data.mdb"
        if case == "truncate":
            os.truncate(data, 4096)
        elif case == "truncate-to-zero":
            os.truncate(data, 0)
        elif case == "remove":
            data.unlink()
        elif case == "replace":
            other = root / "other"
            other.write_bytes(b"\0" * 8192)
            os.replace(other, data)
        elif case == "permission":
            data.chmod(0)
        else:
            raise AssertionError(case)
    if case == "permission":
        for root in sorted(roots, key=lambda r: len(r.parts), reverse=True) + [disk_dir]:
            root.chmod(0)


def undo_permission(disk_dir: Path) -> None:
    disk_dir.chmod(0o700)
    for shard in disk_dir.glob("shard-*"):
        shard.chmod(0o700)
    for data in disk_dir.glob("**/data.mdb"):
        data.chmod(0o600)


@pytest.mark.parametrize("case", ["truncate", "truncate-to-zero", "remove", "replace",
                                  "permission"])
def test_data_file_events_under_a_serving_engine(model, expected, tmp_path, case) -> None:
    disk_dir = tmp_path / "kv"
    llm = serving_llm(model, disk_dir)
    served = start_server(llm)
    try:
        assert [ask(served, p) for p in PROMPTS] == expected
        served.wait_idle()
        assert served.metrics()["kvtier_disk_blocks"] > 0, "nothing reached the disk"
        damage(disk_dir, case)
        # Every prompt again (their prefixes were on disk), twice: first noticed, then served.
        for _ in range(2):
            assert [ask(served, p) for p in PROMPTS] == expected
        served.wait_idle()
        assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
        if case != "permission":  # the open file is intact: its blocks are still there
            assert served.metrics()["kvtier_disk_blocks"] == 0
            assert served.on_engine(lambda llm: llm.manager.disk.unavailable) is not None
    finally:
        if case == "permission":
            undo_permission(disk_dir)
        served.stop()
        llm.close()


def probe(http: httpx.Client) -> float:
    """Seconds /health took to answer 200 (on a kept-alive connection: a new client per
    probe would time its own TLS setup)."""
    start = time.perf_counter()
    assert http.get("/health").status_code == 200
    return time.perf_counter() - start


def percentiles(seconds: list[float]) -> str:
    ranked = sorted(seconds)
    return (f"{len(ranked)} probes, p50 {ranked[len(ranked) // 2] * 1e3:.1f} ms, "
            f"p99 {ranked[int(len(ranked) * 0.99)] * 1e3:.1f} ms, max {ranked[-1] * 1e3:.1f} ms")


class FrozenDisk(DiskTier):
    """A real disk tier whose every write, read and lookup waits while `frozen` is set
    (what a filesystem frozen under the process does to the threads that touch it)."""

    frozen = threading.Event()
    thawed = threading.Event()
    num_blocked = 0

    def _wait(self) -> None:
        if self.frozen.is_set():
            type(self).num_blocked += 1
            assert self.thawed.wait(timeout=300), "the test never thawed the disk"

    def __init__(self, *args, **kwargs) -> None:
        kwargs.pop("read_hook", None)
        super().__init__(*args, read_hook=lambda meta: self._wait(),
                         write_hook=lambda metas: self._wait(), **kwargs)

    def _contains_now(self, block_hashes):
        self._wait()
        return super()._contains_now(block_hashes)


@pytest.mark.timeout(600)
def test_a_frozen_disk_stalls_only_its_own_threads(model, expected, tmp_path,
                                                   monkeypatch) -> None:
    disk_class = type("Disk", (FrozenDisk,), {"frozen": threading.Event(),
                                              "thawed": threading.Event()})
    monkeypatch.setattr("kvtier.open_tiers.DiskTier", disk_class)
    llm = serving_llm(model, tmp_path / "kv")
    served = start_server(llm)
    try:
        assert [ask(served, p) for p in PROMPTS[:2]] == expected[:2]
        served.wait_idle()
        prober = httpx.Client(base_url=served.url, timeout=30)
        idle_s = [probe(prober) for _ in range(100)]  # the same machine, nothing in flight
        disk_class.frozen.set()
        health_s: list[float] = []
        answers: dict[int, str] = {}

        def client(i: int) -> None:
            answers[i] = ask(served, PROMPTS[i], timeout=300)

        abusive: list[int] = []

        def abuse() -> None:  # untrusted work in flight the whole time
            big = b"x" * (10 * 2**20)
            chat = json.dumps({"model": MODEL_NAME, "max_tokens": 1, "messages": [
                {"role": "user", "content": "hi"}] * 200_000}).encode()
            with httpx.Client(base_url=served.url, timeout=120) as http:
                while any(t.is_alive() for t in clients):
                    # Chunked, so the server reads it up to its limit before refusing it.
                    abusive.append(http.post("/v1/completions", content=iter(
                        [big[i:i + 2**20] for i in range(0, len(big), 2**20)])).status_code)
                    abusive.append(http.post("/v1/chat/completions",
                                             content=chat).status_code)

        # Prompts whose prefixes are on the frozen disk, and new ones whose blocks go there.
        clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for thread in clients:
            thread.start()
        abuser = threading.Thread(target=abuse)
        abuser.start()
        while any(t.is_alive() for t in clients) or len(health_s) < 200:
            health_s.append(probe(prober))
            time.sleep(0.02)
        for thread in clients + [abuser]:
            thread.join()
        prober.close()
        assert [answers[i] for i in range(4)] == expected
        assert disk_class.num_blocked > 0, "the disk was never touched while frozen"
        assert set(abusive) <= {400, 413} and abusive
        assert max(health_s) < 1.0, f"/health took {max(health_s):.2f} s"
        assert served.engine.is_running
        print(f"\n/health idle: {percentiles(idle_s)}; with the disk frozen and "
              f"{len(abusive)} abusive requests in flight: {percentiles(health_s)}")
    finally:
        disk_class.thawed.set()
    try:
        assert [ask(served, p) for p in PROMPTS] == expected
    finally:
        served.stop()
        llm.close()
        shutil.rmtree(tmp_path / "kv", ignore_errors=True)
