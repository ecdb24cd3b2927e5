"""Process-wide malloc settings the `kvtier` command applies to itself at start-up.

LMDB copies every value it writes into pages it mallocs (one 2 MiB block per KV block of
an 8B model). glibc serves allocations that large with fresh mmaps and trims freed memory
back to the system after each commit, so every write transaction faults its pages in again
(about 8,000 minor faults per 32 MiB batch, a third of the write time on the CPU machine).
Raising the mmap and trim thresholds keeps that memory in the heap for reuse.

These are settings of the whole process, so the library never applies them: the `kvtier`
command does, for itself. Programs embedding kvtier can set the same through the
environment (`MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap (glibc's cap for the setting is 32 MiB on 64-bit).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the top of the heap kept instead of returned to the system.
TRIM_THRESHOLD_BYTES = 128 << 20


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when applied.

    A no-op (False) on other C libraries or when the environment already sets either
    threshold (an explicit choice wins).
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return False  # not glibc: its parameters would mean something else
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
