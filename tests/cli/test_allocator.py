"""The `kvtier` command's malloc settings, checked in fresh processes (they are process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Frees and re-allocates 2 MiB blocks (LMDB's value pages for an 8B model's blocks) and
# prints the minor page faults that took; argv[1] says whether to tune first.
_CHURN = """
import resource, sys
from kvtier.cli.allocator import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tune" else False
blocks = [bytearray(2 << 20) for _ in range(16)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    del blocks
    blocks = [bytearray(2 << 20) for _ in range(16)]
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")


def churn(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _CHURN, mode], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**clean, **env}).stdout.split()
    return out[0] == "True", int(out[1])


@glibc_only
def test_tuned_malloc_reuses_freed_blocks_instead_of_faulting_them_in() -> None:
    applied, tuned_faults = churn("tune")
    assert applied
    _, default_faults = churn("default")
    # 20 rounds of 32 MiB: glibc's defaults map each block afresh (~8,000 faults a round).
    assert default_faults > 20 * 4000, default_faults
    assert tuned_faults < default_faults // 20, (tuned_faults, default_faults)


@glibc_only
def test_an_explicit_environment_setting_wins() -> None:
    applied, _ = churn("tune", MALLOC_MMAP_THRESHOLD_="131072")
    assert not applied
