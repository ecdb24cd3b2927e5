"""Row copies between scattered host slots and a contiguous buffer, on a few CPU threads.

The "bounce" swap's host side: gather rows `slab[slots]` into a staging buffer, or scatter
a staging buffer into `slab[slots]`. numpy does each part (it releases the GIL while it
copies), split over a small thread pool of its own. torch's CPU index ops were measured
instead and lost: their OpenMP teams (one per calling thread, each as wide as the machine)
fought each other and the caller's when both directions copied at once.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Rows of a part are at least this many bytes: smaller parts cost more to hand out than
#: they copy.
_MIN_PART_BYTES = 1 << 20


class HostCopier:
    """`num_threads` CPU threads copying rows of [n, words] numpy arrays."""

    def __init__(self, num_threads: int) -> None:
        if num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {num_threads}")
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kvtier-host-copy")

    def gather(self, slab: np.ndarray, slots: np.ndarray, out: np.ndarray) -> None:
        """`out[i] = slab[slots[i]]`. slab: [n, words]; slots: [m] int64, in range (not
        checked: mode "clip" keeps numpy from buffering `out`); out: [m, words]."""
        self._split(len(slots), slab.shape[1] * slab.itemsize,
                    lambda a, b: np.take(slab, slots[a:b], axis=0, out=out[a:b], mode="clip"))

    def scatter(self, slab: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """`slab[slots[i]] = rows[i]`; slots distinct and in range."""
        def part(a: int, b: int) -> None:
            slab[slots[a:b]] = rows[a:b]
        self._split(len(slots), slab.shape[1] * slab.itemsize, part)

    def _split(self, num_rows: int, row_bytes: int, copy) -> None:
        per_part = max(1, _MIN_PART_BYTES // max(1, row_bytes))
        num_parts = max(1, min(self.num_threads, num_rows // per_part))
        bounds = [num_rows * k // num_parts for k in range(num_parts + 1)]
        futures = [self._pool.submit(copy, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        copy(bounds[0], bounds[1])  # the calling thread copies the first part itself
        for future in futures:
            future.result()


@functools.cache
def host_copier() -> HostCopier:
    """The process's copier: half the CPUs, at most 8 threads (the rest stay with the
    engine's own host work). Cached: one pool serves every swap."""
    return HostCopier(max(1, min(8, (os.cpu_count() or 2) // 2)))
