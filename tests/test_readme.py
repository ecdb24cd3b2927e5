"""Every example in README.md runs as written (CPU, the default model, small budgets).

Code blocks tagged `python` run as scripts, blocks tagged `bash` run line by line as shell
commands, and `yaml` blocks whose first line is `# <file name>` are written to that file
first (the commands refer to it). Untagged blocks (install steps, diagrams) are not
examples to run. Everything runs in a temporary directory with a private kvtier cache.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[tuple[str, str]]:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    return [(lang, body) for lang, body in _BLOCK.findall(text)]


def test_the_readme_has_examples_of_each_kind() -> None:
    languages = [lang for lang, _ in readme_blocks()]
    assert {"python", "bash", "yaml"} <= set(languages)


@pytest.mark.slow
def test_every_readme_example_runs(tmp_path: Path) -> None:
    env = dict(os.environ, KVTIER_CACHE_DIR=str(tmp_path / "kvtier-cache"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    blocks = readme_blocks()
    for lang, body in blocks:  # files first: the commands name them
        first = body.splitlines()[0]
        if lang == "yaml" and first.startswith("# "):
            (tmp_path / first[2:].strip()).write_text(body)
    ran = 0
    for lang, body in blocks:
        if lang == "python":
            commands = [[sys.executable, "-c", body]]
        elif lang == "bash":
            commands = [["bash", "-c", line] for line in body.splitlines() if line.strip()]
        else:
            continue
        for command in commands:
            result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=600, check=False)
            shown = command[-1]
            assert result.returncode == 0, f"{shown}\n{result.stderr[-3000:]}"
            assert result.stdout.strip(), f"{shown} printed nothing"
            assert "Traceback" not in result.stderr, shown
            ran += 1
    assert ran >= 5
