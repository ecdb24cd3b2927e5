"""cudaLaunchHostFunc through ctypes: host work (CPU copies) run in a stream's order.

The "bounce" swap method copies between scattered host slots and a pinned staging area on
the CPU. That work must happen where the stream says (after the DMA that filled the staging
area, before the DMA that reads it), so it is enqueued as a host function: the CUDA driver
calls it on its own thread once the stream reaches it, and the stream's later work waits
for it to return.

Rules the jobs keep, because the driver forbids CUDA calls inside a host function and the
call runs on a thread that must take the GIL:

* a job only runs CPU tensor operations on memory allocated beforehand (torch releases the
  GIL inside them, so a waiting caller is never blocked behind it);
* a job's tensors are never freed on the driver thread (freeing pinned memory records CUDA
  events): finished jobs stay registered until the next `launch` or `collect` on an
  issuing thread drops them;
* a job that raises is recorded; `raise_failed` reports it to the next caller, since the
  stream itself cannot fail.

The library is the libcudart torch loaded (as for `_memcpy_batch`). When it or the call is
missing, `host_functions()` is None and callers use another method.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.kernels._memcpy_batch import _loaded_cudart_path

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@dataclass(slots=True)
class _Job:
    run: Callable[[], None]
    done: bool = False


class HostFunctions:
    """A bound cudaLaunchHostFunc with a registry of pending jobs (keyed by a counter that
    travels as the host function's user data)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._launch = library.cudaLaunchHostFunc
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        self._callback = _HOST_FN(self._run)  # kept alive as long as the binding
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._next_key = 1
        self._failures: list[str] = []

    def launch(self, stream_handle: int, run: Callable[[], None]) -> None:
        """Enqueue `run()` on the stream (a `torch.cuda.Stream.cuda_stream` handle).

        `run` must follow the module docstring's rules. Raises OSError when the runtime
        rejects the call.
        """
        with self._lock:
            self._drop_finished()
            key = self._next_key
            self._next_key += 1
            self._jobs[key] = _Job(run)
        status = self._launch(ctypes.c_void_p(stream_handle), self._callback,
                              ctypes.c_void_p(key))
        if status != 0:
            with self._lock:
                del self._jobs[key]
            raise OSError(f"cudaLaunchHostFunc failed with CUDA error {status}")

    def collect(self) -> int:
        """Drop finished jobs (and the tensors they hold); returns how many are pending."""
        with self._lock:
            self._drop_finished()
            return len(self._jobs)

    def raise_failed(self) -> None:
        """Raise RuntimeError (once) if a job raised since the last check: the bytes of that
        swap are wrong although its stream went on."""
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise RuntimeError(f"{len(failures)} host copies of an earlier swap failed (their "
                               f"blocks hold wrong bytes; drop them): {failures[0]}")

    def _drop_finished(self) -> None:
        for key in [key for key, job in self._jobs.items() if job.done]:
            del self._jobs[key]

    def _run(self, user_data: int | None) -> None:
        # On the driver's thread. No reference to the job outlives the lock below, so the
        # job (and its tensors) is always freed by an issuing thread.
        with self._lock:
            job = self._jobs[user_data or 0]
            run = job.run
        try:
            run()
        except BaseException as error:  # noqa: BLE001 - nothing can propagate from here
            with self._lock:
                self._failures.append(repr(error))
        with self._lock:
            job.done = True
            del job, run


@functools.cache
def host_functions() -> HostFunctions | None:
    """The process's binding, or None without a loaded CUDA runtime exporting the call.

    Cached: it is a property of the process's loaded libraries, and the driver calls back
    into this one object.
    """
    path = _loaded_cudart_path()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        if not hasattr(library, "cudaLaunchHostFunc"):
            return None
        return HostFunctions(library)
    except OSError:
        return None
