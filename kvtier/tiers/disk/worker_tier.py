"""The disk tier run in a worker process (`kvtier.tiers.disk.worker`), as the manager sees it.

`DiskWorkerTier` is a `LowerTier` whose verbs are requests to the worker. Blocks whose
buffers lie in the host slab both processes map (`kvtier.shared_host_memory`) travel as
offsets into it: the worker reads records straight into the slots and writes them from
there. Any other buffer travels as bytes over the socket (slower, for callers outside the
manager). The I/O threads that run its jobs wait on the answer with the GIL given up, and
take it back once per job, not several times per block.

A worker that exits or stops answering leaves the tier serving nothing (`unavailable` says
why): lookups miss, reads miss, writes are refused, as with a disk that went away; the run
goes on recomputing. Lookups are answered in this process from a replica of the worker's
stored hashes while it is current (`kvtier.tiers.disk.key_replica`); asked of the worker,
they wait at most the tier's lookup deadline plus a second.
"""

from __future__ import annotations

import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.hashing import BlockHash
from kvtier.layout import KVLayout
from kvtier.shared_host_memory import SharedHostMemory
from kvtier.stats import Tier
from kvtier.tiers.base import LowerTier, WritePolicy
from kvtier.tiers.disk.key_replica import KeyReplica
from kvtier.tiers.disk.recovery import DiskRecovery
from kvtier.tiers.disk.tier import KEYS_FRESH_S, LOOKUP_DEADLINE_S, DiskStats
from kvtier.tiers.disk.worker import OpenRequest, TierInfo, meta_tuples
from kvtier.tiers.record import BlockBuffer, BlockMeta, dest_array, payload_view

logger = logging.getLogger(__name__)

#: Seconds the worker may take to open its tier (recovering damaged files, loading the
#: stored hashes of a large directory) before the engine gives up on it.
START_TIMEOUT_S = 300.0
#: Seconds `close` waits for the worker to write out and close its tier.
CLOSE_TIMEOUT_S = 300.0


class WorkerGone(OSError):
    """The disk worker exited, or stopped answering."""


@dataclass(frozen=True, slots=True)
class WorkerCalls:
    """Requests of one verb made to the worker: how many were answered, and the seconds
    their callers waited for the answers (the round trip, the worker's work included)."""

    calls: int = 0
    seconds: float = 0.0

    def since(self, before: WorkerCalls) -> WorkerCalls:
        return WorkerCalls(self.calls - before.calls, self.seconds - before.seconds)


def _address(buffer: object, nbytes: int) -> int | None:
    """Where `buffer`'s `nbytes` bytes start, for a contiguous numpy array or CPU tensor of
    exactly that size; None for anything else."""
    if isinstance(buffer, np.ndarray):
        if buffer.flags.c_contiguous and buffer.nbytes == nbytes:
            return buffer.__array_interface__["data"][0]
        return None
    if isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" \
            and buffer.is_contiguous() and buffer.numel() * buffer.element_size() == nbytes:
        return buffer.data_ptr()
    return None


class DiskWorkerTier(LowerTier):
    """The disk tier at `path`, served by a worker process; open it with `start`."""

    name = "disk"
    kind = Tier.DISK
    write_policy = WritePolicy.WRITE_BACK
    lookup_is_local = True

    def __init__(self, path: Path, layout: KVLayout, info: TierInfo, process: subprocess.Popen,
                 conn: Connection, shared: SharedHostMemory, lookup_deadline_s: float) -> None:
        self.path, self.layout = path, layout
        self.write_batch, self.serial_writes = info.write_batch, info.serial_writes
        self.durable, self.budget_bytes = info.durable, info.budget_bytes
        self.lookup_deadline_s = lookup_deadline_s
        self._process, self._conn, self._shared = process, conn, shared
        self._lock = threading.Lock()  # sending, and the pending requests
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._gone: str | None = None
        self._closed = False
        self._last_stats = DiskStats(0, 0, info.budget_bytes, 0, 0, 0, 0, 0, 0, info.durable)
        self._calls: dict[str, WorkerCalls] = {}  # per verb, answered requests
        self._replica = KeyReplica(info.num_shards, KEYS_FRESH_S)
        self._receiver = threading.Thread(target=self._receive, name="kvtier-disk-replies",
                                          daemon=True)
        self._receiver.start()

    @classmethod
    def start(cls, path: str | Path, layout: KVLayout, budget_bytes: int, *,
              shared: SharedHostMemory, shards: int = 1, durable: bool = False,
              lookup_deadline_s: float = LOOKUP_DEADLINE_S, threads: int = 8,
              start_timeout_s: float = START_TIMEOUT_S
              ) -> tuple[DiskWorkerTier | None, DiskRecovery | None]:
        """Start a worker on the disk tier at `path` (`open_disk_tier`'s arguments) whose
        jobs use the host slab in `shared`; `threads` answer requests side by side.

        Returns (tier, recovery) as `open_disk_tier` does: (None, recovery) when recovery
        turned the disk tier off. Raises what opening the tier raised in the worker, and
        WorkerGone when the worker exited, could not map the slab, or did not open the
        tier within `start_timeout_s` (the tier itself may be fine: open it in process)."""
        root = Path(path).expanduser().absolute()
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvtier.tiers.disk.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:  # no interpreter to run it with
            ours.close()
            raise WorkerGone(f"the disk worker for {root} cannot be started ({exc})") from exc
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send(OpenRequest(str(root), layout, budget_bytes, shards, durable,
                                  lookup_deadline_s, shared.path, shared.num_bytes, threads))
            if not conn.poll(start_timeout_s):
                raise WorkerGone(f"the disk worker for {root} did not open the tier within "
                                 f"{start_timeout_s} s")
            status, payload = conn.recv()
        except BaseException as exc:
            conn.close()
            _stop(process)
            if isinstance(exc, (EOFError, ConnectionError)):
                raise WorkerGone(f"the disk worker for {root} exited while opening the tier "
                                 f"(exit code {process.returncode})") from exc
            raise
        if status != "ready":
            conn.close()
            _stop(process)
            if status == "off":
                return None, payload
            if status == "unmapped":
                raise WorkerGone(f"the disk worker for {root} cannot map the host slab "
                                 f"({payload})")
            raise payload
        info, recovery = payload
        return cls(root, layout, info, process, conn, shared, lookup_deadline_s), recovery

    # ---- requests ------------------------------------------------------------------------

    def _request(self, verb: str, *args: object) -> Future:
        future: Future = Future()
        with self._lock:
            if self._gone is not None:
                raise WorkerGone(self._gone)
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                self._conn.send((request_id, verb, args))
            except (OSError, ValueError) as exc:
                self._pending.pop(request_id, None)
                raise WorkerGone(f"the disk worker cannot be reached ({exc})") from exc
        return future

    def _receive(self) -> None:
        while True:
            try:
                request_id, ok, result = self._conn.recv()
            except (EOFError, OSError):
                break
            if request_id is None:  # unasked: (None, "keys", (shard, event))
                self._replica.apply(*result)
                continue
            with self._lock:
                future = self._pending.pop(request_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(result)
            else:
                future.set_exception(result)
        try:
            code = self._process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # it closed the socket and lives on: kill it
            self._process.kill()
            code = self._process.wait()
        self._set_gone("the disk worker process exited" if self._closed else
                       f"the disk worker process exited (exit code {code}); the disk tier "
                       "is off until the engine restarts")

    def _set_gone(self, reason: str) -> None:
        with self._lock:
            if self._gone is None:
                self._gone = reason
                if not self._closed:
                    logger.warning("disk cache %s: %s", self.path, reason)
            pending, self._pending = self._pending, {}
        self._replica.clear()
        for future in pending.values():
            future.set_exception(WorkerGone(reason))

    def _ask(self, verb: str, *args: object, timeout: float | None = None) -> Any:
        started = time.perf_counter()
        answer = self._request(verb, *args).result(timeout=timeout)
        self._count(verb, time.perf_counter() - started)
        return answer

    def _count(self, verb: str, seconds: float) -> None:
        with self._lock:
            calls = self._calls.get(verb, WorkerCalls())
            self._calls[verb] = WorkerCalls(calls.calls + 1, calls.seconds + seconds)

    def calls(self) -> dict[str, WorkerCalls]:
        """Per verb ("contains", "get", "put", ...), the requests answered so far and the
        seconds their callers waited: what the worker costs the engine's threads.
        "contains_replica" counts the lookups answered here, from the replica of the
        worker's stored hashes, without a request."""
        with self._lock:
            return dict(self._calls)

    @property
    def unavailable(self) -> str | None:
        """Why the tier serves nothing now (the worker is gone), or None."""
        return self._gone

    # ---- the verbs -----------------------------------------------------------------------

    def contains(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """From the replica of the worker's stored hashes while it is current (see
        `kvtier.tiers.disk.key_replica`), else asked of the worker, within the lookup
        deadline plus a second (all misses past it, or once the worker is gone)."""
        started = time.perf_counter()
        found = self._replica.lookup(block_hashes)
        if found is not None:
            self._count("contains_replica", time.perf_counter() - started)
            return found
        hashes = list(block_hashes)
        try:
            return self._ask("contains", hashes, timeout=self.lookup_deadline_s + 1.0)
        except (WorkerGone, FutureTimeout):
            return [False] * len(hashes)

    def _offsets(self, buffers: Sequence[object]) -> list[int] | None:
        """Each buffer's offset in the shared slab, or None unless all lie in it."""
        nbytes = self.layout.bytes_per_block
        offsets = []
        for buffer in buffers:
            address = _address(buffer, nbytes)
            offset = None if address is None else self._shared.offset_of(address, nbytes)
            if offset is None:
                return None
            offsets.append(offset)
        return offsets

    def get_many_into(self, metas: Sequence[BlockMeta],
                      dests: Sequence[BlockBuffer]) -> list[bool]:
        nbytes = self.layout.bytes_per_block
        arrays = [dest_array(dest, nbytes) for dest in dests]
        offsets = self._offsets(arrays)
        try:
            answer = self._ask("get", meta_tuples(list(metas)), offsets)
        except Exception as exc:  # a cache: a failed read is a miss
            if not isinstance(exc, WorkerGone):
                logger.warning("disk cache %s: a read failed in the worker (%s)", self.path, exc)
            return [False] * len(arrays)
        if offsets is not None:
            return answer
        hits, payloads = answer
        for array, payload in zip(arrays, payloads):
            if payload is not None:
                array[:] = np.frombuffer(payload, dtype=np.uint8)
        return hits

    def put(self, metas: Sequence[BlockMeta], payloads: Sequence[object]) -> list[bool]:
        return self.put_counted(metas, payloads)[0]

    def put_counted(self, metas: Sequence[BlockMeta], payloads: Sequence[object]
                    ) -> tuple[list[bool], int]:
        """`DiskTier.put_counted` in the worker. Raises ValueError for a payload of the wrong
        size or kind; a worker that is gone refuses every block."""
        nbytes = self.layout.bytes_per_block
        views = [payload_view(payload, nbytes) for payload in payloads]  # checks each
        offsets = self._offsets(payloads)
        sent = offsets if offsets is not None else [view.tobytes() for view in views]
        try:
            return self._ask("put", meta_tuples(list(metas)), sent)
        except Exception as exc:
            if not isinstance(exc, WorkerGone):
                logger.warning("disk cache %s: a write failed in the worker (%s)", self.path,
                               exc)
            return [False] * len(views), 0

    def delete(self, block_hashes: Sequence[BlockHash]) -> int:
        """`DiskTier.delete` in the worker; 0 when it is gone."""
        try:
            return self._ask("delete", list(block_hashes))
        except WorkerGone:
            return 0

    def sync(self) -> None:
        try:
            self._ask("sync")
        except WorkerGone:
            pass

    def stats(self) -> DiskStats:
        """The worker's tier's counters; the last ones it told while it does not answer
        (within the lookup deadline) or is gone."""
        try:
            self._last_stats = self._ask("stats", timeout=self.lookup_deadline_s + 1.0)
        except (WorkerGone, FutureTimeout):
            pass
        return self._last_stats

    def close(self) -> None:
        """Have the worker close its tier (which writes out what it holds), then end it.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._ask("close", timeout=CLOSE_TIMEOUT_S)
        except (WorkerGone, FutureTimeout):
            pass
        _stop(self._process)
        self._conn.close()
        self._receiver.join(timeout=5.0)


def _stop(process: subprocess.Popen) -> None:
    """Wait a little for `process` to exit, then kill it."""
    try:
        process.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
