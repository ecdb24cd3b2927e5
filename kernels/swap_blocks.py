"""swap_blocks: whole-block copies between GPU memory and pinned host memory.

Three methods move the same bytes:

* "dma": the copy engines. Consecutive mapping rows are coalesced into runs of blocks
  adjacent on both sides (numpy, no sort and no Python step per block), and all runs go
  to the runtime in one cudaMemcpyBatchAsync call (one `copy_` per run without it). When
  the copies are small (under `SMALL_COPY_BYTES` on average) the runs are split over
  `DMA_STREAMS` streams, which the driver feeds to several copy engines. The SMs stay free
  for the model. A plan that fits one call is enqueued on the caller's stream by its
  handle, without making the device and stream current (a few-block write-through is
  mostly such host work). `plan_dma` checks and plans ahead and `DmaPlan.enqueue` issues
  the copies later, for callers that keep the planning off a timed or critical stretch.
* "staged": for small blocks scattered on the GPU but in runs in host memory (a host slab
  whose slots were handed out in order). The GPU blocks are gathered by a device index copy
  into a contiguous device staging buffer and each host run then moves as one DMA (and the
  reverse: DMA into staging, then a device scatter). Staging is bounded (`staging_bytes`,
  two halves used in turn, ordered with events), and the device copies run at HBM speed, a
  few percent of the time the bus takes, on a high-priority side stream.
* "triton": `kernels.copy_blocks._copy_blocks_kernel` with one side in pinned host memory,
  reached through unified virtual addressing. It holds SMs for as long as the bus takes, so
  a concurrent model slows down (docs/KERNELS.md); kept for comparison and the tests.

"auto" picks per call from the plan: "staged" when the DMA copies would be small (under
256 KiB on average) and the host side's runs are at least 4 times longer than the runs
adjacent on both sides, else "dma" (docs/KERNELS.md has the measurements behind the
thresholds).

All work joins back into the caller's stream before the call returns, so an event recorded
there afterwards fires only once every byte has landed. With both tensors on the CPU each
named method runs its own plan with plain tensor copies (how the tests exercise the
planning), except "triton", which needs TRITON_INTERPRET=1 there; "auto" copies scattered
blocks with one gather and one scatter instead: a `copy_` per run is host time a CPU
engine's thread pays for every write-through (docs/BENCHMARKS.md, "Figures behind the
engine's constants", says how much).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from kvtier.kernels import _checks
from kvtier.kernels._memcpy_batch import memcpy_batch
from kvtier.kernels._swap_plan import Runs, coalesce, growing_slices, run_starts, split_even
from kvtier.kernels.copy_blocks import as_words, launch_block_copy, word_bytes_for

SWAP_METHODS = ("auto", "dma", "staged", "triton")
#: With both tensors on the CPU, "auto" copies a plan of at most this many runs run by run,
#: and a longer one with one gather and one scatter.
_CPU_RUNS_COPIED = 2
#: Device staging memory of one "staged" call (two halves, used in turn).
STAGING_BYTES = 64 << 20
#: Mean bytes per DMA copy under which the copy engines fall short of the bus (measured).
SMALL_COPY_BYTES = 1 << 20
#: Streams a "dma" swap of small copies is spread over (twice as many for tiny copies).
DMA_STREAMS = 4
_TINY_COPY_BYTES = 128 << 10
#: Copies in the first batched call of a swap spread over side streams; each later call
#: takes twice as many, up to an even share per stream (0: one call per stream). A copy
#: starts only once the call that enqueued it returns.
FIRST_CALL_COPIES = 32
#: "auto" stages when the DMA copies average under this many bytes and the host runs are at
#: least `_STAGE_GAIN` times longer than them (measured: below, staging gained up to 0.2x of
#: the ceiling; above, or with shorter host runs, it cost host time and gained nothing).
_STAGE_BELOW_BYTES = 256 << 10
_STAGE_GAIN = 4
#: Programs of the "triton" method per SM.
_SWAP_PROGRAMS_PER_SM = 1


def coalesce_runs(pairs: list[list[int]]) -> list[tuple[int, int, int]]:
    """Rows (src, dst) -> runs (src_start, dst_start, num_blocks) of rows adjacent on both
    sides, in the given order (see `_swap_plan.coalesce`)."""
    rows = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    runs = coalesce(rows[:, 0], rows[:, 1])
    return list(zip(runs.src_starts.tolist(), runs.dst_starts.tolist(),
                    runs.lengths.tolist()))


def _block_numel(blocks: torch.Tensor) -> int:
    return math.prod(blocks.shape[1:])


def _dense(blocks: torch.Tensor) -> bool:
    """Consecutive blocks touch, so a run of them is one contiguous span."""
    return blocks.shape[0] <= 1 or blocks.stride(0) == _block_numel(blocks)


def _block_bytes(blocks: torch.Tensor) -> int:
    return _block_numel(blocks) * blocks.element_size()


def _stream_of(tensor: torch.Tensor) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def _addresses(src: torch.Tensor, dst: torch.Tensor,
               runs: Runs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst addresses, src addresses, byte sizes) of `runs`, [num_runs] uint64 each."""
    # int64 arithmetic (addresses are far below 2**63), then the same bits as uint64; the
    # casts cost nothing for the int64 arrays plans hold, and keep the bits right otherwise.
    dst_starts, src_starts, lengths = (a.astype(np.int64, copy=False) for a in (
        runs.dst_starts, runs.src_starts, runs.lengths))
    dsts = dst_starts * (dst.stride(0) * dst.element_size()) + dst.data_ptr()
    srcs = src_starts * (src.stride(0) * src.element_size()) + src.data_ptr()
    sizes = lengths * _block_bytes(src)
    return dsts.view(np.uint64), srcs.view(np.uint64), sizes.view(np.uint64)


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: Runs,
               stream: torch.cuda.Stream | None = None) -> None:
    """Enqueue `runs` (src block -> dst block spans) on `stream`, by its handle (None: the
    current stream): one batched runtime call on CUDA when available, else one `copy_` per
    run on the current stream (the caller then makes `stream` current)."""
    if runs.num_runs == 0:
        return
    if stream is None:
        stream = _stream_of(src if src.is_cuda else dst)
    binding = memcpy_batch() if stream is not None else None
    if binding is not None and stream is not None and stream.cuda_stream != 0:
        binding.copy(*_addresses(src, dst, runs), stream.cuda_stream)
        return
    non_blocking = stream is not None
    for s, d, n in zip(runs.src_starts.tolist(), runs.dst_starts.tolist(),
                       runs.lengths.tolist()):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)


def _total_bytes(src: torch.Tensor, runs: Runs) -> int:
    return int(runs.lengths.sum()) * _block_bytes(src)


def _needs_side_streams(total_bytes: int, num_runs: int) -> bool:
    """Whether a dma plan's copies (`num_runs` copies of `total_bytes` in all) are many and
    small enough to spread over side streams."""
    return num_runs >= 2 * DMA_STREAMS and total_bytes < SMALL_COPY_BYTES * num_runs


def _one_batch(src: torch.Tensor, dst: torch.Tensor, runs: Runs, gpu: torch.Tensor,
               stream: torch.cuda.Stream | None) -> bool:
    """Enqueue a dma plan that fits one batched runtime call (few runs, or large ones) on
    `stream` (None: the current one) straight by its handle, without making the device
    and stream current: a write-through of a few blocks is mostly such host work. False,
    enqueuing nothing, when the plan needs side streams or the batched call is missing."""
    if _needs_side_streams(_total_bytes(src, runs), runs.num_runs) or memcpy_batch() is None \
            or gpu.device.index != torch.cuda.current_device():
        return False
    target = stream if stream is not None else torch.cuda.current_stream()
    if target.cuda_stream == 0:  # the legacy default stream: not for batched copies
        return False
    _copy_runs(src, dst, runs, target)
    return True


def _fork(stream: torch.cuda.Stream, num: int, priority: int = 0) -> list[torch.cuda.Stream]:
    """`num` side streams (from torch's pool) that start after `stream`'s queued work."""
    ready = torch.cuda.Event()
    ready.record(stream)
    sides = [torch.cuda.Stream(stream.device, priority=priority) for _ in range(num)]
    for side in sides:
        side.wait_event(ready)
    return sides


def _join(stream: torch.cuda.Stream, sides: list[torch.cuda.Stream]) -> None:
    """Make `stream` wait for everything queued on `sides`."""
    for side in sides:
        done = torch.cuda.Event()
        done.record(side)
        stream.wait_event(done)


def _swap_dma(src: torch.Tensor, dst: torch.Tensor, runs: Runs) -> None:
    """Copy engines on the current stream (spread over side streams for small copies)."""
    gpu = src if src.is_cuda else dst if dst.is_cuda else None
    total = _total_bytes(src, runs)
    if gpu is None or not _needs_side_streams(total, runs.num_runs):
        _copy_runs(src, dst, runs)
        return
    stream = torch.cuda.current_stream(gpu.device)
    num_streams = DMA_STREAMS * (2 if total < _TINY_COPY_BYTES * runs.num_runs else 1)
    binding = memcpy_batch()
    if binding is not None and FIRST_CALL_COPIES > 0:
        # The copy engines start after a short first call; calls go round robin over the
        # side streams.
        largest = -(-runs.num_runs // num_streams)
        parts = growing_slices(runs.num_runs, FIRST_CALL_COPIES, largest)
    else:  # one call (or one stretch of `copy_`s) per side stream
        parts = split_even(runs.lengths, num_streams)
    sides = _fork(stream, min(num_streams, len(parts)))
    if binding is not None:
        # Addresses once for all runs; each call goes to a side stream by handle, without
        # making it current (the host time of a 1,000-block swap is mostly such calls).
        dsts, srcs, sizes = _addresses(src, dst, runs)
        for i, part in enumerate(parts):
            binding.copy(dsts[part], srcs[part], sizes[part], sides[i % len(sides)].cuda_stream)
    else:
        for side, part in zip(sides, parts):
            with torch.cuda.stream(side):
                _copy_runs(src, dst, Runs(runs.src_starts[part], runs.dst_starts[part],
                                          runs.lengths[part]))
    _join(stream, sides)


def _far_runs(far_ids: np.ndarray, dense: bool, first_row: int) -> Runs:
    """Runs of consecutive far-side ids in a sorted chunk, against staging rows from
    `first_row`; as (far starts, staging starts, lengths)."""
    starts = run_starts(far_ids) if dense else np.arange(far_ids.shape[0], dtype=np.int64)
    lengths = np.diff(np.concatenate((starts, [far_ids.shape[0]]))).astype(np.int64)
    return Runs(far_ids[starts], starts + first_row, lengths)


def _swap_staged(src: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray,
                 dst_ids: np.ndarray, staging_bytes: int, scatter: bool) -> None:
    """Gather src's blocks into staging and DMA the runs of dst's ids (`scatter` False), or
    DMA the runs of src's ids into staging and scatter into dst (True); see the module
    docstring. The gathered or scattered side is the GPU one."""
    near, far = (dst, src) if scatter else (src, dst)
    near_ids, far_ids = (dst_ids, src_ids) if scatter else (src_ids, dst_ids)
    order = np.argsort(far_ids, kind="stable")
    near_ids, far_ids = near_ids[order], far_ids[order]
    word = word_bytes_for(src, dst)
    near_words, far_words = as_words(near, word), as_words(far, word)  # [n, words]
    block_bytes = _block_bytes(src)
    chunk = max(1, staging_bytes // 2 // block_bytes)  # blocks per staging half
    num = near_ids.shape[0]
    bounds = list(range(0, num, chunk))
    far_dense = _dense(far)
    stream = _stream_of(near)
    if stream is None:  # CPU: the same plan, synchronously
        staging = near_words.new_empty((min(chunk, num), near_words.shape[1]))
        index = torch.from_numpy(near_ids)
        for a in bounds:
            b = min(a + chunk, num)
            rows = staging[:b - a]
            runs = _far_runs(far_ids[a:b], far_dense, 0)
            if scatter:
                _copy_runs(far_words, rows, runs)
                near_words.index_copy_(0, index[a:b], rows)
            else:
                torch.index_select(near_words, 0, index[a:b], out=rows)
                _copy_runs(rows, far_words, Runs(runs.dst_starts, runs.src_starts,
                                                 runs.lengths))
        return
    # [2, chunk, words]: allocated on the caller's stream; the side stream's uses of it are
    # all ordered before the caller's later work, so the allocator may reuse it afterwards.
    staging = near_words.new_empty((2, min(chunk, num), near_words.shape[1]))
    (side,) = _fork(stream, 1, priority=-1)
    with torch.cuda.stream(side):
        # From pageable memory: the runtime copies the ids into its own staging before the
        # call returns, so `near_ids` may go away at once.
        index = torch.from_numpy(near_ids).to(near.device, non_blocking=True)
    freed: list[torch.cuda.Event] = []  # per chunk: its staging half may be reused
    for i, a in enumerate(bounds):
        b = min(a + chunk, num)
        rows = staging[i % 2, :b - a]
        runs = _far_runs(far_ids[a:b], far_dense, 0)
        handoff, done = torch.cuda.Event(), torch.cuda.Event()
        if scatter:
            if i >= 2:
                stream.wait_event(freed[i - 2])
            _copy_runs(far_words, rows, runs)
            handoff.record(stream)
            side.wait_event(handoff)
            with torch.cuda.stream(side):
                near_words.index_copy_(0, index[a:b], rows)
            done.record(side)
        else:
            if i >= 2:
                side.wait_event(freed[i - 2])
            with torch.cuda.stream(side):
                torch.index_select(near_words, 0, index[a:b], out=rows)
            handoff.record(side)
            stream.wait_event(handoff)
            _copy_runs(rows, far_words, Runs(runs.dst_starts, runs.src_starts, runs.lengths))
            done.record(stream)
        freed.append(done)
    _join(stream, [side])


def choose_method(runs: Runs, host_ids: np.ndarray | None, block_bytes: int) -> str:
    """What "auto" runs: "dma" or "staged".

    runs: the DMA plan (runs adjacent on both sides); host_ids: [n] int64 ids of the host
    side when exactly one side is in host memory with adjacent slots, else None;
    block_bytes: bytes per block.
    """
    num_blocks = int(runs.lengths.sum())
    if host_ids is None or num_blocks * block_bytes >= _STAGE_BELOW_BYTES * runs.num_runs:
        return "dma"
    num_host_runs = run_starts(np.sort(host_ids)).shape[0]
    return "staged" if _STAGE_GAIN * num_host_runs <= runs.num_runs else "dma"


def _check_swap_args(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                     method: str, staging_bytes: int) -> None:
    if method not in SWAP_METHODS:
        raise ValueError(f"method must be one of {SWAP_METHODS}, got {method!r}")
    if staging_bytes <= 0:
        raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
    if src.dim() < 2 or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src and dst must be [n, *block_shape] with one block shape, got "
                         f"{tuple(src.shape)} and {tuple(dst.shape)}")
    _checks.check_same_dtype("src", src, dst=dst)
    _checks.check_blocks_contiguous("src", src)
    _checks.check_blocks_contiguous("dst", dst)
    if block_mapping.device.type != "cpu":
        raise ValueError(f"block_mapping must be a CPU tensor (the copies are planned on the "
                         f"host), got one on {block_mapping.device}")
    _checks.check_block_mapping(block_mapping, src.shape[0], dst.shape[0])
    devices = {src.device.type, dst.device.type}
    if devices - {"cpu", "cuda"}:
        raise ValueError(f"swap_blocks moves blocks between CUDA and CPU tensors, got "
                         f"{src.device} and {dst.device}")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise ValueError(f"src is on {src.device} and dst on {dst.device}; swap_blocks copies "
                         "within one GPU or between a GPU and host memory")
    if devices == {"cpu", "cuda"}:
        host_name, host = ("src", src) if src.device.type == "cpu" else ("dst", dst)
        if not host.is_pinned():
            raise ValueError(f"{host_name} is in pageable host memory; asynchronous copies "
                             f"(every method) need pinned memory: allocate it with "
                             f"pin_memory=True or call .pin_memory()")


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor,
                method: str = "auto", stream: torch.cuda.Stream | None = None,
                staging_bytes: int = STAGING_BYTES) -> None:
    """Copy whole blocks `src[m[i, 0]] -> dst[m[i, 1]]`, asynchronously when a GPU is involved.

    src: [n_src, *block_shape]; dst: [n_dst, *block_shape]; one dtype, each block one
        contiguous span. One on a GPU and the other in pinned host memory, both on the same
        GPU, or both on the CPU.
    block_mapping: [n, 2] int64 CPU tensor of (src_index, dst_index) rows; destinations
        must be distinct. Rows listed in order along runs of blocks adjacent on both sides
        (as block tables and slots handed out in order are) move as one copy per run.
    method: "dma", "staged", "triton" or "auto" (see the module docstring).
    stream: where the copies are enqueued (side streams fork from and join back into it);
        None means the current stream. The caller keeps src, dst and the host memory alive
        and unchanged until the stream reaches them.
    staging_bytes: bound on the device staging memory of the "staged" method, in bytes.

    Raises ValueError for an unknown method, mismatched blocks, out-of-range indices,
    pageable host memory, or "triton" with only CPU tensors outside the interpreter;
    OSError when the CUDA runtime rejects a batched copy.
    """
    _check_swap_args(src, dst, block_mapping, method, staging_bytes)
    if block_mapping.shape[0] == 0 or _block_numel(src) == 0:
        return
    rows = block_mapping.numpy()  # [n, 2] int64, a view
    src_ids, dst_ids = rows[:, 0].copy(), rows[:, 1].copy()
    gpu = src if src.is_cuda else dst if dst.is_cuda else None
    if method == "triton" and gpu is None and not _checks.interpreting():
        raise ValueError("method='triton' needs a CUDA tensor (or TRITON_INTERPRET=1); "
                         "use method='dma' or 'auto' for CPU tensors")
    runs: Runs | None = None
    if method == "auto":
        runs = coalesce(src_ids, dst_ids, _dense(src), _dense(dst))
        if gpu is None and runs.num_runs > _CPU_RUNS_COPIED:
            # Both on the CPU: nothing is asynchronous, and a `copy_` per run is host time.
            dst.index_copy_(0, torch.from_numpy(dst_ids),
                            src.index_select(0, torch.from_numpy(src_ids)))
            return
        host_side = None if src.is_cuda == dst.is_cuda else (dst_ids, dst) if src.is_cuda \
            else (src_ids, src)
        host_ids = host_side[0] if host_side is not None and _dense(host_side[1]) else None
        method = choose_method(runs, host_ids, _block_bytes(src))
    if method == "dma":
        if runs is None:
            runs = coalesce(src_ids, dst_ids, _dense(src), _dense(dst))
        DmaPlan(src, dst, runs).enqueue(stream)
        return
    with _current(gpu, stream):
        if method == "triton":
            mapping = block_mapping.contiguous()
            programs = None
            if gpu is not None:
                mapping = mapping.to(gpu.device, non_blocking=True)
                num_sms = torch.cuda.get_device_properties(gpu.device).multi_processor_count
                programs = _SWAP_PROGRAMS_PER_SM * num_sms
            launch_block_copy(src, dst, mapping, programs)
        else:
            scatter = dst.is_cuda and not src.is_cuda
            _swap_staged(src, dst, src_ids, dst_ids, staging_bytes, scatter)


@dataclass(frozen=True, slots=True)
class DmaPlan:
    """The copies of `swap_blocks(src, dst, block_mapping, method="dma")`, checked and
    coalesced on the host ahead of `enqueue` (`plan_dma`). A caller that times the copies
    with events plans first: then only the runtime call lies between its first event and
    the copies, not the checks and the planning."""

    src: torch.Tensor
    dst: torch.Tensor
    runs: Runs

    def enqueue(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the copies on `stream` (None: the current one), as `swap_blocks` does."""
        src, dst, runs = self.src, self.dst, self.runs
        if runs.num_runs == 0 or _block_numel(src) == 0:
            return
        gpu = src if src.is_cuda else dst if dst.is_cuda else None
        if gpu is not None and _one_batch(src, dst, runs, gpu, stream):
            return
        with _current(gpu, stream):
            _swap_dma(src, dst, runs)


@contextlib.contextmanager
def _current(gpu: torch.Tensor | None, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """`gpu`'s device, and `stream` when given, current for the block (nothing for None)."""
    with contextlib.ExitStack() as scope:
        if gpu is not None:
            scope.enter_context(torch.cuda.device(gpu.device))
            if stream is not None:
                scope.enter_context(torch.cuda.stream(stream))
        yield


def plan_dma(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> DmaPlan:
    """Check the arguments of `swap_blocks(src, dst, block_mapping, method="dma")` (the same
    ValueErrors) and plan its copies; `DmaPlan.enqueue` then issues them."""
    _check_swap_args(src, dst, block_mapping, "dma", STAGING_BYTES)
    rows = block_mapping.numpy()  # [n, 2] int64, a view
    return DmaPlan(src, dst, coalesce(rows[:, 0].copy(), rows[:, 1].copy(), _dense(src),
                                      _dense(dst)))
