"""Chained block hashes: deterministic, namespaced, full blocks only, incremental == batch."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import (
    HASH_ALGORITHMS,
    BlockHasher,
    encode_token_ids,
    hash_block,
    hash_blocks,
    hash_size,
    namespace_hash,
)
from kvtier.layout import KVLayout

BLOCK_SIZE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE,
                  dtype=torch.float16)


def tokens(num_tokens: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, num_tokens).tolist()


def test_deterministic_across_processes_with_different_hash_seeds():
    code = (
        "import torch\n"
        "from kvtier.hashing import HASH_ALGORITHMS, hash_blocks, namespace_hash\n"
        "from kvtier.layout import KVLayout\n"
        "layout = KVLayout(2, 2, 8, 4, torch.float16)\n"
        "for alg in HASH_ALGORITHMS:\n"
        "    ns = namespace_hash('org/model', layout, alg, cache_salt='tenant')\n"
        "    print(' '.join(h.hex() for h in [ns] + hash_blocks(ns, range(10, 30), 4, alg)))\n"
    )
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env,
                                capture_output=True, text=True, check=True)
        outputs.append(result.stdout.split())
    here = []
    for algorithm in HASH_ALGORITHMS:
        namespace = namespace_hash("org/model", LAYOUT, algorithm, cache_salt="tenant")
        chain = [namespace] + hash_blocks(namespace, list(range(10, 30)), BLOCK_SIZE, algorithm)
        here += [h.hex() for h in chain]
    assert outputs[0] == outputs[1] == here
    assert len(set(here)) == len(HASH_ALGORITHMS) * (1 + 5)


def test_namespaces_give_disjoint_hashes():
    token_ids = tokens(8 * BLOCK_SIZE)
    other_layout = KVLayout(2, 2, 8, BLOCK_SIZE, torch.bfloat16)
    namespaces = {
        "base": ("org/model", LAYOUT, "xxh3_128", None),
        "model": ("org/other-model", LAYOUT, "xxh3_128", None),
        "layout": ("org/model", other_layout, "xxh3_128", None),
        "salt": ("org/model", LAYOUT, "xxh3_128", "tenant-a"),
        "salt2": ("org/model", LAYOUT, "xxh3_128", "tenant-b"),
        "algorithm": ("org/model", LAYOUT, "sha256", None),
    }
    seen: dict[bytes, str] = {}
    for name, (model_id, layout, algorithm, salt) in namespaces.items():
        parent = namespace_hash(model_id, layout, algorithm, salt)
        for block_hash in [parent] + hash_blocks(parent, token_ids, BLOCK_SIZE, algorithm):
            assert block_hash not in seen, f"{name} shares a hash with {seen.get(block_hash)}"
            seen[block_hash] = name
    assert len(seen) == len(namespaces) * 9


@pytest.mark.parametrize("algorithm,size", [("xxh3_128", 16), ("sha256", 32)])
def test_digest_sizes(algorithm, size):
    parent = namespace_hash("m", LAYOUT, algorithm)
    hashes = hash_blocks(parent, tokens(3 * BLOCK_SIZE), BLOCK_SIZE, algorithm)
    assert hash_size(algorithm) == size
    assert len(parent) == size
    assert [len(h) for h in hashes] == [size] * 3
    assert all(isinstance(h, bytes) for h in hashes)


def test_only_full_blocks_are_hashed():
    parent = namespace_hash("m", LAYOUT)
    assert hash_blocks(parent, [], BLOCK_SIZE) == []
    assert hash_blocks(parent, tokens(BLOCK_SIZE - 1), BLOCK_SIZE) == []
    two_and_a_half = tokens(2 * BLOCK_SIZE + BLOCK_SIZE // 2)
    hashes = hash_blocks(parent, two_and_a_half, BLOCK_SIZE)
    assert len(hashes) == 2
    # The partial tail does not enter any hash: changing it changes nothing.
    changed_tail = two_and_a_half[:-1] + [two_and_a_half[-1] + 1]
    assert hash_blocks(parent, changed_tail, BLOCK_SIZE) == hashes
    assert hash_blocks(parent, two_and_a_half[: 2 * BLOCK_SIZE], BLOCK_SIZE) == hashes


def test_hashes_chain_their_parents():
    parent = namespace_hash("m", LAYOUT)
    token_ids = tokens(4 * BLOCK_SIZE)
    hashes = hash_blocks(parent, token_ids, BLOCK_SIZE)
    assert len(set(hashes)) == 4
    # A prefix hashes to a prefix of the hashes.
    assert hash_blocks(parent, token_ids[: 2 * BLOCK_SIZE], BLOCK_SIZE) == hashes[:2]
    # Changing one token of block 1 changes block 1 and every block after it, not block 0.
    changed = list(token_ids)
    changed[BLOCK_SIZE + 1] += 1
    changed_hashes = hash_blocks(parent, changed, BLOCK_SIZE)
    assert changed_hashes[0] == hashes[0]
    assert all(a != b for a, b in zip(changed_hashes[1:], hashes[1:]))
    # Equal tokens in block 3 under different parents give different hashes.
    assert hash_block(hashes[1], token_ids[3 * BLOCK_SIZE:]) != hashes[3]
    assert hash_block(hashes[2], token_ids[3 * BLOCK_SIZE:]) == hashes[3]


def test_extra_keys_enter_every_block():
    parent = namespace_hash("m", LAYOUT)
    token_ids = tokens(3 * BLOCK_SIZE)
    plain = hash_blocks(parent, token_ids, BLOCK_SIZE)
    lora = hash_blocks(parent, token_ids, BLOCK_SIZE, extra_keys=b"lora:7")
    assert not set(plain) & set(lora)
    assert hash_block(parent, token_ids[:BLOCK_SIZE], extra_keys=b"lora:7") == lora[0]


def test_list_and_numpy_inputs_hash_alike():
    parent = namespace_hash("m", LAYOUT)
    token_ids = tokens(5 * BLOCK_SIZE)
    expected = hash_blocks(parent, token_ids, BLOCK_SIZE)
    for dtype in (np.int64, np.uint32, np.int32, np.uint64):
        assert hash_blocks(parent, np.array(token_ids, dtype=dtype), BLOCK_SIZE) == expected
    largest = [2**32 - 1] * BLOCK_SIZE
    assert hash_blocks(parent, np.array(largest, dtype=np.uint32), BLOCK_SIZE) == \
        hash_blocks(parent, largest, BLOCK_SIZE)


def test_encoding_is_little_endian_uint32():
    assert encode_token_ids([1, 256, 2**32 - 1]) == (
        b"\x01\x00\x00\x00" b"\x00\x01\x00\x00" b"\xff\xff\xff\xff")
    assert encode_token_ids(np.array([1, 256], dtype=np.int64)) == encode_token_ids([1, 256])


@settings(max_examples=150, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    block_size=st.integers(1, 7),
    algorithm=st.sampled_from(HASH_ALGORITHMS),
    as_numpy=st.booleans(),
)
def test_incremental_hasher_matches_batch_hashing(token_ids, cuts, block_size, algorithm,
                                                 as_numpy):
    parent = namespace_hash("m", LAYOUT, algorithm)
    hasher = BlockHasher(parent, block_size, algorithm)
    bounds = sorted({0, len(token_ids), *(c for c in cuts if c <= len(token_ids))})
    returned = []
    for start, end in itertools.pairwise(bounds):
        piece = token_ids[start:end]
        new = hasher.extend(np.array(piece, dtype=np.uint32) if as_numpy else piece)
        returned.extend(new)
        assert hasher.num_tokens == end
    expected = hash_blocks(parent, token_ids, block_size, algorithm)
    assert returned == expected
    assert hasher.block_hashes == expected


@pytest.mark.parametrize("bad", [[1, -1, 2, 3], [2**32, 0, 0, 0], [1.5, 0, 0, 0], ["7"]])
def test_bad_token_ids_raise_value_error(bad):
    parent = namespace_hash("m", LAYOUT)
    with pytest.raises(ValueError, match="token ids"):
        hash_blocks(parent, bad, BLOCK_SIZE)
    with pytest.raises(ValueError, match="token ids"):
        encode_token_ids(bad)


@pytest.mark.parametrize("bad", [
    np.array([1, -1, 2, 3]), np.array([2**32, 0, 0, 0]), np.array([1.0, 2.0, 3.0, 4.0]),
    np.zeros((2, 4), dtype=np.int64),
])
def test_bad_token_arrays_raise_value_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        hash_blocks(namespace_hash("m", LAYOUT), bad, BLOCK_SIZE)


@pytest.mark.parametrize("block_size", [0, -4, True, 2.0])
def test_bad_block_size_raises_value_error(block_size):
    parent = namespace_hash("m", LAYOUT)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(parent, tokens(8), block_size)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(parent, block_size)


def test_unknown_algorithm_raises_value_error():
    parent = namespace_hash("m", LAYOUT)
    for call in (lambda: namespace_hash("m", LAYOUT, "md5"),
                 lambda: hash_blocks(parent, tokens(8), BLOCK_SIZE, "md5"),
                 lambda: hash_block(parent, tokens(4), algorithm="md5"),
                 lambda: BlockHasher(parent, BLOCK_SIZE, "md5"),
                 lambda: hash_size("md5")):
        with pytest.raises(ValueError, match="md5"):
            call()


def test_empty_model_id_raises_value_error():
    with pytest.raises(ValueError, match="model_id"):
        namespace_hash("", LAYOUT)


def test_hasher_rejects_bad_tokens_without_changing_state():
    parent = namespace_hash("m", LAYOUT)
    hasher = BlockHasher(parent, BLOCK_SIZE)
    hasher.extend([1, 2, 3])
    with pytest.raises(ValueError, match="token ids"):
        hasher.extend([4, -5, 6, 7, 8])
    assert hasher.num_tokens == 3 and hasher.block_hashes == []
    assert hasher.extend([4, 5]) == hash_blocks(parent, [1, 2, 3, 4, 5], BLOCK_SIZE)
