"""KVLayout: validation, byte sizes, and a fingerprint that is stable and tells layouts apart."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from kvtier.device_cache import allocate_kv_cache
from kvtier.layout import KVLayout, dtype_name, parse_dtype

SIZE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size")


def make_layout(**overrides) -> KVLayout:
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    fields.update(overrides)
    return KVLayout(**fields)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", None])
def test_bad_size_raises_value_error_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        make_layout(**{field: bad})


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "float16", None])
def test_bad_dtype_raises_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="dtype"):
        make_layout(dtype=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1), (2, 2, 8, 4), (3, 4, 64, 16)])
def test_bytes_per_block_matches_a_real_block_tensor(dtype, sizes):
    layers, heads, dim, block_size = sizes
    layout = KVLayout(layers, heads, dim, block_size, dtype)
    cache = allocate_kv_cache(layout, num_blocks=3)
    # [3, num_layers, 2, block_size, num_kv_heads, head_dim]
    assert tuple(cache.shape[1:]) == layout.block_shape
    assert cache[1].is_contiguous()
    assert cache[1].numel() * cache.element_size() == layout.bytes_per_block
    assert layout.bytes_per_block == layers * 2 * block_size * heads * dim * dtype.itemsize
    assert layout.bytes_per_token * block_size == layout.bytes_per_block


def test_llama_8b_block_is_two_mebibytes():
    # A 16-token block of an 8B Llama (32 layers, 8 KV heads, d=128, bf16) is 2 MiB.
    layout = KVLayout(32, 8, 128, 16, torch.bfloat16)
    assert layout.bytes_per_block == 2 * 1024 * 1024


def test_fingerprint_is_16_bytes_and_equal_for_equal_layouts():
    a, b = make_layout(), make_layout()
    assert a == b and a is not b
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("change", [
    {"num_layers": 3}, {"num_kv_heads": 4}, {"head_dim": 16}, {"block_size": 8},
    {"dtype": torch.bfloat16}, {"dtype": torch.float32},
])
def test_fingerprint_changes_with_every_field(change):
    base = make_layout()
    other = make_layout(**change)
    assert other.fingerprint() != base.fingerprint()
    assert other.describe() != base.describe()


def test_fingerprint_is_stable_across_processes():
    code = ("import torch; from kvtier.layout import KVLayout; "
            "print(KVLayout(2, 2, 8, 4, torch.float16).fingerprint().hex())")
    outputs = set()
    for seed in ("1", "2"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        outputs.add(result.stdout.strip())
    assert outputs == {make_layout().fingerprint().hex()}


def test_layout_is_frozen():
    layout = make_layout()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.block_size = 8


@pytest.mark.parametrize("name,dtype", [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16),
    ("half", torch.float16), ("float32", torch.float32), ("FP32", torch.float32),
    (torch.float16, torch.float16),
])
def test_parse_dtype_accepts_names_and_aliases(name, dtype):
    assert parse_dtype(name) == dtype
    assert parse_dtype(dtype_name(dtype)) == dtype


@pytest.mark.parametrize("bad", ["int8", "float64", torch.int32])
def test_parse_dtype_rejects_unsupported(bad):
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(bad)
