"""The CUDA IPC transport's settings and the decode side's lending, in one process (the two
processes of a handoff: tests/cli/test_handoff_cuda_ipc.py): bad settings and a CPU engine
are clear errors, and unless told it is on for a prefill or decode instance on a GPU; a
receive buffer lends each handoff at most a quarter of its rows, refuses a handoff once none
are free and takes rows back when a handoff closes; an offer this process cannot use is
refused saying why; a commit naming a row not lent to its handoff is a miss."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.handoff.base import OutgoingBlock, TransportError
from kvtier.handoff.config import HandoffConfig, open_transports
from kvtier.handoff.cuda_ipc import CudaIpcTransport
from kvtier.hashing import hash_blocks, namespace_hash
from kvtier.layout import KVLayout
from kvtier.tiers.record import encode_header, metas_for

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)


def test_cuda_ipc_needs_a_cuda_engine_and_sane_settings() -> None:
    with pytest.raises(ValueError, match="cuda_ipc_mib must be >= 1"):
        HandoffConfig(role="decode", cuda_ipc=True, cuda_ipc_mib=0)
    with pytest.raises(ValueError, match="--handoff-cuda-ipc on needs an engine on a CUDA"):
        open_transports(HandoffConfig(role="decode", cuda_ipc=True), LAYOUT,
                        torch.device("cpu"))
    # Unset, it is on for the two roles of a disaggregated pair on GPUs only.
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [HandoffConfig(role=role).uses_cuda_ipc(device) for role, device in
            (("prefill", gpu), ("decode", gpu), ("both", gpu), ("decode", cpu))] \
        == [True, True, False, False]
    assert not HandoffConfig(role="decode", cuda_ipc=False).uses_cuda_ipc(gpu)
    assert open_transports(HandoffConfig(role="decode"), LAYOUT, cpu) == {}
    with pytest.raises(ValueError, match="needs CUDA devices"):
        CudaIpcTransport(LAYOUT, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_receive_buffer_is_lent_in_quarters_and_taken_back() -> None:
    transport = CudaIpcTransport(LAYOUT, torch.device("cuda", 0),
                                 receive_bytes=8 * LAYOUT.bytes_per_block)
    try:
        channels = [transport.open_receive(f"h{k}", 10) for k in range(4)]
        lent = [channel.offer()["rows"] for channel in channels]
        assert all(len(rows) == 2 for rows in lent)
        assert sorted(row for rows in lent for row in rows) == list(range(8))
        with pytest.raises(TransportError, match="every CUDA IPC receive row is lent"):
            transport.open_receive("h4", 10)
        assert transport.open_receive("held", 0).offer()["rows"] == []  # nothing to send
        channels[1].close()
        assert sorted(transport.open_receive("h5", 1).offer()["rows"]) == [lent[1][0]]

        meta = _metas()[0]
        header = encode_header(meta, LAYOUT, LAYOUT.bytes_per_block, 0).hex()
        dests = transport.receive_buffer(1)
        # A row lent to another handoff: a miss, whatever its bytes and header say.
        assert channels[0].receive_into([{"index": 0, "row": lent[2][0], "header": header}],
                                        [meta], dests) == [False]

        offer = channels[0].offer()
        assert transport.sees(offer["gpu"]) and not transport.sees("GPU-elsewhere")
        assert transport.reaches(transport.peer_info()) and not transport.reaches(None)
        assert not transport.reaches({"gpu": "GPU-elsewhere"})
        with pytest.raises(ValueError, match="is not visible to this process"):
            transport.open_send(dict(offer, gpu="GPU-00000000-0000-0000-0000-000000000000"))
        with pytest.raises(ValueError, match="the two layouts differ"):
            transport.open_send(dict(offer, row_bytes=offer["row_bytes"] * 2))
        with pytest.raises(ValueError, match="needs gpu, rows, row_bytes and buffer"):
            transport.open_send({"gpu": offer["gpu"]})
    finally:
        transport.close()


# The decode side in a process of its own (CUDA IPC opens only another process's export):
# it prints its offer, then for each line of commit entries validates them into rows and
# prints, per block, whether it was accepted and the rows' bytes as a sum.
_DECODE_SIDE = """
import json, sys, torch
from kvtier.handoff.cuda_ipc import CudaIpcTransport
from kvtier.layout import KVLayout
sys.path.insert(0, sys.argv[2])
from test_handoff_cuda_ipc import LAYOUT, _metas
transport = CudaIpcTransport(LAYOUT, torch.device(sys.argv[1]),
                             receive_bytes=8 * LAYOUT.bytes_per_block)
channel = transport.open_receive("h", 2)
print(json.dumps(channel.offer()), flush=True)
for line in sys.stdin:
    entries = json.loads(line)
    metas = _metas()
    dests = transport.receive_buffer(len(entries))
    accepted = channel.receive_into(entries, [metas[e["index"]] for e in entries], dests)
    sums = dests.to(torch.int64).sum(dim=1).tolist()
    print(json.dumps({"accepted": accepted, "sums": sums}), flush=True)
"""


def _metas():
    root = namespace_hash(b"model", LAYOUT, "xxh3_128", None)
    tokens = list(range(100, 112))
    return metas_for(root, hash_blocks(root, tokens, 4), tokens, 4)


class _DecodeSide:
    def __init__(self, device: str) -> None:
        import subprocess
        import sys
        from pathlib import Path

        self.process = subprocess.Popen(
            [sys.executable, "-c", _DECODE_SIDE, device, str(Path(__file__).parent)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.offer = json.loads(self.process.stdout.readline())

    def commit(self, entries: list) -> dict:
        self.process.stdin.write(json.dumps(entries) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_copied_from_their_cache_rows_land_checked_in_another_process() -> None:
    decode_device = f"cuda:{torch.cuda.device_count() - 1}"
    prefill = CudaIpcTransport(LAYOUT, torch.device("cuda", 0))
    # The prefill's KV cache as rows of one block: [6, bytes_per_block] uint8
    cache = torch.randint(0, 256, (6, LAYOUT.bytes_per_block), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(3)).cuda()
    metas = _metas()
    first = _DecodeSide(decode_device)
    try:
        channel = prefill.open_send(first.offer)
        assert channel.reads_in_place and (channel.capacity, channel.in_flight) == (1, 2)
        for index, row in enumerate((4, 1, 5)):  # three sends through two turns of a row
            entries = channel.send([OutgoingBlock(index, metas[index], cache[row],
                                                  cache_row=row)])
            answer = first.commit(entries)
            assert answer == {"accepted": [True],
                              "sums": [int(cache[row].to(torch.int64).sum())]}
            channel.committed()
        # A header whose checksum says other bytes: rejected, as a damaged block would be.
        entries = channel.send([OutgoingBlock(0, metas[0], cache[2], cache_row=2)])
        header = bytearray.fromhex(entries[0]["header"])
        header[-1] ^= 1
        assert first.commit([dict(entries[0], header=header.hex())])["accepted"] == [False]
        channel.committed()
        channel.close()
        assert prefill.num_mapped == 1
    finally:
        first.close()
    # The decode instance restarted: its new export replaces the old mapping.
    second = _DecodeSide(decode_device)
    try:
        channel = prefill.open_send(second.offer)
        entries = channel.send([OutgoingBlock(1, metas[1], cache[3], cache_row=3)])
        assert second.commit(entries)["accepted"] == [True]
        channel.committed()
        channel.close()
        assert prefill.num_mapped == 1
    finally:
        second.close()
        prefill.close()
