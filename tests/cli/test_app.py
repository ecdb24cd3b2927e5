"""The root command: no torch for --version / --help, commands loaded on first use with the
help they list, choices in --help, completion, and settings from --config and KVTIER_*."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from kvtier.cli.common import LazyCommand
from kvtier.cli.main import LAZY_COMMANDS, app
from typer.testing import CliRunner

from tests.cli.chat_model import save_chat_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, env=dict(os.environ), check=True, timeout=120)
    return result.stdout


def test_version_and_help_do_not_import_torch() -> None:
    code = ("import sys\n"
            "from kvtier.cli.main import app\n"
            "from typer.testing import CliRunner\n"
            "runner = CliRunner()\n"
            "for args in (['--version'], ['--help']):\n"
            "    result = runner.invoke(app, args)\n"
            "    assert result.exit_code == 0, result.output\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)\n")
    assert run_python(code).split() == ["False", "False"]


def test_version_comes_from_the_package_metadata() -> None:
    import kvtier

    result = CliRunner().invoke(app, ["--version"])
    assert result.stdout.strip() == f"kvtier {kvtier.__version__}"


def test_listed_help_is_the_commands_own() -> None:
    root = typer.main.get_command(app)
    for name, _, listed in LAZY_COMMANDS:
        placeholder = root.commands[name]
        assert isinstance(placeholder, LazyCommand)
        loaded = placeholder.load()
        assert loaded.help == listed, name
        assert "\n" not in (loaded.help or ""), name  # docstring line breaks are joined


def test_help_lists_choices_and_completion() -> None:
    runner = CliRunner()
    root_help = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert "--install-completion" in root_help and "generate" in root_help
    generate_help = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).stdout
    for choices in ("xxh3_128|sha256", "auto|float32|bfloat16|float16",
                    "auto|torch|triton|cudnn|flash"):
        assert choices in generate_help, choices
    for option in ("--gpu-memory-utilization", "--max-model-len", "--max-num-batched-tokens",
                   "--cache-salt", "--config", "--raw", "--system"):
        assert option in generate_help, option


def test_help_shows_the_defaults_written_into_option_help() -> None:
    # Rich reads "[...]" in help text as markup and drops it, so these must not be bracketed.
    runner = CliRunner()
    generate_help = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "250"}).stdout
    for default in ("(default: 16)", "(default: smollm2-135m)", "(default: xxh3_128)",
                    "(default: 10.0)"):
        assert default in generate_help, default
    import_help = runner.invoke(app, ["cache", "import", "--help"],
                                env={"COLUMNS": "250"}).stdout
    assert "default: 4 for a file of 4 GiB or more, else 1" in import_help


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"))


def disk_tokens(result) -> int:
    """Prompt blocks the run's lookup found in the disk tier (the restore then loads them
    from the tail while the head is computed, so hits, not restored tokens, show whether
    the settings reached the cache namespace)."""
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["stats"]["disk"]["hits"]


def test_config_file_environment_and_options_reach_the_engine(model_dir, tmp_path,
                                                              monkeypatch) -> None:
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text(f"model: {model_dir}\ndevice: cpu\ngpu_blocks: 64\n"
                           f"host_cache: false\ndisk_cache_dir: {tmp_path / 'kv'}\n"
                           "hash_algorithm: sha256\ncache_salt: tenant-a\n"
                           "restore_min_saving_s: 0\n")  # a short prompt: read it anyway
    prompt = "A question long enough to fill a few blocks of sixteen tokens each, twice over."
    runner = CliRunner()

    def run(*extra: str) -> int:
        return disk_tokens(runner.invoke(app, ["generate", prompt, "--max-tokens", "2",
                                               "--json", "--config", str(config_file),
                                               *extra]))

    assert run() == 0  # first run: nothing cached yet
    assert run() > 0  # same settings: the disk tier serves the prompt
    assert run("--cache-salt", "tenant-b") == 0  # the option beats the file's salt
    monkeypatch.setenv("KVTIER_HASH_ALGORITHM", "xxh3_128")  # the file beats the variable
    assert run() > 0
    monkeypatch.setenv("KVTIER_CONFIG", str(config_file))
    assert disk_tokens(runner.invoke(app, ["generate", prompt, "--max-tokens", "2", "--json",
                                           "--hash-algorithm", "xxh3_128"])) == 0
