"""`kvtier demo`: the session plan, and two real runs of `kvtier demo --quick` in a
subprocess (the default model on the CPU, a private cache directory): the first starts cold
and matches the tiers-off run; the second starts warm from the disk tier the first left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvtier.cli.demo import FULL_PLAN, QUICK_PLAN, plan_turns
from kvtier.cli.docs_corpus import CORPUS
from kvtier.cli.main import app
from typer.testing import CliRunner

from tests.model_cache import seed_model_cache

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_rounds_go_forward_then_backward_through_the_documents():
    turns = plan_turns(FULL_PLAN)
    assert len(turns) == FULL_PLAN.num_docs * FULL_PLAN.num_rounds
    docs = CORPUS[:FULL_PLAN.num_docs]
    names = [t.document.name for t in turns]
    n = FULL_PLAN.num_docs
    assert names[:n] == [d.name for d in docs]
    assert names[n:2 * n] == [d.name for d in docs[::-1]]
    # Round r asks question r of each document, and every prompt starts with its document.
    for index, turn in enumerate(turns):
        assert turn.question == turn.document.questions[index // n]
        assert turn.prompt.startswith(f"{turn.document.title}\n\n{turn.document.text}")
        assert turn.prompt.endswith(turn.question + " Answer in one short sentence.")
    assert len(plan_turns(QUICK_PLAN)) == QUICK_PLAN.num_docs * QUICK_PLAN.num_rounds


def test_corpus_documents_are_long_and_distinct():
    assert len({d.name for d in CORPUS}) == len(CORPUS)
    for doc in CORPUS:
        assert len(doc.text.split()) > 200, doc.name  # a few hundred tokens each
        assert len(doc.questions) >= FULL_PLAN.num_rounds


def test_a_model_without_tokenizer_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["demo", "--quick", "--model", "random:tiny-llama",
                                      "--device", "cpu"])
    assert result.exit_code == 1
    # stderr also carries the progress display; the error is its last line, alone.
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "tokenizer" in lines[-1]
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert "Traceback" not in result.output


def _run_demo(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`kvtier demo --quick` with `cache_dir` as its cache (seeded with the model's
    conversion by the caller: "cold" is about the KV tiers, not the model)."""
    env = {**os.environ, "KVTIER_CACHE_DIR": str(cache_dir), "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "demo", "--quick", *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)


@pytest.mark.slow
def test_demo_quick_cold_then_warm_from_disk(tmp_path, smollm2_conversion):
    cache_dir = seed_model_cache(tmp_path / "cache", smollm2_conversion)

    # Run 1: nothing cached yet; the tiered answers match the tiers-off run.
    first = _run_demo(cache_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "identical" in first.stdout
    assert "Cold start" in first.stdout
    disk_dir = cache_dir / "demo-kv"
    assert any(disk_dir.glob("**/data.mdb"))  # one environment or shards

    # Run 2: the first turn's document comes back from the disk tier run 1 left behind.
    second = _run_demo(cache_dir, "--json")
    assert second.returncode == 0, second.stdout + second.stderr
    result = json.loads(second.stdout)
    assert result["identical"] is True and result["mismatched_turns"] == []
    first_turn = result["turns"][0]
    assert first_turn["tokens_disk"] + first_turn["tokens_gpu"] + first_turn["tokens_host"] \
        + first_turn["tokens_prefilled"] == first_turn["num_prompt_tokens"]
    # The document was found on disk and read back from its tail while its head was
    # computed; the demo's small host tier stages a few blocks per step, so how much of it
    # the disk restores (warm_start) depends on where the two fronts meet.
    assert result["disk_dir"] == str(disk_dir)
    assert result["tiers"]["disk"]["hits"] > 0


@pytest.mark.slow
def test_demo_on_a_second_machine_starts_warm_from_the_remote_tier(tmp_path, redis_server,
                                                                   smollm2_conversion):
    """Two demos with their own disk tiers share one Redis server: the second one's first
    turn comes back from the remote tier, and its answers still match tiers off."""
    url = redis_server.url
    machines = [seed_model_cache(tmp_path / name, smollm2_conversion)
                for name in ("machine-a", "machine-b")]
    first = _run_demo(machines[0], "--remote-cache", url)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Cold start" in first.stdout and "R>H" in first.stdout  # the remote's column
    second = _run_demo(machines[1], "--remote-cache", url, "--json")
    assert second.returncode == 0, second.stdout + second.stderr
    result = json.loads(second.stdout)
    # The documents are found in the remote tier and read back from their tails while their
    # heads are computed; how much the remote tier restores depends on where the two
    # fronts of the restore meet (warm_start says whether the first turn got any).
    assert result["identical"] is True
    first_turn = result["turns"][0]
    assert first_turn["tokens_disk"] == 0
    assert result["tiers"]["remote"]["hits"] > 0
    assert result["remote_cache"] == url
