"""Make a checkout importable as `kvtier` without pip: where no install can be made.

    python3 tools/bare_checkout.py [--site DIR]

An install maps engine/, kernels/ and cli/ to kvtier.engine, kvtier.kernels and kvtier.cli.
Where `pip install --no-deps --no-build-isolation -e .` cannot run (no package index for the
build backend, setuptools older than 77, an interpreter marked externally managed), this
writes the same mapping as a `.pth` file into a site directory of this interpreter (its
purelib when writable, else the user's site-packages, or DIR): every later `python3` then
imports the checkout under exactly one module name per file. It needs only the standard
library and prints the file it wrote. Run it again after moving the checkout.
"""

from __future__ import annotations

import argparse
import os
import site
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Import name -> folder in the repository (setup.py's PACKAGE_DIR).
PACKAGE_DIR = {"kvtier": "kvtier", "kvtier.engine": "engine", "kvtier.kernels": "kernels",
               "kvtier.cli": "cli"}
PTH_NAME = "kvtier_checkout.pth"

# One line: a .pth file runs lines that start with `import`. The finder goes first on
# sys.meta_path so kvtier.engine resolves to engine/ even when the checkout's root is the
# working directory (whose kvtier/ holds no engine/).
_FINDER = (
    "import sys, importlib.util as u; "
    "F = type('KvtierCheckoutFinder', (), {{'find_spec': staticmethod("
    "lambda name, path=None, target=None, u=u, m={mapping!r}: "
    "u.spec_from_file_location(name, m[name] + '/__init__.py', "
    "submodule_search_locations=[m[name]]) if name in m else None)}}); "
    "sys.meta_path.insert(0, F)\n"
)


def pth_text(root: Path = ROOT) -> str:
    mapping = {name: str(root / folder) for name, folder in PACKAGE_DIR.items()}
    return _FINDER.format(mapping=mapping)


def default_site() -> Path:
    purelib = Path(sysconfig.get_paths()["purelib"])
    if os.access(purelib, os.W_OK):
        return purelib
    return Path(site.getusersitepackages())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=None,
                        help="site directory to write into (default: this interpreter's "
                             "purelib when writable, else the user's site-packages); it "
                             "must be one Python processes .pth files in")
    args = parser.parse_args(argv)
    target = args.site or default_site()
    for folder in PACKAGE_DIR.values():
        if not (ROOT / folder / "__init__.py").is_file():
            print(f"error: {ROOT / folder} is not a package folder; run this from a kvtier "
                  "checkout", file=sys.stderr)
            return 2
    target.mkdir(parents=True, exist_ok=True)
    path = target / PTH_NAME
    path.write_text(pth_text())
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
