"""What a handoff checks on arrival, without engines: whole records (the Mooncake and Redis
transports) and the NCCL transport's device checksum."""

from __future__ import annotations

import pytest
import torch

from kvtier.handoff.base import (
    OutgoingBlock,
    cache_rows,
    check_records,
    device_checksum,
    payload_rows,
)
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.record import encode_record, metas_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)


def _blocks(salt: str | None = None):
    root = namespace_hash(b"model", LAYOUT, "xxh3_128", salt)
    tokens = list(range(100, 112))
    metas = metas_for(root, hash_blocks(root, tokens, 4), tokens, 4)
    payloads = torch.randint(0, 256, (3, LAYOUT.bytes_per_block), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
    return metas, payloads


def test_a_record_is_used_only_when_intact_and_the_block_asked_for() -> None:
    metas, payloads = _blocks()
    records = [encode_record(meta, LAYOUT, row.numpy()) for meta, row in zip(metas, payloads)]
    damaged = bytearray(records[1])
    damaged[-3] ^= 0x01  # one payload bit
    dests = torch.zeros_like(payloads)
    assert check_records([records[0], bytes(damaged), None], metas, LAYOUT, dests) \
        == [True, False, False]
    assert torch.equal(dests[0], payloads[0])
    # Another tenant's record (another namespace), another dtype's, another block's.
    theirs, _ = _blocks("another tenant")
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                     dtype=torch.bfloat16)
    foreign = [encode_record(theirs[0], LAYOUT, payloads[0].numpy()),
               encode_record(metas[1], other, payloads[1].numpy()),
               records[1]]
    assert check_records(foreign, metas, LAYOUT, torch.zeros_like(payloads)) \
        == [False, False, False]


def test_the_device_checksum_changes_with_any_word() -> None:
    _, payloads = _blocks()
    sums = device_checksum(payloads)
    assert sums == device_checksum(payloads.clone()) and len(set(sums)) == 3
    assert all(0 <= s < 2**64 for s in sums)
    for word in (0, 7, LAYOUT.bytes_per_block // 4 - 1):
        changed = payloads.clone()
        changed[1, 4 * word] ^= 0x80
        assert device_checksum(changed)[1] != sums[1]
    swapped = payloads.clone()
    swapped[2, 0:4], swapped[2, 4:8] = payloads[2, 4:8].clone(), payloads[2, 0:4].clone()
    assert not torch.equal(payloads[2, 0:4], payloads[2, 4:8])
    assert device_checksum(swapped)[2] != sums[2]


@pytest.mark.gpu
def test_the_device_checksum_is_the_same_on_the_gpu() -> None:
    _, payloads = _blocks()
    assert device_checksum(payloads.cuda()) == device_checksum(payloads)


def test_a_gathered_group_is_sent_as_it_is_and_other_payloads_stacked() -> None:
    cache = torch.arange(6 * 32, dtype=torch.int64).to(torch.uint8).view(6, 32)
    gathered = cache[torch.tensor([5, 1, 3, 0])]  # one gathered copy, as the sender makes
    group = [OutgoingBlock(i, None, gathered[i]) for i in range(1, 4)]
    rows = payload_rows(group)
    assert rows.data_ptr() == gathered[1].data_ptr()  # no copy
    assert torch.equal(rows, gathered[1:])
    shuffled = [OutgoingBlock(i, None, gathered[i]) for i in (2, 0, 3)]
    rows = payload_rows(shuffled)
    assert rows.data_ptr() != gathered.data_ptr()
    assert torch.equal(rows, gathered[torch.tensor([2, 0, 3])])



def test_blocks_read_in_place_are_found_as_rows_of_their_cache() -> None:
    storage = torch.arange(8 * 32, dtype=torch.int64).to(torch.uint8)
    cache = storage[32:].view(7, 32)  # a cache that does not start its storage
    blocks = [OutgoingBlock(k, None, cache[row], cache_row=row) for k, row in
              enumerate((5, 0, 3))]
    table, rows = cache_rows(blocks)
    assert rows == [5, 0, 3] and table.shape == (6, 32)
    assert table.data_ptr() == cache.data_ptr() and torch.equal(table, cache[:6])
    with pytest.raises(ValueError, match="needs its cache_row"):
        cache_rows([OutgoingBlock(0, None, cache[1])])
    elsewhere = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="its row of one KV cache"):
        cache_rows([blocks[0], OutgoingBlock(3, None, elsewhere, cache_row=1)])
    with pytest.raises(ValueError, match="its row of one KV cache"):
        cache_rows([blocks[0], OutgoingBlock(3, None, cache[2], cache_row=4)])


def test_the_device_checksum_of_rows_named_is_theirs() -> None:
    _, payloads = _blocks()
    assert device_checksum(payloads, [2, 0]) == device_checksum(payloads[[2, 0]])
