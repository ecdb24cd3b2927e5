"""A damaged disk tier never stops `kvtier generate` or `LLM.generate`.

A tiny chat model (random weights, byte tokenizer) fills a disk tier once per module; the
tier is compacted, so every page of its file is live, and it holds enough blocks for branch
pages. Each case damages a copy (a leaf, branch or meta page, the first or second page, the
file's length, its kind, lock.mdb) and runs both the command, as a real process with a time
limit, and the library: both must answer exactly what a tiers-off engine answers, warn, and
leave the damaged files moved aside next to the cache directory. `kvtier cache verify`
reports the same damage and `--repair` moves it aside.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from kvtier.cli.bench.damage import run_damage_soak
from kvtier.cli.bench.damage_cases import DAMAGES, P_BRANCH, copy_cache, page_kinds
from kvtier.cli.main import app
from kvtier.engine import LLM, SamplingParams
from typer.testing import CliRunner

from tests.cli.chat_model import save_chat_model

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 8
PROMPT_CHARS = 480  # 30 blocks of 16 byte tokens each: 240 blocks, several leaf pages
PARAMS = SamplingParams(max_tokens=4)
# restore_min_saving_s 0: these short prompts compute sooner than a read must save by
# default, and what is tested is what the reads find.
ENGINE = dict(device="cpu", gpu_blocks=64, host_cache_gb=0.001, disk_cache_gb=0.05,
              restore_min_saving_s=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rng = random.Random(18)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PROMPT_CHARS))
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:
    with LLM(str(model_dir), device="cpu", gpu_blocks=256, host_cache=False,
             disk_cache=False) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def pristine(model_dir, prompts, tmp_path_factory) -> Path:
    """A compacted disk tier holding every full block of `prompts`."""
    filled = tmp_path_factory.mktemp("filled") / "kv"
    with LLM(str(model_dir), disk_cache_dir=filled, **ENGINE) as llm:
        for prompt in prompts:
            llm.generate([prompt], PARAMS)
    compact = tmp_path_factory.mktemp("compact") / "kv"
    compact.mkdir(mode=0o700)
    env = lmdb.open(str(filled), max_dbs=8, readonly=True)
    try:
        env.copy(str(compact), compact=True)
    finally:
        env.close()
    assert page_kinds(compact / "data.mdb")[P_BRANCH], "test setup: no branch page"
    return compact


def damage(pristine: Path, directory: Path, case: str) -> tuple[str, int]:
    """Damage a copy of `pristine` at `directory`; the damaged file's name and kind."""
    copy_cache(pristine, directory)
    DAMAGES[case](directory, random.Random(case))
    name = "lock.mdb" if case.startswith("lock") else "data.mdb"
    return name, os.lstat(directory / name).st_mode & 0o170000


def assert_moved_aside(directory: Path, name: str, kind: int) -> Path:
    (moved,) = directory.parent.glob(f"{directory.name}.damaged-*")
    assert os.lstat(moved / name).st_mode & 0o170000 == kind, "the damaged file is kept"
    assert (directory / "data.mdb").is_file(), "a fresh cache took its place"
    return moved


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(DAMAGES))
def test_generate_answers_as_without_tiers(case, model_dir, prompts, expected, pristine,
                                           tmp_path):
    # The command, as a real process: a crash would show as a signal, a hang as a timeout.
    directory = tmp_path / "cli" / "kv"
    directory.parent.mkdir()
    name, kind = damage(pristine, directory, case)
    prompt_file = tmp_path / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "generate", "--model", str(model_dir),
         "--device", "cpu", "--raw", "--max-tokens", str(PARAMS.max_tokens), "--gpu-blocks",
         "64", "--host-cache-gb", "0.001", "--disk-cache", str(directory), "--json",
         "--prompt-file", str(prompt_file)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
        env=dict(os.environ, KVTIER_CACHE_DIR=str(tmp_path / "user-cache")))
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = json.loads(result.stdout)["outputs"]
    assert [o["outputs"][0]["token_ids"] for o in outputs] == expected
    moved = assert_moved_aside(directory, name, kind)
    assert f"disk cache {directory} was damaged" in result.stderr
    assert f"moved its files to {moved}" in result.stderr
    assert str(directory / name) in result.stderr, "the warning names the damaged file"

    # The library, in this process.
    directory = tmp_path / "api" / "kv"
    directory.parent.mkdir()
    name, kind = damage(pristine, directory, case)
    with LLM(str(model_dir), disk_cache_dir=directory, **ENGINE) as llm:
        outputs = llm.generate(prompts, PARAMS)
        recovery = llm.manager.disk_recovery
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert recovery is not None and not recovery.disk_off
    assert recovery.moved_to == assert_moved_aside(directory, name, kind)


def test_the_undamaged_copy_is_served_from_disk(model_dir, prompts, expected, pristine,
                                                tmp_path):
    """The baseline of the cases above: the same copy, undamaged, is used as it is."""
    directory = tmp_path / "kv"
    copy_cache(pristine, directory)
    with LLM(str(model_dir), disk_cache_dir=directory, **ENGINE) as llm:
        outputs = llm.generate(prompts, PARAMS)
        assert llm.manager.disk_recovery is None
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert sum(o.metrics.cached_tokens_disk for o in outputs) > 0
    assert not list(tmp_path.glob("kv.damaged-*"))


@pytest.mark.parametrize("case", ["branch page", "data a fifo", "lock garbage"])
def test_cache_verify_reports_and_repair_moves_aside(case, pristine, tmp_path):
    directory = tmp_path / "kv"
    name, kind = damage(pristine, directory, case)
    runner = CliRunner()
    result = runner.invoke(app, ["cache", "verify", "--dir", str(directory)])
    assert result.exit_code == 1, result.output
    assert f"damaged files: {directory / name}: " in result.stdout
    assert "kvtier cache verify --repair" in result.stdout
    assert not list(tmp_path.glob("kv.damaged-*")), "verify alone changes nothing"
    result = runner.invoke(app, ["cache", "verify", "--dir", str(directory), "--repair",
                                 "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert not report["ok"] and report["repaired"] and str(directory / name) in \
        report["files_problem"]
    (moved,) = tmp_path.glob("kv.damaged-*")
    assert report["moved_to"] == str(moved)
    assert os.lstat(moved / name).st_mode & 0o170000 == kind
    assert directory.is_dir() and not list(directory.iterdir())


def test_a_short_damage_soak_has_no_crash_and_no_wrong_answer():
    """Three runs of `kvtier bench damage`: random pages damaged after the first run, a
    named case (a leaf page) after the second; each run is a real process."""
    result = run_damage_soak(num_runs=3, seed=1, named_every=2, run_timeout_s=120)
    assert result["crashes"] == 0, [r["failure"] for r in result["runs"]]
    assert result["wrong_answers"] == 0 and result["answers"] == 30
    assert result["ok"]
    assert [bool(r["damage"]) for r in result["runs"]] == [False, True, True]
    for run in result["runs"][1:]:  # the damaged tier served blocks, rejected some, or
        assert run["disk_tokens"] or run["rejected"] or run["recovery"], run  # was replaced
