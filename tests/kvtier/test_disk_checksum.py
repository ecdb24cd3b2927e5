"""The disk tier's copy-and-checksum: on reads (`copy_checksummed` into the caller's tensor)
the same checksum as a hash of the bytes, and damage anywhere in a block is a miss; on
writes (`assemble_record`) exactly the record `encode_record` gives, so the on-disk format is
unchanged."""

from __future__ import annotations

import lmdb
import numpy as np
import pytest
import torch
from disk_cases import make_blocks, read_back, same_bytes

from kvtier.layout import KVLayout
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.record import (
    BlockMeta,
    assemble_record,
    copy_checksummed,
    encode_record,
    payload_checksum,
    record_size,
)

# 640 KiB blocks.
BIG_BLOCK = KVLayout(num_layers=10, num_kv_heads=2, head_dim=64, block_size=128,
                       dtype=torch.float16)


@pytest.mark.parametrize("num_bytes", [0, 1, 4095, 4096, (2 << 20) + 17])
def test_copy_checksummed_copies_and_matches_one_pass(num_bytes):
    src = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8)
    dest = np.zeros(num_bytes, dtype=np.uint8)
    assert copy_checksummed(src, dest) == payload_checksum(src.tobytes())
    assert np.array_equal(dest, src)


def test_copy_checksummed_refuses_other_lengths():
    with pytest.raises(ValueError, match="cannot copy 10 bytes into 9"):
        copy_checksummed(bytes(10), bytearray(9))


def test_damage_anywhere_in_a_block_is_a_miss(tmp_path):
    metas, payloads = make_blocks(BIG_BLOCK, seed=3, num_blocks=5)
    with DiskTier(tmp_path, BIG_BLOCK, 1 << 28) as tier:
        assert sum(tier.put(metas, payloads)) == 5
    # Flip one payload byte (counted from the value's end) at its first byte, in its middle
    # and at its last byte; blocks 3 and 4 stay intact.
    last = BIG_BLOCK.bytes_per_block - 1
    from_end = [last, last // 2, 0]
    env = lmdb.open(str(tmp_path), max_dbs=8, map_size=1 << 28)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for meta, offset in zip(metas, from_end):
            value = bytearray(txn.get(meta.block_hash, db=blocks))
            value[len(value) - 1 - offset] ^= 0x04
            txn.put(meta.block_hash, bytes(value), db=blocks)
    env.close()
    with DiskTier(tmp_path, BIG_BLOCK, 1 << 28) as tier:
        # One call: the five are read in runs (the rewritten three lie apart from the rest).
        dests = [torch.empty(BIG_BLOCK.block_shape, dtype=BIG_BLOCK.dtype) for _ in metas]
        assert tier.get_many_into(metas, dests) == [False] * 3 + [True] * 2
        assert same_bytes(dests[3], payloads[3]) and same_bytes(dests[4], payloads[4])
        assert same_bytes(read_back(tier, metas[4]), payloads[4])
        assert tier.stats().rejected == 3
        assert tier.contains([m.block_hash for m in metas]) == [False] * 3 + [True] * 2


def test_assembled_records_are_the_encoded_format():
    metas, payloads = make_blocks(BIG_BLOCK, seed=4, num_blocks=2)
    out = bytearray(BIG_BLOCK.bytes_per_block + 4096)  # larger than a record: reused scratch
    for meta, payload in zip(metas, payloads):
        record = assemble_record(meta, BIG_BLOCK, payload.view(torch.uint8).numpy(), out)
        expected = encode_record(meta, BIG_BLOCK, payload.view(torch.uint8).numpy())
        assert len(record) == record_size(meta, BIG_BLOCK.bytes_per_block) == len(expected)
        assert bytes(record) == expected


def test_assembly_refuses_a_small_buffer_and_bad_token_ids(tmp_path):
    metas, payloads = make_blocks(BIG_BLOCK, seed=5, num_blocks=1)
    payload = payloads[0].view(torch.uint8).numpy()
    with pytest.raises(ValueError, match="does not fit"):
        assemble_record(metas[0], BIG_BLOCK, payload, bytearray(BIG_BLOCK.bytes_per_block))
    bad = BlockMeta(b"x" * 16, metas[0].block_hash, (-1,) * BIG_BLOCK.block_size)
    with pytest.raises(ValueError, match="token ids"):
        record_size(bad, BIG_BLOCK.bytes_per_block)
    # The tier checks token ids before its write transaction: nothing is stored.
    with DiskTier(tmp_path, BIG_BLOCK, 1 << 28) as tier:
        with pytest.raises(ValueError, match="token ids"):
            tier.put([metas[0], bad], [payloads[0], payloads[0]])
        assert tier.stats().num_blocks == 0
