"""Uploading a step's small input arrays to the GPU through the SMs, not the copy engines.

Every step uploads its inputs (token ids, positions, slot mapping, block tables,
query_start_loc, seq_lens, logits rows). Done with `.to(device)`, each upload is a
copy-engine transfer, queued behind whatever host-to-GPU copies were issued before it on any
stream: a host-tier restore's blocks (4 GiB for a 32K-token prefix of an 8B model, ~80 ms
on the bus) then hold up the next step, and everyone in it, even when the step reads none
of those blocks. On an H100 (`python3 scripts/upload_probe.py`) a matmul loop whose input
was uploaded that way beside a 4 GiB copy ended after 108 ms, against 28 ms alone and
28 ms with the input loaded by `kernels.load_from_host`.

`StepUploader` packs a step's arrays into one pinned staging buffer and moves them with one
`load_from_host` launch into one device buffer, of which each array gets a view.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from kvtier.kernels import load_from_host

#: Words between the starts of two arrays' views, at most (64 bytes).
_ALIGN_WORDS = 16
#: dtypes an uploaded array may have: whole 4-byte words.
_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
           np.dtype(np.float32): torch.float32}


class StepUploader:
    """Uploads arrays of int32, int64 or float32 to `device` (CUDA; the CPU under
    TRITON_INTERPRET=1, for tests) with one kernel launch per call.

    Two staging buffers alternate, so a step can be staged while the previous step's upload
    has not run yet; a buffer is rewritten only after the launch that read it has run (an
    event; on an engine that reads back each step's sampled ids, it always has). The
    tensors returned are views of a device buffer that the upload after next overwrites: use
    them for one step.
    """

    def __init__(self, device: torch.device | str, initial_words: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._hosts = [self._host_buffer(initial_words) for _ in range(2)]
        self._devices = [torch.empty(initial_words, dtype=torch.int32, device=self.device)
                         for _ in range(2)]
        self._read = [torch.cuda.Event() if self._pin else None for _ in range(2)]
        self._next = 0

    def _host_buffer(self, num_words: int) -> torch.Tensor:
        return torch.empty(num_words, dtype=torch.int32, pin_memory=self._pin)  # [words]

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the values, dtypes and shapes of `arrays`, in order.
        Raises ValueError for a dtype other than int32, int64 or float32."""
        offsets, num_words = [], 0
        for array in arrays:
            if array.dtype not in _DTYPES:
                raise ValueError(f"cannot upload {array.dtype} arrays; use int32, int64 or "
                                 "float32")
            # 64-byte aligned, as a tensor of its own would be: kernels are compiled for
            # (and vectorize on) 16-byte aligned pointers.
            num_words = -(-num_words // _ALIGN_WORDS) * _ALIGN_WORDS
            offsets.append(num_words)
            num_words += array.nbytes // 4
        slot, self._next = self._next, 1 - self._next
        if self._read[slot] is not None:
            self._read[slot].synchronize()  # the launch that read this buffer has run
        if self._hosts[slot].shape[0] < num_words:
            size = max(num_words, 2 * self._hosts[slot].shape[0])
            self._hosts[slot] = self._host_buffer(size)
            self._devices[slot] = torch.empty(size, dtype=torch.int32, device=self.device)
        host, device = self._hosts[slot], self._devices[slot]
        words = host.numpy()
        for array, offset in zip(arrays, offsets):
            flat = np.ascontiguousarray(array).reshape(-1).view(np.int32)
            words[offset:offset + flat.shape[0]] = flat
        load_from_host(host[:num_words], device[:num_words])
        if self._read[slot] is not None:
            self._read[slot].record()
        return [device[offset:offset + array.nbytes // 4].view(_DTYPES[array.dtype])
                .view(array.shape) for array, offset in zip(arrays, offsets)]
