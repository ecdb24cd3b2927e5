"""StepUploader: a step's input arrays moved to the device in one launch, by the SMs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from kvtier.engine.uploads import StepUploader

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the upload kernel runs on the CPU only under TRITON_INTERPRET=1")


def step_arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-5, 1 << 20, 9, dtype=np.int32),           # query_start_loc
            rng.integers(0, 1 << 40, 7, dtype=np.int64),           # input ids, odd offset
            rng.integers(0, 1000, (3, 5), dtype=np.int32),         # block tables
            np.zeros(0, dtype=np.int64),                           # no logits rows
            rng.standard_normal(4).astype(np.float32)]


def check(arrays: list[np.ndarray], tensors: list[torch.Tensor]) -> None:
    for array, tensor in zip(arrays, tensors, strict=True):
        assert tensor.shape == array.shape and tensor.dtype == torch.from_numpy(array).dtype
        assert np.array_equal(tensor.cpu().numpy(), array)


@needs_interpreter
def test_uploads_keep_values_dtypes_and_shapes_and_grow_the_buffers() -> None:
    uploader = StepUploader("cpu", initial_words=8)  # every upload outgrows it at first
    first = step_arrays(0)
    check(first, uploader.upload(first))
    second = step_arrays(1)
    second_tensors = uploader.upload(second)
    third = step_arrays(2)
    check(third, uploader.upload(third))
    check(second, second_tensors)  # the other buffer: valid until the upload after next
    big = [np.arange(100_000, dtype=np.int64)]
    check(big, uploader.upload(big))


@needs_interpreter
def test_an_array_of_another_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="int32, int64 or float32"):
        StepUploader("cpu").upload([np.zeros(3, dtype=np.float64)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_uploads_are_right_while_the_gpu_runs_behind() -> None:
    # Each upload's kernel waits behind a long kernel; the staging buffer it reads must not
    # be rewritten before it ran, while the host stages the next steps.
    uploader = StepUploader("cuda")
    results = []
    for seed in range(6):
        torch.cuda._sleep(20_000_000)
        arrays = step_arrays(seed)
        results.append((arrays, [t.clone() for t in uploader.upload(arrays)]))
    torch.cuda.synchronize()
    for arrays, tensors in results:
        check(arrays, tensors)
