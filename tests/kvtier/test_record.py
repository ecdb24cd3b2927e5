"""The block record format: round trips, and every kind of damage reported as CorruptRecord."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.record import (
    MAGIC,
    RECORD_VERSION,
    BlockMeta,
    CorruptRecord,
    decode_header,
    decode_record,
    dest_array,
    encode_header,
    encode_record,
    metas_for,
    payload_checksum,
    payload_view,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
OTHER_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                        dtype=torch.bfloat16)


def _meta(seed: int = 0) -> BlockMeta:
    parent = namespace_hash("test-model", LAYOUT)
    token_ids = list(range(seed, seed + LAYOUT.block_size))
    (block_hash,) = hash_blocks(parent, token_ids, LAYOUT.block_size)
    return BlockMeta(block_hash, parent, tuple(token_ids))


def _payload(seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.bytes_per_block,
                                                dtype=np.uint8).tobytes()


def _reason(buffer, **kwargs) -> str:
    with pytest.raises(CorruptRecord) as info:
        decode_record(buffer, **kwargs)
    return info.value.reason


def test_round_trip_keeps_every_field():
    meta, payload = _meta(7), _payload(7)
    record = encode_record(meta, LAYOUT, payload)
    header, view = decode_record(record, LAYOUT.fingerprint(), LAYOUT.bytes_per_block)
    assert header.version == RECORD_VERSION
    assert header.layout_fingerprint == LAYOUT.fingerprint()
    assert header.parent_hash == meta.parent_hash
    assert header.token_ids == meta.token_ids
    assert header.num_tokens == LAYOUT.block_size
    assert header.payload_len == len(payload)
    assert header.payload_checksum == payload_checksum(payload)
    assert bytes(view) == payload
    assert header.matches(meta)


def test_header_alone_gives_payload_offset():
    meta, payload = _meta(), _payload()
    head = encode_header(meta, LAYOUT, len(payload), payload_checksum(payload))
    header, offset = decode_header(head + payload)
    assert offset == len(head)
    # 44 fixed bytes + parent hash + 4 bytes per token + 8 bytes of header checksum
    assert offset == 44 + len(meta.parent_hash) + 4 * LAYOUT.block_size + 8
    assert header.token_ids == meta.token_ids


def test_other_tokens_or_parent_do_not_match():
    meta = _meta(3)
    header, _ = decode_header(encode_record(meta, LAYOUT, _payload()))
    assert not header.matches(BlockMeta(meta.block_hash, meta.parent_hash,
                                        meta.token_ids[:-1] + (meta.token_ids[-1] + 1,)))
    assert not header.matches(BlockMeta(meta.block_hash, meta.block_hash, meta.token_ids))
    assert not header.matches(BlockMeta(meta.block_hash, meta.parent_hash, meta.token_ids[:-1]))


def test_flipped_payload_byte_is_bad_checksum():
    record = bytearray(encode_record(_meta(), LAYOUT, _payload()))
    record[-5] ^= 0x01
    assert _reason(record) == "bad checksum"


def test_flipped_token_byte_is_bad_header_checksum():
    meta = _meta()
    record = bytearray(encode_record(meta, LAYOUT, _payload()))
    record[44 + len(meta.parent_hash) + 1] ^= 0x80  # inside the token ids
    assert _reason(record) == "bad header checksum"


def test_bad_magic_and_unknown_version():
    record = encode_record(_meta(), LAYOUT, _payload())
    assert _reason(b"XXXX" + record[4:]) == "bad magic"
    newer = MAGIC + struct.pack("<H", RECORD_VERSION + 1) + record[6:]
    assert _reason(newer) == "unknown version"


@pytest.mark.parametrize("keep", [0, 3, 5, 40, 80, -1])
def test_truncated_records(keep):
    record = encode_record(_meta(), LAYOUT, _payload())
    assert _reason(record[:keep]) == "truncated"


def test_trailing_bytes_and_wrong_expected_length():
    record = encode_record(_meta(), LAYOUT, _payload())
    assert _reason(record + b"\0") == "payload length"
    assert _reason(record, expected_payload_len=LAYOUT.bytes_per_block * 2) == "payload length"


def test_foreign_layout_is_layout_mismatch():
    record = encode_record(_meta(), OTHER_LAYOUT, _payload())
    assert OTHER_LAYOUT.bytes_per_block == LAYOUT.bytes_per_block  # same size, other dtype
    assert _reason(record, expected_fingerprint=LAYOUT.fingerprint()) == "layout mismatch"
    decode_record(record, expected_fingerprint=OTHER_LAYOUT.fingerprint())


def test_block_meta_checks_and_coerces():
    meta = BlockMeta(b"h" * 16, b"p" * 16, [1, 2, 3])
    assert meta.token_ids == (1, 2, 3)
    with pytest.raises(ValueError, match="block_hash"):
        BlockMeta(b"", b"p" * 16, (1,))
    with pytest.raises(ValueError, match="parent_hash"):
        BlockMeta(b"h" * 16, "not bytes", (1,))
    with pytest.raises(ValueError, match="token ids"):
        encode_header(BlockMeta(b"h" * 16, b"p" * 16, (-1,)), LAYOUT, 0, 0)


def test_metas_for_chains_parents():
    parent = namespace_hash("m", LAYOUT)
    token_ids = list(range(10))
    hashes = hash_blocks(parent, token_ids, 4)
    metas = metas_for(parent, hashes, token_ids, 4)
    assert [m.block_hash for m in metas] == hashes
    assert metas[0].parent_hash == parent and metas[1].parent_hash == hashes[0]
    assert metas[1].token_ids == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="hashes"):
        metas_for(parent, hashes + hashes, token_ids, 4)


def test_payload_and_dest_views():
    tensor = torch.randn(LAYOUT.block_shape).to(torch.bfloat16)
    view = payload_view(tensor, LAYOUT.bytes_per_block)
    assert view.nbytes == LAYOUT.bytes_per_block
    assert bytes(view) == tensor.view(torch.uint8).numpy().tobytes()
    assert payload_view(np.zeros(LAYOUT.block_shape, np.float16), view.nbytes).nbytes == view.nbytes
    with pytest.raises(ValueError, match="bytes"):
        payload_view(b"short", view.nbytes)
    with pytest.raises(ValueError, match="contiguous"):
        payload_view(tensor.transpose(0, 1), view.nbytes)
    with pytest.raises(ValueError, match="bytes-like"):
        payload_view([1, 2, 3], view.nbytes)
    array = dest_array(tensor, view.nbytes)
    array[:] = 0
    assert torch.count_nonzero(tensor.float()) == 0  # shares memory with the tensor
    with pytest.raises(ValueError, match="dest"):
        dest_array(torch.empty(3), view.nbytes)


@settings(max_examples=60, deadline=None)
@given(token_ids=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=32),
       parent=st.binary(min_size=1, max_size=64), payload=st.binary(max_size=300),
       flip=st.integers(min_value=0))
def test_any_single_byte_flip_is_detected(token_ids, parent, payload, flip):
    meta = BlockMeta(b"k" * 16, parent, tuple(token_ids))
    record = encode_record(meta, LAYOUT, payload)
    header, view = decode_record(record)
    assert header.token_ids == meta.token_ids and bytes(view) == payload
    damaged = bytearray(record)
    damaged[flip % len(record)] ^= 0xFF
    with pytest.raises(CorruptRecord):
        decode_record(damaged)
