"""The queue of host <-> disk and remote jobs waiting for the transfer engine's I/O threads.

Reads go before writes, each kind in submission order: a read has a request waiting on it,
a write-back runs ahead of demand. Reads ahead (`ahead`: for a request still waiting to be
admitted, `engine.prefetch`) go after the reads a restore waits on and before writes: a
burst of them never delays a restore under way. And writes never take every thread: one
(of two or more) is always left to reads, so a read waits for no write to finish. When the engine
produces KV faster than the disk can write it (a large model serving does, see
docs/ARCHITECTURE.md), write-backs are always queued. A write its tier runs one at a time
(`serial`: LMDB has one write transaction) is handed out while no other such write runs:
a second thread would only wait for LMDB's lock, a thread reads could have had (serving
many conversations behind a small host tier, write-backs kept all but one thread inside
disk writes while restores read; docs/BENCHMARKS.md has what it measured).

`put` blocks while `capacity` jobs wait (backpressure on the submitter); `get` blocks until a
job the calling thread may run is queued, or until `close` once nothing is left.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

Job = TypeVar("Job")


class IOQueue(Generic[Job]):
    """Bounded queue of read and write jobs for `num_threads` worker threads."""

    def __init__(self, capacity: int, num_threads: int) -> None:
        if capacity <= 0 or num_threads <= 0:
            raise ValueError(f"capacity ({capacity}) and num_threads ({num_threads}) must "
                             "be positive")
        self.capacity = capacity
        self.max_writers = max(1, num_threads - 1)
        self._reads: deque[Job] = deque()
        self._ahead: deque[Job] = deque()
        self._writes: deque[Job] = deque()
        self._num_writing = 0
        self._serial_writing = False
        self._closed = False
        self._changed = threading.Condition()

    def put(self, job: Job, is_write: bool, serial: bool = False, ahead: bool = False) -> None:
        """Queue `job`, blocking while `capacity` jobs wait; `serial`: a write that runs
        while no other serial write does; `ahead`: a read nobody waits on yet. Raises
        ValueError after close."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(self) < self.capacity)
            if self._closed:
                raise ValueError("the I/O queue is closed")
            if is_write:
                self._writes.append((job, serial))
            elif ahead:
                self._ahead.append(job)
            else:
                self._reads.append(job)
            self._changed.notify_all()

    def get(self) -> tuple[Job, bool] | None:
        """The next job the calling thread may run and whether it is a write (then call
        `write_done` after it), waiting for one; None once closed and empty. Writes go in
        submission order: a serial write waiting for another holds back those after it."""
        with self._changed:
            while True:
                if self._reads:
                    job, is_write = self._reads.popleft(), False
                elif self._ahead:
                    job, is_write = self._ahead.popleft(), False
                elif self._writes and self._num_writing < self.max_writers \
                        and not (self._writes[0][1] and self._serial_writing):
                    (job, serial), is_write = self._writes.popleft(), True
                    self._num_writing += 1
                    self._serial_writing |= serial
                elif self._closed and not self._writes:
                    return None
                else:
                    self._changed.wait()
                    continue
                self._changed.notify_all()  # room for a waiting `put`
                return job, is_write

    def write_done(self, serial: bool = False) -> None:
        """A write job `get` handed out has ended (`serial`: one put as such): another may
        start."""
        with self._changed:
            self._num_writing -= 1
            if serial:
                self._serial_writing = False
            self._changed.notify_all()

    def close(self) -> None:
        """Refuse new jobs; `get` returns None to every thread once the queued ones ran."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def __len__(self) -> int:
        return len(self._reads) + len(self._ahead) + len(self._writes)
