"""The Mooncake Transfer Engine as a handoff transport (TCP here, RDMA where NICs exist).

The decode side registers one receive buffer with its engine, carved into record-sized
slots; a reservation lends the handoff up to `ring` of them and offers their addresses with
the engine's session name ("host:rpc_port", P2PHANDSHAKE metadata: no metadata server). The
prefill side assembles records in a registered buffer of its own and writes them into the
lent slots with one-sided batch writes, then commits: the decode side validates each
record where it landed and the slots are reused by the next group. Needs the
`mooncake-transfer-engine` wheel (`pip install 'kvtier[disagg]'`; on a CPU machine the
`-non-cuda` one, and libibverbs).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    ReceiveChannel,
    SendChannel,
    TransportError,
    check_records,
    slot_bytes,
)
from kvtier.layout import KVLayout
from kvtier.tiers.record import BlockMeta, assemble_record


def mooncake_available() -> str | None:
    """None when the Mooncake engine can be imported, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:  # the wheel missing, or libibverbs
        return (f"the Mooncake Transfer Engine is not importable ({exc}); install "
                "`mooncake-transfer-engine` (GPU) or `mooncake-transfer-engine-non-cuda` "
                "(CPU, needs libibverbs1): pip install 'kvtier[disagg]'")
    return None


class MooncakeTransport(HandoffTransport):
    """One Mooncake engine of this process. hostname: the address peers reach it at.
    protocol: "tcp" or "rdma" (device_name: the RDMA NICs, "" for TCP). receive_slots:
    record slots of the receive buffer (allocated at the first reservation). ring: slots
    lent to one handoff. Raises ValueError when Mooncake is missing, TransportError when
    its engine does not start."""

    name = "mooncake"

    def __init__(self, layout: KVLayout, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", receive_slots: int = 64, ring: int = 16) -> None:
        missing = mooncake_available()
        if missing is not None:
            raise ValueError(missing)
        if receive_slots < 1 or ring < 1:
            raise ValueError(f"receive_slots and ring must be >= 1, got {receive_slots}, {ring}")
        from mooncake.engine import TransferEngine

        self.layout = layout
        self.slot_bytes = slot_bytes(layout)
        self.receive_slots, self.ring = receive_slots, ring
        self._engine = TransferEngine()
        if self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise TransportError(f"the Mooncake engine did not start on {hostname} "
                                 f"({protocol}); check the address and the NICs")
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._buffer: np.ndarray | None = None  # [receive_slots * slot_bytes] uint8
        self._free: deque[int] = deque()
        self._closed = False

    @property
    def buffer_address(self) -> int:
        assert self._buffer is not None
        return self._buffer.ctypes.data

    def _receive_buffer(self) -> np.ndarray:
        """The registered receive buffer (lock held)."""
        if self._buffer is None:
            buffer = np.zeros(self.receive_slots * self.slot_bytes, dtype=np.uint8)
            if self._engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
                raise TransportError(f"Mooncake could not register a {buffer.nbytes}-byte "
                                     "receive buffer")
            self._buffer = buffer
            self._free.extend(range(self.receive_slots))
        return self._buffer

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        with self._lock:
            buffer = self._receive_buffer()
            if num_blocks and not self._free:
                raise TransportError("every Mooncake receive slot is lent to a handoff; "
                                     "retry, or raise the receive slots")
            slots = [self._free.popleft()
                     for _ in range(min(num_blocks, self.ring, len(self._free)))]
        return _Receive(self, buffer, slots)

    def _give_back(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def open_send(self, offer: Json) -> SendChannel:
        try:
            session = str(offer["session"])
            addresses = [int(a) for a in offer["slots"]]
            room = int(offer["slot_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a Mooncake offer needs session, slots and slot_bytes: "
                             f"{exc}") from exc
        if room < self.slot_bytes:
            raise ValueError(f"the decode side's slots hold {room} bytes, a record here "
                             f"needs up to {self.slot_bytes}: the two layouts differ")
        return _Send(self, session, addresses)

    def write(self, session: str, sources: list[int], targets: list[int],
              lengths: list[int]) -> None:
        """One-sided writes of `lengths[i]` bytes from local `sources[i]` to the peer's
        `targets[i]`; raises TransportError when the engine reports a failure."""
        if self._engine.batch_transfer_sync_write(session, sources, targets, lengths) != 0:
            raise TransportError(f"Mooncake writes to {session} failed")

    def register(self, buffer: np.ndarray) -> None:
        if self._engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
            raise TransportError(f"Mooncake could not register a {buffer.nbytes}-byte buffer")

    def unregister(self, buffer: np.ndarray) -> None:
        self._engine.unregister_memory(buffer.ctypes.data)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._buffer is not None:
                self._engine.unregister_memory(self._buffer.ctypes.data)


class _Receive(ReceiveChannel):
    def __init__(self, transport: MooncakeTransport, buffer: np.ndarray,
                 slots: list[int]) -> None:
        self.transport, self.buffer, self.slots = transport, buffer, slots
        self._closed = False

    def offer(self) -> Json:
        base, size = self.transport.buffer_address, self.transport.slot_bytes
        return {"session": self.transport.session, "slot_bytes": size,
                "slots": [base + slot * size for slot in self.slots]}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        size = self.transport.slot_bytes
        records: list[memoryview | None] = []
        view = memoryview(self.buffer)
        for entry in entries:
            k, length = int(entry.get("slot", -1)), int(entry.get("length", 0))
            if not 0 <= k < len(self.slots) or not 0 < length <= size:
                records.append(None)  # not a slot of this handoff: a miss
                continue
            at = self.slots[k] * size
            records.append(view[at:at + length])
        return check_records(records, metas, self.transport.layout, dests)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport._give_back(self.slots)


class _Send(SendChannel):
    def __init__(self, transport: MooncakeTransport, session: str, targets: list[int]) -> None:
        self.transport, self.session, self.targets = transport, session, targets
        self.capacity = max(1, len(targets))
        # Records are assembled here and written from here: [capacity * slot_bytes] uint8
        self.buffer = np.zeros(len(targets) * transport.slot_bytes, dtype=np.uint8)
        self._registered = False
        if targets:
            transport.register(self.buffer)
            self._registered = True

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        assert len(blocks) <= len(self.targets), "more blocks than slots lent"
        size = self.transport.slot_bytes
        base = self.buffer.ctypes.data
        entries, lengths = [], []
        for k, block in enumerate(blocks):
            record = assemble_record(block.meta, self.transport.layout, block.host_payload(),
                                     self.buffer[k * size:(k + 1) * size])
            lengths.append(record.nbytes)
            entries.append({"index": block.index, "slot": k, "length": record.nbytes})
        if blocks:
            self.transport.write(self.session, [base + k * size for k in range(len(blocks))],
                                 self.targets[:len(blocks)], lengths)
        return entries

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self.transport.unregister(self.buffer)
