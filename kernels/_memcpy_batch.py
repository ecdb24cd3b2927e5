"""cudaMemcpyBatchAsync through ctypes: many copies submitted in one runtime call.

The CUDA runtime gained this call in 12.8; 13.0 dropped its `failIdx` argument, so the
signature is chosen from `cudaRuntimeGetVersion`. The library is the libcudart torch has
already loaded (found in /proc/self/maps), so stream handles from torch are valid for it.
When anything is missing the binding is None and callers fall back to one copy per run.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

_SRC_ACCESS_ORDER_STREAM = 1
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


class MemcpyBatch:
    """A bound cudaMemcpyBatchAsync. `copy(dsts, srcs, sizes, stream_handle)` raises
    OSError with the CUDA error code when the runtime rejects the batch."""

    def __init__(self, library: ctypes.CDLL, runtime_version: int) -> None:
        self._fn = library.cudaMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        self._with_fail_index = runtime_version < 13000
        self.runtime_version = runtime_version
        self._attrs = _MemcpyAttributes(src_access_order=_SRC_ACCESS_ORDER_STREAM,
                                        flags=_FLAG_PREFER_OVERLAP_WITH_COMPUTE)

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
             stream_handle: int) -> None:
        """Enqueue `sizes[i]` bytes from address `srcs[i]` to `dsts[i]` on the stream.

        dsts, srcs, sizes: [n] integer arrays (converted to uint64 without a Python loop).
        Raises OSError on the legacy default stream (handle 0) or when the runtime rejects
        the batch.
        """
        count = len(sizes)
        assert len(dsts) == count and len(srcs) == count, "one dst and src per size"
        if count == 0:
            return
        if stream_handle == 0:
            raise OSError("cudaMemcpyBatchAsync cannot run on the legacy default stream")
        # The runtime reads the three arrays during the call only.
        dst_array = np.ascontiguousarray(dsts, dtype=np.uint64)
        src_array = np.ascontiguousarray(srcs, dtype=np.uint64)
        size_array = np.ascontiguousarray(sizes, dtype=np.uint64)
        attr_index = ctypes.c_size_t(0)
        args = [ctypes.c_void_p(dst_array.ctypes.data), ctypes.c_void_p(src_array.ctypes.data),
                ctypes.c_void_p(size_array.ctypes.data), ctypes.c_size_t(count),
                ctypes.byref(self._attrs), ctypes.byref(attr_index), ctypes.c_size_t(1)]
        if self._with_fail_index:
            fail_index = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream_handle))
        status = self._fn(*args)
        if status != 0:
            raise OSError(f"cudaMemcpyBatchAsync failed with CUDA error {status}")


def _loaded_cudart_path() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def memcpy_batch() -> MemcpyBatch | None:
    """The binding, or None without a CUDA runtime >= 12.8 exporting the call.

    Set KVTIER_NO_MEMCPY_BATCH=1 to disable it (for comparisons). Cached: the answer is a
    property of the process's loaded libraries.
    """
    if os.environ.get("KVTIER_NO_MEMCPY_BATCH", "0") not in ("", "0"):
        return None
    path = _loaded_cudart_path()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        version = ctypes.c_int(0)
        if library.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return None
        if version.value < 12080 or not hasattr(library, "cudaMemcpyBatchAsync"):
            return None
        return MemcpyBatch(library, version.value)
    except OSError:
        return None
