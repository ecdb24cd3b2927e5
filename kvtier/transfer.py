"""The transfer engine: moves block bytes between tiers asynchronously.

Two kinds of jobs, keyed by the hop they make:

  * `SwapJob` (GPU <-> host): whole blocks copied by `kernels.swap_blocks` on a CUDA stream
    of its direction. The stream first waits on an event recorded on the submitter's compute
    stream (so a block is copied only after the kernels that wrote it; a load names the
    earlier event after which nothing used its blocks), and a completion event is recorded
    after the copy; `get_finished` polls it with `event.query()` and never
    blocks. Without CUDA (the "GPU" cache is a CPU tensor) the copy runs synchronously inside
    `submit`, and still reports through `get_finished`, so the whole path is exercised on CPU.
  * `IOJob` (host <-> disk): a callable run on a small pool of threads fed by a bounded
    queue (`kvtier.io_queue`). A full queue blocks the submitter (backpressure), so queued
    work and the memory it pins never grow without bound. Queued reads go before queued
    writes (a restore has a request waiting on it; a write-back runs ahead of demand), each
    in submission order, and writes never hold every thread.

The I/O threads give up the GIL at every read, write and checksum, and take it back only when
the thread holding it lets go: a thread launching a model step's kernels in Python lets go
every `sys.getswitchinterval()` seconds (5 ms by default), so each block read waited several
such turns and a disk restore ran at a third of the disk's speed while the model ran. A
`TransferEngine` on CUDA shortens the interval to `IO_SWITCH_INTERVAL_S` (a process-wide
setting; a shorter one already set is kept).

A job that raises reports `ok=False`; cleaning up after it (pins, slots) is the submitter's
business. `submit`, `get_finished` and `wait` may be called from many threads. Jobs must not
submit jobs themselves (a worker blocked on a full queue would wait for itself).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NewType

import torch

from kvtier.cuda_device import bind_thread
from kvtier.io_queue import IOQueue
from kvtier.kernels import swap_blocks
from kvtier.stats import Direction, TransferCounters, TransferStats, new_transfer_counters

logger = logging.getLogger(__name__)

JobId = NewType("JobId", int)

_SWAP_DIRECTIONS = (Direction.GPU_TO_HOST, Direction.HOST_TO_GPU)
_IO_DIRECTIONS = (Direction.HOST_TO_DISK, Direction.DISK_TO_HOST, Direction.HOST_TO_REMOTE,
                  Direction.REMOTE_TO_HOST)
#: I/O jobs that write (queued behind reads, and never on every I/O thread at once).
_IO_WRITES = (Direction.HOST_TO_DISK, Direction.HOST_TO_REMOTE)


@dataclass(frozen=True, slots=True)
class SwapJob:
    """Copy whole blocks between the GPU cache and the host slab.

    src: [n_src, *block_shape]; dst: [n_dst, *block_shape]; block_mapping: [n, 2] int64
    rows (src_index, dst_index), on the CPU. `after`: on CUDA, the events (of the current
    stream) the copy must follow; None, the default, follows everything queued on the
    current stream when it is submitted. A load into GPU blocks nothing has used since an
    event recorded when they were handed out need not wait for the model's later steps.
    """

    direction: Direction
    src: torch.Tensor
    dst: torch.Tensor
    block_mapping: torch.Tensor
    after: tuple[torch.cuda.Event, ...] | None = None

    @property
    def num_bytes(self) -> int:
        return int(self.block_mapping.shape[0]) * self.src[0].numel() * self.src.element_size()


@dataclass(frozen=True, slots=True)
class IOJob:
    """Host <-> disk work: `run()` moves the bytes and returns how many it moved.

    Per-block outcomes (a record that failed validation, a block the disk rejected) are the
    callable's to record; raising marks the whole job failed.
    """

    direction: Direction
    run: Callable[[], int]
    #: A write its tier runs one at a time (the disk's: LMDB has one write transaction): the
    #: I/O queue starts one such job at a time and leaves the other threads to reads.
    serial: bool = False
    #: A read ahead, that no request waits on yet: the I/O queue runs it after the reads
    #: restores wait on (`kvtier.io_queue`).
    ahead: bool = False


def timed_job(job: IOJob, spans: list[tuple[float, float]]) -> IOJob:
    """`job`, appending `(start, end)` of its run (`time.monotonic`) to `spans`."""
    def run() -> int:
        start = time.monotonic()
        try:
            return job.run()
        finally:
            spans.append((start, time.monotonic()))

    return dataclasses.replace(job, run=run)


def chunks(items: list, size: int) -> list[list]:
    """`items` cut into consecutive lists of at most `size` (one job each)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


#: GIL switch interval (seconds) while I/O threads share the process with a model that
#: launches its kernels from Python: short enough that a block read does not wait for
#: turns, long enough that switching costs the launching thread little.
IO_SWITCH_INTERVAL_S = 0.0005


@dataclass(slots=True)
class _CudaJob:
    direction: Direction
    num_bytes: int
    start: torch.cuda.Event
    done: torch.cuda.Event


class TransferEngine:
    """Runs `SwapJob`s and `IOJob`s and reports `(JobId, ok)` when they finish.

    device: where the GPU cache lives; CUDA gets a copy stream per direction, anything else
        runs swaps synchronously. (Copies of one block both ways never overlap: a host slot
        is found by loads only once its write-through landed, and a slot or GPU block stays
        pinned or held until its copy finished.) swap_method: passed to
        `kernels.swap_blocks`. io_threads / max_pending_io: size of the host <-> disk pool
        and of its queue.
    Raises ValueError for non-positive pool sizes, or "triton" copies without CUDA.
    """

    def __init__(self, device: torch.device | str = "cpu", swap_method: str = "auto",
                 io_threads: int = 2, max_pending_io: int = 64) -> None:
        if io_threads <= 0 or max_pending_io <= 0:
            raise ValueError(f"io_threads ({io_threads}) and max_pending_io "
                             f"({max_pending_io}) must be positive")
        self.device = torch.device(device)
        if self.device.type != "cuda" and swap_method == "triton" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("swap_method='triton' needs a CUDA device (or TRITON_INTERPRET=1); "
                             "use 'auto' or 'dma' on the CPU")
        self.swap_method = swap_method
        self._swap = swap_blocks  # an attribute, so a test can make copies fail
        self._use_cuda = self.device.type == "cuda"
        if self._use_cuda and sys.getswitchinterval() > IO_SWITCH_INTERVAL_S:
            sys.setswitchinterval(IO_SWITCH_INTERVAL_S)
        # One copy stream per direction: loads must not queue behind write-throughs, which
        # wait for the step that computed their blocks (a restore's loads would sit behind
        # each step's write-through, and the next step wait for them).
        self._streams = {direction: torch.cuda.Stream(self.device)
                         for direction in _SWAP_DIRECTIONS} if self._use_cuda else {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._next_job_id = 0
        self._in_flight: set[JobId] = set()
        self._finished: list[tuple[JobId, bool]] = []
        self._cuda_jobs: dict[JobId, _CudaJob] = {}
        self._counters: dict[Direction, TransferCounters] = new_transfer_counters()
        self._closed = False
        self._queue: IOQueue[tuple[JobId, IOJob]] = IOQueue(max_pending_io, io_threads)
        self._workers = [threading.Thread(target=self._work, name=f"kvtier-io-{i}", daemon=True)
                         for i in range(io_threads)]
        for worker in self._workers:
            worker.start()

    # ---- submitting ----------------------------------------------------------------------

    def submit(self, job: SwapJob | IOJob) -> JobId:
        """Start `job`; returns its id. Blocks while the I/O queue is full (IOJob only).

        Raises ValueError for a job whose direction does not fit its kind, or after close().
        """
        if isinstance(job, SwapJob) and job.direction not in _SWAP_DIRECTIONS:
            raise ValueError(f"a SwapJob moves GPU <-> host, not {job.direction.value}")
        if isinstance(job, IOJob) and job.direction not in _IO_DIRECTIONS:
            raise ValueError(f"an IOJob moves host <-> disk or remote, not "
                             f"{job.direction.value}")
        with self._lock:
            if self._closed:
                raise ValueError("the transfer engine is closed; submit before close()")
            job_id = JobId(self._next_job_id)
            self._next_job_id += 1
            self._in_flight.add(job_id)
        if isinstance(job, IOJob):
            self._queue.put((job_id, job), is_write=job.direction in _IO_WRITES,
                            serial=job.serial, ahead=job.ahead)
        elif self._use_cuda:
            self._launch_cuda(job_id, job)
        else:
            self._run_sync(job_id, job)
        return job_id

    def _launch_cuda(self, job_id: JobId, job: SwapJob) -> None:
        stream = self._streams[job.direction]
        try:
            if job.after is None:
                compute_done = torch.cuda.Event()
                compute_done.record(torch.cuda.current_stream(self.device))
                after: tuple[torch.cuda.Event, ...] = (compute_done,)
            else:
                after = job.after
            start = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            # Every call names the stream: making it current would cost host time for
            # nothing (`swap_blocks` enqueues on `stream`).
            for event in after:
                stream.wait_event(event)
            start.record(stream)
            self._swap(job.src, job.dst, job.block_mapping, method=self.swap_method,
                       stream=stream)
            done.record(stream)
        except Exception:
            logger.exception("%s copy of job %d failed to launch", job.direction.value, job_id)
            self._finish(job_id, job.direction, job.num_bytes, 0.0, ok=False)
            return
        with self._lock:
            self._cuda_jobs[job_id] = _CudaJob(job.direction, job.num_bytes, start, done)

    def _run_sync(self, job_id: JobId, job: SwapJob) -> None:
        started = time.perf_counter()
        try:
            self._swap(job.src, job.dst, job.block_mapping, method=self.swap_method)
            ok = True
        except Exception:
            logger.exception("%s copy of job %d failed", job.direction.value, job_id)
            ok = False
        self._finish(job_id, job.direction, job.num_bytes, time.perf_counter() - started, ok)

    def _work(self) -> None:
        bind_thread(self.device)
        while (item := self._queue.get()) is not None:
            (job_id, job), is_write = item
            started = time.perf_counter()
            num_bytes, ok = 0, True
            try:
                num_bytes = job.run()
            except Exception:
                logger.exception("%s job %d failed", job.direction.value, job_id)
                ok = False
            finally:
                if is_write:
                    self._queue.write_done(job.serial)
            self._finish(job_id, job.direction, num_bytes, time.perf_counter() - started, ok)

    def _finish(self, job_id: JobId, direction: Direction, num_bytes: int, seconds: float,
                ok: bool) -> None:
        with self._lock:
            self._counters[direction].add(num_bytes, seconds, ok)
            self._finished.append((job_id, ok))
            self._in_flight.discard(job_id)
            self._changed.notify_all()

    # ---- completion ----------------------------------------------------------------------

    def get_finished(self) -> list[tuple[JobId, bool]]:
        """Jobs finished since the last call, as `(job_id, ok)`; never blocks."""
        self._reap_cuda(block=())
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Iterable[JobId]) -> None:
        """Block until every job in `job_ids` finished (their results stay queued for
        `get_finished`). Ids already reported return at once. Raises ValueError for an id
        that was never handed out."""
        wanted = set(job_ids)
        with self._lock:
            unknown = [j for j in wanted if j >= self._next_job_id or j < 0]
        if unknown:
            raise ValueError(f"job ids {sorted(unknown)} were never submitted")
        while True:
            self._reap_cuda(block=wanted)
            with self._changed:
                if not wanted & self._in_flight:
                    return
                # Woken by every finishing job; the timeout only covers a CUDA job whose id
                # was handed out by another thread that has not registered its events yet.
                self._changed.wait(timeout=0.05)

    def wait_any(self, timeout_s: float) -> None:
        """Block until a job finished that `get_finished` has not reported yet, or for
        `timeout_s` seconds. I/O jobs wake it as they finish; CUDA jobs are seen only when
        the wait begins (their events are polled), so with those the timeout bounds it."""
        self._reap_cuda(block=())
        with self._changed:
            if not self._finished:
                self._changed.wait(timeout=timeout_s)

    def wait_all(self) -> None:
        """Block until nothing is in flight."""
        with self._lock:
            in_flight = set(self._in_flight)
        self.wait(in_flight)

    def _reap_cuda(self, block: Iterable[JobId]) -> None:
        """Move fired CUDA jobs to the finished list; synchronize on those in `block`."""
        with self._lock:
            pending = list(self._cuda_jobs.items())
        must_wait = set(block)
        for job_id, cuda_job in pending:
            try:
                if job_id in must_wait:
                    cuda_job.done.synchronize()
                elif not cuda_job.done.query():
                    continue
                seconds, ok = cuda_job.start.elapsed_time(cuda_job.done) / 1e3, True
            except RuntimeError:
                logger.exception("%s copy of job %d failed", cuda_job.direction.value, job_id)
                seconds, ok = 0.0, False
            with self._lock:
                if self._cuda_jobs.pop(job_id, None) is None:
                    continue  # another thread reaped it first
            self._finish(job_id, cuda_job.direction, cuda_job.num_bytes, seconds, ok)

    def is_on_stream(self, job_id: JobId) -> bool:
        """Whether `job_id` is a GPU copy launched on a copy stream and not reaped yet
        (a launched copy completes: a CUDA fault would poison the whole context anyway)."""
        with self._lock:
            return job_id in self._cuda_jobs

    def order_after(self, job_ids: Iterable[JobId]) -> None:
        """Make the current CUDA stream wait for those of `job_ids` still on the transfer
        stream: work queued on it afterwards (the model's forward) sees their bytes."""
        with self._lock:
            events = [self._cuda_jobs[j].done for j in job_ids if j in self._cuda_jobs]
        for event in events:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def stats(self) -> dict[Direction, TransferStats]:
        """Per direction: jobs, bytes moved by successful jobs, seconds, failed jobs."""
        with self._lock:
            return {d: c.snapshot() for d, c in self._counters.items()}

    def close(self) -> None:
        """Wait for in-flight jobs, then stop the I/O threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.wait_all()
        self._queue.close()
        for worker in self._workers:
            worker.join()
