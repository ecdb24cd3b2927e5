"""The GPU runners under benchmarks/, checked on the CPU: each answers --help, and a dry run
(DRY_RUN=1: nothing runs, each command is written down) names only kvtier options, test
files and scripts that exist; benchmarks/summary.py prints a real bench result."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.cli.main import app
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
RUNNERS = sorted(path.name for path in (REPO / "benchmarks").glob("gpu_*.sh")
                 if path.name != "gpu_env.sh")
SUMMARY = REPO / "benchmarks" / "summary.py"


def _bash(runner: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "benchmarks" / runner), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=os.environ | {"PY": sys.executable} | env)


def test_every_runner_is_listed_in_the_readme():
    readme = (REPO / "benchmarks" / "README.md").read_text()
    assert RUNNERS == ["gpu_attention.sh", "gpu_determinism.sh", "gpu_disagg.sh",
                       "gpu_kernels.sh", "gpu_restore.sh", "gpu_suite.sh", "gpu_swap.sh"]
    for runner in RUNNERS:
        assert f"benchmarks/{runner}" in readme


@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_help_prints_its_usage(runner, tmp_path):
    result = _bash(runner, "--help", OUT=str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"bash benchmarks/{runner} [OUT_DIR]" in result.stdout
    assert not (tmp_path / "out").exists()  # --help makes nothing


def _dry_run(runner: str, out: Path, **env: str) -> list[list[str]]:
    result = _bash(runner, str(out), DRY_RUN="1", **env)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in (out / "commands.txt").read_text().splitlines()]


def _check_kvtier_options(args: list[str]) -> None:
    """Click parses every option before it acts on --help: an unknown or renamed option
    fails here, without the bench running."""
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, (args, result.output)


def test_the_option_check_catches_a_renamed_option():
    with pytest.raises(AssertionError):
        _check_kvtier_options(["bench", "swap", "--total-gib", "1"])


@pytest.mark.parametrize(("runner", "smoke"), [(name, "0") for name in RUNNERS]
                         + [("gpu_suite.sh", "1"), ("gpu_disagg.sh", "1")])
def test_dry_run_names_existing_options_and_files(runner, smoke, tmp_path):
    commands = _dry_run(runner, tmp_path / "out", SMOKE=smoke)
    kinds = []
    for command in commands:
        assert command[0] == sys.executable, command
        if command[1:3] == ["-m", "kvtier.cli.main"]:
            _check_kvtier_options(command[3:])
            kinds.append(command[3] + " " + command[4])
        elif command[1:3] == ["-m", "pytest"]:
            paths = [arg for arg in command[3:] if arg.startswith("tests")]
            assert paths and all((REPO / path).exists() for path in paths), command
            kinds.append("pytest")
        else:
            assert command[1:] == ["benchmarks/summary.py", str(tmp_path / "out")], command
            kinds.append("summary")
    assert kinds[-1] == "summary"  # every runner ends with its tables
    assert any(kind.startswith("bench ") for kind in kinds)


def test_the_disagg_runner_passes_the_threshold_and_the_queue_limit_when_set(tmp_path):
    commands = _dry_run("gpu_disagg.sh", tmp_path / "out", STAGES="goodput",
                        LONG_PREFILL_TOKEN_THRESHOLD="512", PREFILL_QUEUE_LIMIT="2")
    [goodput] = [c for c in commands if c[3:5] == ["bench", "disagg"]]
    assert "--serve-arg=--long-prefill-token-threshold=512" in goodput
    assert goodput[goodput.index("--prefill-queue-limit") + 1] == "2"
    _check_kvtier_options(goodput[3:])
    plain = _dry_run("gpu_disagg.sh", tmp_path / "plain", STAGES="goodput")
    assert not any("long-prefill" in arg or "queue-limit" in arg for c in plain for arg in c)


@pytest.mark.parametrize("smoke", ["0", "1"])
def test_the_disagg_runners_burst_keeps_the_logs_and_runs_only_when_named(smoke, tmp_path):
    out = tmp_path / "out"
    [burst] = [c for c in _dry_run("gpu_disagg.sh", out, STAGES="burst", SMOKE=smoke)
               if c[3:5] == ["bench", "disagg"]]
    assert burst[burst.index("--modes") + 1] == "disaggregated"
    assert burst[burst.index("--logs-dir") + 1] == str(out / "burst-logs")
    _check_kvtier_options(burst[3:])
    default = _dry_run("gpu_disagg.sh", tmp_path / "default")
    assert not any("--logs-dir" in c for c in default)


def test_stages_pick_what_runs(tmp_path):
    commands = _dry_run("gpu_restore.sh", tmp_path / "out", STAGES="serve")
    assert [command[3:5] for command in commands[:-1]] == [["bench", "serve"]]


def test_summary_prints_a_real_result_and_names_a_failed_stage(tmp_path):
    result = CliRunner().invoke(app, ["bench", "roundtrip", "--total-mib", "4", "--repeats",
                                      "1", "--device", "cpu", "--disk-dir",
                                      str(tmp_path / "disk"), "--json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    out.mkdir()
    (out / "roundtrip.json").write_text(result.stdout)
    (out / "longctx.json").write_text("")  # a stage that timed out
    (out / "env.log").write_text("not a result\n")
    summary = subprocess.run([sys.executable, str(SUMMARY), str(out)], capture_output=True,
                             text=True, timeout=120, env=os.environ | {"COLUMNS": "120"})
    assert summary.returncode == 0, summary.stderr
    assert "== roundtrip.json" in summary.stdout and "bench roundtrip" in summary.stdout
    assert "round trip vs ceiling" in summary.stdout
    assert "longctx.json: no result" in summary.stderr
    assert json.loads(result.stdout)["num_blocks"] == 2


def test_summary_finds_the_bench_by_the_results_own_name(tmp_path):
    """The runners name some results by their stage (`small_host.json` is a `bench longctx`
    result, `conversations.json` a `bench serve` one): the result's `bench` field picks the
    table, whatever the file is called."""
    result = CliRunner().invoke(app, ["bench", "diskread", "--gib", "0.01", "--threads", "1",
                                      "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    out.mkdir()
    (out / "small_host.json").write_text(result.stdout)
    summary = subprocess.run([sys.executable, str(SUMMARY), str(out)], capture_output=True,
                             text=True, timeout=120, env=os.environ | {"COLUMNS": "120"})
    assert summary.returncode == 0, summary.stderr
    assert "== small_host.json" in summary.stdout
    assert json.loads(result.stdout)["bench"] == "diskread"


def test_summary_of_an_empty_directory_fails(tmp_path):
    summary = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True,
                             text=True, timeout=120)
    assert summary.returncode == 1
    assert "no bench results" in summary.stderr
