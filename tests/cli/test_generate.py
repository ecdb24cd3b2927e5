"""`kvtier generate` on a tiny random Llama with a byte-level tokenizer and a chat template:
JSON output, prompt files, the disk tier reused by a later run, and one-line errors."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from kvtier.cli.main import app
from kvtier.engine import LLM, SamplingParams
from typer.testing import CliRunner

from tests.cli.chat_model import save_chat_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def generate_args(model_dir: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "5",
            "--gpu-blocks", "64", "--host-cache-gb", "0.01", *extra]


def test_json_output_matches_the_library(runner, model_dir) -> None:
    prompts = ["Where do rivers go?", "Name three stones."]
    result = runner.invoke(app, generate_args(model_dir, *prompts, "--no-disk-cache",
                                              "--json"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"model", "outputs", "stats"}
    assert report["model"].startswith(model_dir.name + "@")
    assert set(report["stats"]) >= {"gpu", "host", "disk", "transfers"}
    assert report["stats"]["gpu"]["num_blocks"] == 64
    with LLM(str(model_dir), device="cpu", gpu_blocks=64, disk_cache=False,
             host_cache=False) as llm:
        # The command applies the chat template, as LLM.chat does.
        expected = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                            SamplingParams(max_tokens=5))
    assert len(report["outputs"]) == 2
    for entry, output in zip(report["outputs"], expected):
        assert entry["prompt_token_ids"] == list(output.prompt_token_ids)
        (completion,) = entry["outputs"]
        assert completion["token_ids"] == list(output.outputs[0].token_ids)
        assert completion["text"] == output.outputs[0].text
        assert completion["finish_reason"] in ("stop", "length")
        assert completion["index"] == 0 and completion["logprobs"] is None
        assert entry["finished"] is True
        assert entry["cached_tokens"] == {"gpu": 0, "host": 0, "disk": 0, "remote": 0}
        assert entry["computed_tokens"] == len(entry["prompt_token_ids"]) \
            + len(completion["token_ids"]) - 1
        assert entry["ttft_s"] >= 0


def test_deterministic_option_gives_the_library_s_deterministic_tokens(runner,
                                                                       model_dir) -> None:
    prompt = "Where do rivers go?"
    result = runner.invoke(app, generate_args(model_dir, prompt, "--no-disk-cache", "--raw",
                                              "--max-num-batched-tokens", "3",
                                              "--deterministic", "--json"))
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["outputs"]
    with LLM(str(model_dir), device="cpu", gpu_blocks=64, disk_cache=False, host_cache=False,
             deterministic=True) as llm:
        assert llm.runner.model.deterministic
        (expected,) = llm.generate([prompt], SamplingParams(max_tokens=5))
    assert entry["outputs"][0]["token_ids"] == list(expected.outputs[0].token_ids)


def test_prompt_files_raw_prompts_and_the_table(runner, model_dir, tmp_path) -> None:
    as_json = tmp_path / "prompts.json"
    as_json.write_text(json.dumps(["first prompt", "second\nprompt"]))
    as_lines = tmp_path / "prompts.txt"
    as_lines.write_text("first prompt\n\nthird prompt\n")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for path, texts in ((as_json, ["first prompt", "second\nprompt"]),
                        (as_lines, ["first prompt", "third prompt"])):
        result = runner.invoke(app, generate_args(model_dir, "--prompt-file", str(path),
                                                  "--raw", "--no-disk-cache", "--json"))
        assert result.exit_code == 0, result.output
        outputs = json.loads(result.stdout)["outputs"]
        assert [o["prompt_token_ids"] for o in outputs] == [tokenizer.encode(t) for t in texts]
    result = runner.invoke(app, generate_args(model_dir, "hello", "--no-disk-cache"))
    assert result.exit_code == 0, result.output
    # Answers on stdout, the statistics table on stderr (so `> out.txt` keeps only answers).
    assert "--- [0]" in result.stdout and "computed" not in result.stdout
    assert "computed" in result.stderr


def test_a_later_run_restores_from_the_disk_tier(runner, model_dir, tmp_path,
                                                 monkeypatch) -> None:
    # A short prompt computes sooner than a read must save by default: read it anyway.
    monkeypatch.setenv("KVTIER_RESTORE_MIN_SAVING_S", "0")
    prompt = "A long enough question that spans a few blocks of sixteen bytes each?"
    args = generate_args(model_dir, prompt, "--disk-cache", str(tmp_path / "kv"), "--json")
    first_run = json.loads(runner.invoke(app, args).stdout)
    second_run = json.loads(runner.invoke(app, args).stdout)
    first, second = first_run["outputs"][0], second_run["outputs"][0]
    assert first["cached_tokens"]["disk"] == 0
    assert first_run["stats"]["disk"]["hits"] == 0
    num_full = (len(first["prompt_token_ids"]) - 1) // 16
    assert num_full >= 4
    # The second run finds every full block on disk; its restore loads them from the tail
    # while the head is computed (where the fronts meet depends on the speeds), so each
    # block is restored from disk or computed, never taken from the empty GPU or host tier.
    assert second_run["stats"]["disk"]["hits"] == num_full
    assert second["cached_tokens"]["gpu"] == second["cached_tokens"]["host"] == 0
    assert second["cached_tokens"]["disk"] <= num_full * 16
    assert second["outputs"][0]["token_ids"] == first["outputs"][0]["token_ids"]


def test_disk_durable_option_reaches_the_disk_tier(runner, model_dir, tmp_path) -> None:
    for extra, durable in (([], False), (["--disk-durable"], True),
                           (["--no-disk-durable"], False)):
        result = runner.invoke(app, generate_args(model_dir, "hi", "--disk-cache",
                                                  str(tmp_path / "kv"), *extra, "--json"))
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["stats"]["disk"]["durable"] is durable, extra


@pytest.mark.parametrize("extra, message", [
    (["hi", "--device", "tpu"], "unknown device"),
    (["hi", "--max-tokens", "-1"], "at least 1"),
    (["hi", "--max-tokens", "0"], "at least 1"),
    (["hi", "--gpu-blocks", "0"], "gpu_blocks"),
    (["hi", "--host-cache-gb", "-1"], "host_cache_gb"),
    (["hi", "--temperature", "-0.5"], "temperature"),
    (["hi", "--disk-cache", "/tmp/x", "--no-disk-cache"], "contradict"),
    ([], "no prompt given"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "cannot read prompt file"),
])
def test_bad_options_print_one_line_and_fail(runner, model_dir, extra, message) -> None:
    result = runner.invoke(app, generate_args(model_dir, "--no-disk-cache", *extra))
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], \
        result.stderr
    assert "Traceback" not in result.output


def test_an_unknown_model_is_one_line_too(runner, tmp_path) -> None:
    result = runner.invoke(app, ["generate", "hi", "--model", str(tmp_path / "missing"),
                                 "--device", "cpu", "--no-disk-cache"])
    assert result.exit_code != 0
    assert result.stderr.strip().startswith("error:") and "does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_terminal_is_told_while_the_model_loads(tmp_path) -> None:
    # At a terminal the wait for the model is announced; piped stderr stays one error line
    # (above). A missing model ends the command right after the announcement.
    leader, follower = pty.openpty()
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "generate", "hi",
                           "--model", str(tmp_path / "missing"), "--device", "cpu",
                           "--no-disk-cache"], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=follower, timeout=120)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end is closed: all was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    lines = b"".join(chunks).decode().strip().splitlines()
    assert proc.returncode != 0
    assert lines[0].startswith("kvtier generate: loading the model"), lines
    assert lines[-1].startswith("error:") and "does not exist" in lines[-1], lines


def test_bad_prompt_files_are_rejected(runner, model_dir, tmp_path) -> None:
    for content, message in (("[1, 2]", "list of strings"), ("[oops", "not valid JSON"),
                             ("\n\n", "holds no prompt")):
        path = tmp_path / "bad.txt"
        path.write_text(content)
        result = runner.invoke(app, generate_args(model_dir, "--prompt-file", str(path),
                                                  "--no-disk-cache"))
        assert result.exit_code != 0 and message in result.stderr, result.stderr
