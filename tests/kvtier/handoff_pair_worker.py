"""One rank of a torch.distributed handoff pair on gloo, for tests/kvtier/test_handoff_order.py;
prints what it saw as one JSON object.

    python -m tests.kvtier.handoff_pair_worker ROLE INIT_METHOD

ROLE sender: posts send 0 (rows of 0s) and send 1 (rows of 1s), no commit for either; once
the pair has formed again (after a receiver broke it), posts the first send of the new
generation (rows of 7s); then waits to be stopped. ROLE landing: opens a receive channel,
waits until both sends have landed though nothing asked for them, then takes send 1 before
send 0; prints each one's bytes. ROLE lost: asks for send 2, which was never posted (as if
its bytes had been lost); prints the error and whether the transport still says it is
ready. ROLE reform: as lost, then waits for the pair to form again, tries send 1 of the old
generation once more, and receives the new generation's first send.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvtier.handoff.base import TransportError
from kvtier.handoff.torch_dist import DECODE_RANK, PREFILL_RANK, TorchDistTransport
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
#: The turn timeout of the lost role (the others wait as long as a loaded machine may need).
LOST_TURN_TIMEOUT_S = 1.0


def main(role: str, init_method: str) -> dict:
    rank = PREFILL_RANK if role == "sender" else DECODE_RANK
    transport = TorchDistTransport(
        LAYOUT, init_method, rank, "gloo", timeout_s=60.0,
        turn_timeout_s=LOST_TURN_TIMEOUT_S if role in ("lost", "reform") else 60.0)
    try:
        return _act(role, transport)
    finally:  # its threads leave torch.distributed before the process ends
        transport.close()


def _act(role: str, transport: TorchDistTransport) -> dict:
    if not transport.wait_ready(60.0):
        return {"error": "the pair did not form"}
    rows = [torch.full((2, LAYOUT.bytes_per_block), k, dtype=torch.uint8) for k in (0, 1)]
    if role == "sender":
        posted = [transport.post_send(r) for r in rows]  # (seq, work): the work kept alive
        print(json.dumps({"posted": [seq for seq, _ in posted]}), flush=True)
        if _formed_again(transport):
            sevens = torch.full((2, LAYOUT.bytes_per_block), 7, dtype=torch.uint8)
            posted.append(transport.post_send(sevens))  # kept alive, as its rows are
        time.sleep(600)  # until the test stops this process
    received = [torch.full((2, LAYOUT.bytes_per_block), 9, dtype=torch.uint8) for _ in rows]
    if role in ("lost", "reform"):
        began = time.monotonic()
        try:
            transport.receive_into(received[1], 2)
        except TransportError as exc:
            seen = {"error": str(exc), "seconds": time.monotonic() - began,
                    "ready": transport.ready}
        else:
            return {"error": None}
        # Either way the pair forms again: waited for, so that the process does not end
        # while its keeper is inside torch.distributed.
        seen["formed_again"] = _formed_again(transport)
        if role == "lost":
            return seen
        seen["generation"] = transport.generation
        try:
            transport.receive_into(received[1], 1, 0)
            seen["old_send"] = "received"
        except TransportError as exc:
            seen["old_send"] = str(exc)
        transport.receive_into(received[0], 0)
        seen["values"] = sorted(set(received[0].flatten().tolist()))
        return seen
    channel = transport.open_receive("a handoff", 4)
    deadline = time.monotonic() + 60.0
    while transport.landed_ahead < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    landed_ahead = transport.landed_ahead
    transport.receive_into(received[1], 1)
    transport.receive_into(received[0], 0)
    channel.close()
    return {"landed_ahead": landed_ahead, "left": transport.landed_ahead,
            "values": [sorted(set(r.flatten().tolist())) for r in received]}


def _formed_again(transport: TorchDistTransport) -> bool:
    """Wait (up to 60 s) until the pair is ready in a generation after the first."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if transport.ready and (transport.generation or 0) > 0:
            return True
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
