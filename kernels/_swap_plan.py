"""Copy plans for swap_blocks: block mapping rows -> runs of adjacent blocks, with numpy.

Everything here is vectorised: planning a swap of thousands of blocks costs tens of
microseconds of host time, not a Python step per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Runs:
    """Runs of blocks adjacent on both sides: `src[src_starts[i] + k] -> dst[dst_starts[i] + k]`
    for k < lengths[i]. All three are [num_runs] int64 arrays."""

    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.lengths.shape[0])


def run_starts(ids: np.ndarray) -> np.ndarray:
    """Indices i of `ids` ([n] int64) where a run of consecutive ids (ids[i] == ids[i-1] + 1
    continues a run) begins; [num_runs] int64, empty for empty input."""
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.concatenate(([0], breaks)).astype(np.int64)


def coalesce(src_ids: np.ndarray, dst_ids: np.ndarray, src_dense: bool = True,
             dst_dense: bool = True) -> Runs:
    """Rows (src_ids[i], dst_ids[i]) ([n] int64 each) -> runs of rows adjacent on both sides,
    in the order the rows are given. A side that is not dense (blocks spaced apart in
    memory) never forms runs.

    Rows are not sorted first: a sort of 8,192 rows costs about half a millisecond of host
    time before the first copy can start, and callers list a run's blocks in order anyway
    (block tables, slots allocated in order). Rows (5, 1), (6, 2) form one run; (6, 2),
    (5, 1) form two.
    """
    n = src_ids.shape[0]
    if n == 0:
        return Runs(src_ids, dst_ids, np.zeros(0, dtype=np.int64))
    if not (src_dense and dst_dense):
        return Runs(src_ids, dst_ids, np.ones(n, dtype=np.int64))
    # Slices rather than np.diff: this runs on every swap, and np.diff's own Python costs
    # more than its arithmetic below some thousand rows.
    breaks = np.flatnonzero((src_ids[1:] - src_ids[:-1] != 1)
                            | (dst_ids[1:] - dst_ids[:-1] != 1))
    bounds = np.empty(breaks.shape[0] + 2, dtype=np.int64)  # run starts, then n
    bounds[0], bounds[-1] = 0, n
    bounds[1:-1] = breaks + 1
    starts = bounds[:-1]
    return Runs(src_ids[starts], dst_ids[starts], bounds[1:] - starts)


def split_even(lengths: np.ndarray, num_parts: int) -> list[slice]:
    """Split runs ([num_runs] block counts) into at most `num_parts` consecutive slices of
    about equal block counts; no slice is empty."""
    if lengths.shape[0] == 0:
        return []
    ends = np.cumsum(lengths)
    targets = ends[-1] * np.arange(1, num_parts) / num_parts
    cuts = np.unique(np.searchsorted(ends, targets, side="left") + 1)
    cuts = cuts[(cuts > 0) & (cuts < lengths.shape[0])]
    bounds = [0, *cuts.tolist(), int(lengths.shape[0])]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def growing_slices(num_items: int, first: int, largest: int) -> list[slice]:
    """Consecutive slices covering `num_items` items: `first` items, then twice as many each
    time, never more than `largest` (nor fewer than 1); [] for no items."""
    slices, start, size = [], 0, max(1, min(first, largest))
    while start < num_items:
        slices.append(slice(start, min(start + size, num_items)))
        start += size
        size = min(2 * size, max(1, largest))
    return slices
