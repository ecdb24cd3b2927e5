"""The CUDA IPC transport's settings and the decode side's lending, in one process (the two
processes of a handoff: tests/cli/test_handoff_cuda_ipc.py): bad settings and a CPU engine
are clear errors, and unless told it is on for a prefill or decode instance on a GPU; a
receive buffer lends each handoff at most a quarter of its rows, refuses a handoff once none
are free and takes rows back when a handoff closes; an offer this process cannot use is
refused saying why; a commit naming a row not lent to its handoff is a miss."""

from __future__ import annotations

import pytest
import torch

from kvtier.handoff.base import TransportError
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

        root = namespace_hash(b"model", LAYOUT, "xxh3_128", None)
        tokens = list(range(100, 104))
        meta = metas_for(root, hash_blocks(root, tokens, 4), tokens, 4)[0]
        header = encode_header(meta, LAYOUT, LAYOUT.bytes_per_block, 0).hex()
        dests = transport.receive_buffer(1)
        # A row lent to another handoff: a miss, whatever its bytes and header say.
        assert channels[0].receive_into([{"index": 0, "row": lent[2][0], "header": header}],
                                        [meta], dests) == [False]

        offer = channels[0].offer()
        assert transport.sees(offer["gpu"]) and not transport.sees("GPU-elsewhere")
        with pytest.raises(ValueError, match="is not visible to this process"):
            transport.open_send(dict(offer, gpu="GPU-00000000-0000-0000-0000-000000000000"))
        with pytest.raises(ValueError, match="the two layouts differ"):
            transport.open_send(dict(offer, row_bytes=offer["row_bytes"] * 2))
        with pytest.raises(ValueError, match="needs gpu, rows, row_bytes and buffer"):
            transport.open_send({"gpu": offer["gpu"]})
    finally:
        transport.close()
