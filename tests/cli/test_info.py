"""The `kvtier` command skeleton: --version, info, bench pool, and one-line errors."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvtier.cli.main import app
from kvtier.engine.attention import select_backend
from typer.testing import CliRunner

import kvtier

# A trace small enough to replay in well under a second.
TINY_BENCH = ["bench", "pool", "--num-requests", "30", "--prefix-len", "64",
              "--num-prefixes", "2", "--max-suffix-len", "40", "--num-blocks", "64",
              "--max-running", "4", "--repeats", "2", "--seed", "3"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_version(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"kvtier {kvtier.__version__}"


def test_info_table_names_every_package(runner):
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    for name in ("python", "torch", "triton", "transformers", "lmdb", "xxhash",
                 "nvidia-cudnn-frontend", "CUDA available", "flash-attn",
                 "attention backend (auto)", "default cache dir"):
        assert name in result.stdout
    assert torch.__version__ in result.stdout


def test_info_json(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "kv"))
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["kvtier"] == kvtier.__version__
    assert info["python"] == platform.python_version()
    assert info["packages"]["torch"] == torch.__version__
    assert set(info["packages"]) == {"torch", "triton", "transformers", "lmdb", "xxhash",
                                     "nvidia-cudnn-frontend"}
    assert info["cuda"]["available"] == torch.cuda.is_available()
    assert len(info["cuda"]["devices"]) == (torch.cuda.device_count()
                                            if torch.cuda.is_available() else 0)
    assert all(d["memory_bytes"] > 0 for d in info["cuda"]["devices"])
    assert isinstance(info["flash_attn"]["importable"], bool)
    assert info["attn_backend_auto"] == ("torch" if not torch.cuda.is_available()
                                         else select_backend("cuda", 16))
    assert info["default_cache_dir"] == str(tmp_path / "kv")


def test_bench_pool_json(runner):
    result = runner.invoke(app, [*TINY_BENCH, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"]["num_requests"] == 30
    assert report["num_tokens"] >= 30 * 65
    pool = report["pool"]
    assert pool["block_ops_per_s"] > 0 and pool["block_ops"] > 0
    assert len(pool["seconds"]) == 2
    # Requests share two prefixes, so most of their prefix blocks are hits.
    assert 0 < pool["hit_rate"] < 1
    for algorithm in ("xxh3_128", "sha256"):
        assert report["hashing"][algorithm]["tokens_per_s"] > 0
        assert len(report["hashing"][algorithm]["seconds"]) == 2


def test_bench_pool_is_reproducible_for_a_seed(runner):
    counts = []
    for _ in range(2):
        report = json.loads(runner.invoke(app, [*TINY_BENCH, "--json"]).stdout)
        counts.append((report["num_tokens"], report["pool"]["block_ops"],
                       report["pool"]["evictions"], report["pool"]["hit_rate"]))
    assert counts[0] == counts[1]


def test_bench_pool_table(runner):
    result = runner.invoke(app, TINY_BENCH)
    assert result.exit_code == 0, result.output
    assert "block ops / s" in result.stdout and "xxh3_128 tokens / s" in result.stdout


def test_bad_option_is_one_line_on_stderr(runner):
    # The longest request needs more blocks than the pool has.
    result = runner.invoke(app, ["bench", "pool", "--num-blocks", "2"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and "--num-blocks" in result.stderr
    assert "Traceback" not in result.output


def test_debug_lets_the_exception_through(runner):
    result = runner.invoke(app, ["--debug", "bench", "pool", "--num-blocks", "2"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ValueError)


def _kvtier_command() -> list[str]:
    script = Path(sys.executable).parent / "kvtier"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli.main"]


def test_installed_command_runs_in_a_subprocess():
    version = subprocess.run([*_kvtier_command(), "--version"], capture_output=True,
                             text=True, timeout=120, check=False)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"kvtier {kvtier.__version__}"

