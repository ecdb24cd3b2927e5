"""`kvtier serve` as a process (loopback, SmolLM2 on the CPU): the API key, `kvtier bench
serve --url` against it, and a graceful SIGTERM that lets the streaming request in flight
finish and flushes the host tier to the disk tier before exiting with status 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from kvtier.cli.main import app
from kvtier.engine.loader import load_model
from typer.testing import CliRunner

from tests.cli.serve_harness import MODEL_NAME, parse_metrics, sse_events
from tests.model_cache import seed_model_cache

API_KEY = "test-key"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_conversion: Path) -> Path:
    """A private KVTIER_CACHE_DIR holding SmolLM2's conversion (the server process reuses it)."""
    cache = seed_model_cache(tmp_path_factory.mktemp("kvtier-cache"), smollm2_conversion)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVTIER_CACHE_DIR", str(cache))
        load_model("smollm2-135m", "cpu", "float32")
    return cache


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cache_dir: Path, disk: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, KVTIER_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--device", "cpu", "--dtype",
         "float32", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
         "--gpu-blocks", "96", "--host-cache-gb", "0.1", "--disk-cache", str(disk),
         "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvtier serve exited: {proc.communicate()[1][-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("kvtier serve did not become healthy in 180 s")


def test_serve_process_key_bench_and_graceful_shutdown(cache_dir, tmp_path) -> None:
    disk = tmp_path / "kv"
    proc, url = start(cache_dir, disk)
    try:
        # The API key guards /v1/*; /health and /metrics stay open.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        missing = httpx.get(f"{url}/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                               timeout=120)
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4,
            temperature=0)
        assert answer.usage.completion_tokens >= 1

        bench = CliRunner().invoke(app, [
            "bench", "serve", "--url", url, "--api-key", API_KEY, "--num-conversations", "4",
            "--num-rounds", "2", "--system-tokens", "32", "--user-tokens", "8",
            "--max-tokens", "4", "--json"])
        assert bench.exit_code == 0, bench.output
        report = json.loads(bench.stdout)
        assert report["num_requests"] == 8 and report["generated_tokens"] == 32
        assert report["ttft_s"]["n"] == 8 and report["ttft_s"]["p50"] > 0
        assert report["tpot_s"]["p99"] >= report["tpot_s"]["p50"] > 0
        assert report["throughput_tok_s"] > 0
        # Every request after a conversation's first shares the 2-block system prompt.
        assert report["cached_prompt_tokens"] >= 4 * 32

        metrics = parse_metrics(httpx.get(f"{url}/metrics").text)
        host_cached = metrics['kvtier_host_slots{state="cached"}']
        assert host_cached > 0

        # SIGTERM while a stream is in flight: it finishes, then the tiers are flushed.
        events: list[str] = []
        first_token = threading.Event()

        def stream() -> None:
            body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 24,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                for line in response.iter_lines():
                    events.extend(sse_events([line]))
                    first_token.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_token.wait(120)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read()
    assert "flushing" in stderr
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    stats = CliRunner().invoke(app, ["cache", "stats", "--dir", str(disk), "--json"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.stdout)["num_blocks"] >= host_cached


@pytest.mark.parametrize(("args", "message"), [
    (["--block-size", "0"], "block_size"),
    (["--port", "70000"], "--port must lie in"),
    (["--disk-cache", "/tmp/x", "--no-disk-cache"], "contradict"),
    (["--max-num-requests", "0"], "at least 1"),
])
def test_bad_options_fail_before_loading_the_model(args, message) -> None:
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 1
    assert message in result.output and result.output.startswith("error: ")


def test_serve_shares_the_disk_durability_option() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    assert "--disk-durable" in result.output and "--no-disk-durable" in result.output
