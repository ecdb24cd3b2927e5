"""The package as a user installs it: one top-level name, and no clash with Hugging Face's
`kernels` package (which transformers imports when it is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    """The environment without this test run's PYTHONPATH (it points at the checkout, whose
    engine/, kernels/ and cli/ folders would shadow what the wheel installs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _build_wheel(out_dir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out_dir), str(REPO)],
                   check=True, env=_clean_env(), cwd=out_dir)
    (wheel,) = out_dir.glob("kvtier-*.whl")
    return wheel


def test_wheel_installs_only_kvtier_at_top_level(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert top_level - dist_info == {"kvtier"}
    # The folders mapped into kvtier really are inside it.
    for module in ("kvtier/engine/llm.py", "kvtier/kernels/paged_attention.py",
                   "kvtier/cli/main.py", "kvtier/engine/models/llama.py",
                   "kvtier/cli/bench/commands.py", "kvtier/tiers/disk.py"):
        assert module in names
    (info,) = dist_info
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{info}/METADATA").decode()
        assert f"{info}/licenses/LICENSE" in archive.namelist()
    assert "License-Expression: Apache-2.0" in metadata
    assert "aiofiles" not in metadata


@pytest.mark.slow
def test_fresh_venv_install_beside_hf_kernels(tmp_path: Path) -> None:
    """`pip install . kernels` in a new virtual environment, then import all three.

    The heavy dependencies (torch, transformers) are taken from this interpreter's
    site-packages through a .pth line placed after the new environment's own directory, so
    pip resolves every requirement without downloading torch; kvtier and `kernels` are
    installed into the new environment itself.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_clean_env())
    python = venv / "bin" / "python"
    venv_site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_clean_env()).stdout.strip())
    (venv_site / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(REPO), "kernels"],
                             capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]
    check = textwrap.dedent(f"""
        import kvtier, transformers, kernels
        import kvtier.engine, kvtier.kernels, kvtier.cli.main
        from transformers.utils.import_utils import is_kernels_available
        venv = {str(venv_site)!r}
        assert kvtier.__file__.startswith(venv), kvtier.__file__
        assert kvtier.kernels.__file__.startswith(venv + "/kvtier/"), kvtier.kernels.__file__
        assert kernels.__file__.startswith(venv + "/kernels/"), kernels.__file__
        assert hasattr(kernels, "get_kernel"), "not Hugging Face's kernels package"
        assert hasattr(kvtier.kernels, "paged_attention")
        print(kvtier.__version__, is_kernels_available())
    """)
    result = subprocess.run([str(python), "-c", check], capture_output=True, text=True,
                            env=_clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    version = result.stdout.split()[0]
    assert version != "0.0.0+source"  # the installed distribution's metadata was found
