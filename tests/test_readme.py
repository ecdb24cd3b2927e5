"""Every example in README.md runs as written (CPU, the default model, small budgets).

Code blocks tagged `python` run as scripts, blocks tagged `bash` run line by line as shell
commands, and `yaml` blocks whose first line is `# <file name>` are written to that file
first (the commands refer to it). Untagged blocks (install steps, diagrams) are not
examples to run. Everything runs in a temporary directory with a private kvtier cache.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.model_cache import seed_model_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: The address the README's client examples talk to (`kvtier serve --port 8000`).
_SERVER_URL = "http://127.0.0.1:8000"


def readme_blocks() -> list[tuple[str, str]]:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    return [(lang, body) for lang, body in _BLOCK.findall(text)]


def test_the_readme_has_examples_of_each_kind() -> None:
    languages = [lang for lang, _ in readme_blocks()]
    assert {"python", "bash", "yaml"} <= set(languages)


@pytest.mark.slow
def test_every_readme_example_runs(tmp_path: Path, smollm2_conversion: Path) -> None:
    cache = seed_model_cache(tmp_path / "kvtier-cache", smollm2_conversion)
    env = dict(os.environ, KVTIER_CACHE_DIR=str(cache))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    blocks = readme_blocks()
    for lang, body in blocks:  # files first: the commands name them
        first = body.splitlines()[0]
        if lang == "yaml" and first.startswith("# "):
            (tmp_path / first[2:].strip()).write_text(body)
    needs_server = any(_SERVER_URL in body for _, body in blocks)
    with _served(env, tmp_path) if needs_server else _no_server() as url:
        ran = _run_blocks(blocks, env, tmp_path, url)
    assert ran >= 5


def _run_blocks(blocks: list[tuple[str, str]], env: dict[str, str], cwd: Path,
                url: str | None) -> int:
    ran = 0
    for lang, body in blocks:
        if url is not None:  # the server runs on a free port, not on 8000
            body = body.replace(_SERVER_URL, url)
        if lang == "python":
            commands = [[sys.executable, "-c", body]]
        elif lang == "bash":
            commands = [["bash", "-c", line] for line in body.splitlines() if line.strip()]
        else:
            continue
        for command in commands:
            result = subprocess.run(command, cwd=cwd, env=env, capture_output=True,
                                    text=True, timeout=600, check=False)
            shown = command[-1]
            assert result.returncode == 0, f"{shown}\n{result.stderr[-3000:]}"
            assert result.stdout.strip(), f"{shown} printed nothing"
            assert "Traceback" not in result.stderr, shown
            ran += 1
    return ran


@contextmanager
def _no_server() -> Iterator[None]:
    yield None


@contextmanager
def _served(env: dict[str, str], cwd: Path) -> Iterator[str]:
    """`kvtier serve` as the README starts it (api key "secret"), on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
         "--api-key", "secret", "--device", "cpu", "--no-disk-cache"],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "kvtier serve did not come up in 300 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=120)
