"""Host memory that another process maps too: the host slab a disk worker process reads
disk records into and writes them from (`kvtier.tiers.disk.worker`).

The memory is an anonymous memory file (`memfd_create`): no name in /dev/shm to clean up
after a crash, and no limit but the machine's memory (a container's /dev/shm is often 64
MiB). The worker opens it as `/proc/<pid>/fd/<fd>` of this process. On CUDA the mapping is
page-locked with `cudaHostRegister`, so GPU copies from and to it are as asynchronous and as
fast as from memory `torch.empty(pin_memory=True)` returns.
"""

from __future__ import annotations

import mmap
import os

import torch


class SharedHostMemory:
    """`num_bytes` of host memory mapped shared, as the uint8 tensor `data` `[num_bytes]`.

    pin: page-lock it for CUDA copies (needs CUDA). `path` is what another process opens
    to map the same bytes (while this object is open). Raises ValueError for a size that is
    not positive or pinning without CUDA, OSError when the memory cannot be made or
    page-locked.
    """

    def __init__(self, num_bytes: int, pin: bool) -> None:
        if num_bytes <= 0:
            raise ValueError(f"shared host memory needs a positive size, got {num_bytes}")
        if pin and not torch.cuda.is_available():
            raise ValueError("pinning shared host memory needs CUDA")
        self.num_bytes = num_bytes
        self._fd = os.memfd_create("kvtier-host-slab", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, num_bytes)
            self._map = mmap.mmap(self._fd, num_bytes)
        except BaseException:
            os.close(self._fd)
            raise
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)  # [num_bytes]
        self.base_address = self.data.data_ptr()
        self._pinned = False
        if pin:
            # Flag 1 (cudaHostRegisterPortable): page-locked for every CUDA context, as
            # `pin_memory=True` memory is.
            error = torch.cuda.cudart().cudaHostRegister(self.base_address, num_bytes, 1)
            if int(error) != 0:
                self.close()
                raise OSError(f"could not page-lock {num_bytes / 2**30:.2f} GiB of shared host "
                              f"memory (CUDA error {int(error)}); lower the host capacity or "
                              "raise the locked-memory limit")
            self._pinned = True

    @property
    def path(self) -> str:
        """A path another process of this user opens to map the same memory."""
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def offset_of(self, address: int, num_bytes: int) -> int | None:
        """The offset of `num_bytes` at `address` in this memory, or None when they do not
        lie inside it."""
        offset = address - self.base_address
        return offset if 0 <= offset and offset + num_bytes <= self.num_bytes else None

    def close(self) -> None:
        """Unpin and close the file; the mapping goes when the last view of `data` does.
        Idempotent."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base_address)
            self._pinned = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def map_shared(path: str, num_bytes: int) -> mmap.mmap:
    """Map `num_bytes` of the shared memory at `path` (`SharedHostMemory.path`) read-write.
    Raises OSError when it cannot be opened or is shorter."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < num_bytes:
            raise OSError(f"shared host memory {path} holds fewer than {num_bytes} bytes")
        return mmap.mmap(fd, num_bytes)
    finally:
        os.close(fd)
