"""The package list, computed: pyproject.toml holds everything else.

The repository keeps engine/, kernels/ and cli/ beside kvtier/ and installs them as
kvtier.engine, kvtier.kernels and kvtier.cli. setuptools' `packages.find` searches folders
by their own names and cannot apply that mapping to subpackages, so the list is built here:
a new subpackage (such as a folder under kvtier/tiers/) is picked up without an edit.
"""

from setuptools import find_packages, setup

#: Import name -> folder in the repository.
PACKAGE_DIR = {"kvtier": "kvtier", "kvtier.engine": "engine", "kvtier.kernels": "kernels",
               "kvtier.cli": "cli"}


def _packages(name: str, folder: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(
    package_dir=PACKAGE_DIR,
    packages=[package for name, folder in PACKAGE_DIR.items()
              for package in _packages(name, folder)],
)
