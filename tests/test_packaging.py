"""The package as a user installs it: one top-level name, one module name per file, and no
clash with Hugging Face's `kernels` package (which transformers imports when it is
installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Import name -> folder in the repository, as setup.py maps them.
PACKAGE_DIR = {"kvtier": "kvtier", "kvtier.engine": "engine", "kvtier.kernels": "kernels",
               "kvtier.cli": "cli"}


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH (a checkout on it would shadow what an install
    maps)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _source_copy(dest: Path) -> Path:
    """What a build reads, copied: setuptools writes build/ and *.egg-info beside the
    sources, and tests that build at once (pytest-xdist workers) must not share them."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    for folder in PACKAGE_DIR.values():
        shutil.copytree(REPO / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _build_wheel(out_dir: Path) -> Path:
    source = _source_copy(out_dir / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out_dir), str(source)],
                   check=True, env=_clean_env(), cwd=out_dir)
    (wheel,) = out_dir.glob("kvtier-*.whl")
    return wheel


def _repo_packages() -> set[str]:
    """Every package folder of the repository, as the path it has inside a wheel."""
    packages = set()
    for name, folder in PACKAGE_DIR.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            packages.add("/".join([*name.split("."), *relative.parts]))
    return packages


def test_wheel_installs_only_kvtier_at_top_level(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert top_level - dist_info == {"kvtier"}
    # The folders mapped into kvtier really are inside it, subpackages included (setup.py
    # finds them, so a new folder such as one under kvtier/tiers/ needs no edit).
    wheel_packages = {name.removesuffix("/__init__.py") for name in names
                      if name.endswith("/__init__.py")}
    assert {"kvtier", "kvtier/engine", "kvtier/kernels", "kvtier/cli"} <= wheel_packages
    assert wheel_packages == _repo_packages()
    for module in ("kvtier/engine/llm.py", "kvtier/kernels/paged_attention.py",
                   "kvtier/cli/main.py", "kvtier/engine/models/llama.py",
                   "kvtier/cli/bench/commands.py", "kvtier/manager.py"):
        assert module in names
    assert not any(name.startswith(("kvtier/tests", "kvtier/scripts", "kvtier/docs"))
                   for name in names)
    (info,) = dist_info
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{info}/METADATA").decode()
        assert f"{info}/licenses/LICENSE" in archive.namelist()
    assert "License-Expression: Apache-2.0" in metadata
    assert "aiofiles" not in metadata


#: Run in a fresh interpreter: the checkout's folders import under their kvtier names only,
#: and no file of the checkout is loaded under two module names.
_ONE_NAME_CHECK = textwrap.dedent("""
    import importlib, sys
    from pathlib import Path
    repo = Path(sys.argv[1])
    def in_checkout(path):  # a file of the checkout (its .venv aside)
        parents = Path(path).resolve().parents if path else ()
        return repo in parents and repo / ".venv" not in parents
    import kvtier, kvtier.engine.llm, kvtier.kernels, kvtier.cli.main, kvtier.manager
    for name, folder in {package_dir!r}.items():
        module = sys.modules[name]
        assert Path(module.__file__) == repo / folder / "__init__.py", (name, module.__file__)
    assert [Path(p) for p in kvtier.__path__] == [repo / "kvtier"], kvtier.__path__
    for name in ("engine", "kernels", "cli", "tests", "scripts", "kvtier.tests",
                 "kvtier.scripts", "kvtier.docs"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        # Hugging Face's `kernels` may be installed: only a checkout folder would be wrong.
        assert not in_checkout(module.__file__), (name, module.__file__)
    files = {{}}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if in_checkout(path):
            assert files.setdefault(Path(path).resolve(), name) == name, (
                f"{{path}} loaded as {{files[Path(path).resolve()]}} and {{name}}")
    print(len(files))
""").format(package_dir=PACKAGE_DIR)


def test_install_maps_one_module_name_per_file(tmp_path: Path) -> None:
    """The editable install (`make install`) maps exactly kvtier, kvtier.engine,
    kvtier.kernels and kvtier.cli to the checkout's folders; from outside the checkout's
    root, `import engine` and `import kvtier.tests` fail."""
    result = subprocess.run([sys.executable, "-c", _ONE_NAME_CHECK, str(REPO)],
                            capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) > 50  # the engine, kernels and CLI modules were all loaded


def test_bare_checkout_maps_without_pip(tmp_path: Path) -> None:
    """tools/bare_checkout.py: the one-liner for a machine where pip cannot install. Python
    starts without its site directories (so the editable install is not seen), processes the
    directory the tool wrote into, then gets this environment's packages (torch, typer)."""
    site_dir = tmp_path / "site"
    written = subprocess.run([sys.executable, str(REPO / "tools" / "bare_checkout.py"),
                              "--site", str(site_dir)], check=True, capture_output=True,
                             text=True, env=_clean_env(), cwd=tmp_path).stdout.strip()
    assert Path(written) == site_dir / "kvtier_checkout.pth"
    source = ("import site, sys\n"
              f"site.addsitedir({str(site_dir)!r})\n"
              f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n" + _ONE_NAME_CHECK)
    result = subprocess.run([sys.executable, "-S", "-c", source, str(REPO)],
                            capture_output=True, text=True, env=_clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout) > 50


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
    source = _source_copy(tmp_path / "source")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", str(source), "kernels"],
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
