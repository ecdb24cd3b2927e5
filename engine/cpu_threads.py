"""How many threads torch's CPU operators use when the engine runs on the CPU.

torch's intra-op pool takes one thread per core, and its threads spin at the end of every
parallel operator until all of them are done. When anything else wants a core (the tiers'
I/O threads reading, checksumming and writing back in the same process, or other work on
the machine), every operator waits for the pool thread that lost its core, and a restore,
which runs several small steps, pays that wait at every operator of every step: short
restores then took longer than recomputing (docs/BENCHMARKS.md, "Figures behind the
engine's constants", has the figures). Leaving one core to everything else removes the
wait.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

#: Environment variables with which the user chose the thread count: left alone then.
USER_THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def leave_a_core_to_io(environ: Mapping[str, str] | None = None) -> int:
    """Cap torch's intra-op threads at one less than the cores (at least one), unless the
    user set a thread count (`USER_THREAD_SETTINGS`). Idempotent; process-wide, like every
    torch thread setting. Returns the intra-op thread count now."""
    env = os.environ if environ is None else environ
    if not any(name in env for name in USER_THREAD_SETTINGS):
        cap = max(1, (os.cpu_count() or 1) - 1)
        if torch.get_num_threads() > cap:
            torch.set_num_threads(cap)
    return torch.get_num_threads()
