"""torch.distributed point-to-point as a handoff transport: NCCL between GPUs of one host
(or across hosts), and the same code with gloo on CPU tensors (how CI runs it).

The two instances form a group of two at start (`init_method`, e.g. "tcp://10.0.0.1:29500";
the prefill instance is rank 0, the decode instance rank 1); forming it runs in the
background, and the transport is not `ready` until it has. A send assembles a group of
records into one buffer and posts one `isend` of it; the commit that follows names each
record's length, and the decode side posts the matching `recv`, then validates every
record. Sends are serialized per process (a group's send holds the transport until its
commit is answered), so the bytes and the commits that announce them stay in one order;
a commit the decode side cannot match (an expired handoff) still receives its bytes
(`discard`). A failed send or receive leaves the pair out of step: the transport then says
it is not ready, and handoffs use another transport or none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta

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

log = logging.getLogger("kvtier.handoff")

PREFILL_RANK, DECODE_RANK = 0, 1


class TorchDistTransport(HandoffTransport):
    """The pair's group. rank: PREFILL_RANK or DECODE_RANK. backend: "nccl" (CUDA tensors)
    or "gloo" (CPU tensors). timeout_s: how long forming the group and each operation may
    take. batch: blocks per send. Raises ValueError for a bad setting."""

    name = "nccl"

    def __init__(self, layout: KVLayout, init_method: str, rank: int, backend: str = "nccl",
                 timeout_s: float = 600.0, batch: int = 32) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"the handoff's torch.distributed backend must be nccl or gloo, "
                             f"got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the nccl backend needs CUDA; use gloo on a CPU machine")
        if rank not in (PREFILL_RANK, DECODE_RANK):
            raise ValueError(f"rank must be {PREFILL_RANK} (prefill) or {DECODE_RANK} "
                             f"(decode), got {rank}")
        if not init_method.startswith(("tcp://", "file://", "env://")):
            raise ValueError(f"init_method must be tcp://host:port (or file://, env://), got "
                             f"{init_method!r}")
        self.layout, self.rank, self.backend, self.batch = layout, rank, backend, batch
        self.peer = DECODE_RANK if rank == PREFILL_RANK else PREFILL_RANK
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self.slot_bytes = slot_bytes(layout)
        self._group_formed = threading.Event()
        self._broken: str | None = None
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        self._joiner = threading.Thread(target=self._form_group,
                                        args=(init_method, timeout_s),
                                        name="kvtier-handoff-group", daemon=True)
        self._joiner.start()

    def _form_group(self, init_method: str, timeout_s: float) -> None:
        import torch.distributed as dist

        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend, init_method=init_method, rank=self.rank,
                                    world_size=2, timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 (reported through `ready` and the log)
            self._broken = f"the group did not form: {exc}"
            log.error("handoff over %s: %s", self.backend, self._broken)
            return
        self._group_formed.set()

    @property
    def ready(self) -> bool:
        return self._group_formed.is_set() and self._broken is None and not self._closed

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group has formed (False: not within `timeout_s`, or failed)."""
        return self._group_formed.wait(timeout_s) and self.ready

    def _check(self) -> None:
        if not self.ready:
            raise TransportError(self._broken or "the torch.distributed group has not formed "
                                 "yet (the other instance has not started?)")

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        self._check()
        return _Receive(self)

    def open_send(self, offer: Json) -> SendChannel:
        self._check()
        if offer.get("rank") != self.peer:
            raise ValueError(f"the decode side is rank {offer.get('rank')}, this instance's "
                             f"peer is rank {self.peer}")
        return _Send(self)

    def receive(self, lengths: Sequence[int]) -> np.ndarray:
        """Receive one group's records (their lengths as announced) as host bytes."""
        import torch.distributed as dist

        self._check()
        buffer = torch.empty(sum(lengths), dtype=torch.uint8, device=self.device)
        with self._recv_lock:
            try:
                dist.recv(buffer, src=self.peer)
            except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
                self._broken = f"a receive failed: {exc}"
                raise TransportError(self._broken) from exc
        return buffer.cpu().numpy()

    def discard(self, entries: Sequence[Json]) -> None:
        try:
            self.receive(_lengths(entries, self.slot_bytes))
        except (TransportError, ValueError):
            pass

    def close(self) -> None:
        self._closed = True


def _lengths(entries: Sequence[Json], limit: int) -> list[int]:
    lengths = [int(entry.get("length", 0)) for entry in entries]
    if any(not 0 < n <= limit for n in lengths):
        raise ValueError(f"a record length is outside (0, {limit}]")
    return lengths


class _Receive(ReceiveChannel):
    def __init__(self, transport: TorchDistTransport) -> None:
        self.transport = transport

    def offer(self) -> Json:
        return {"rank": self.transport.rank}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: np.ndarray) -> list[bool]:
        data = self.transport.receive(_lengths(entries, self.transport.slot_bytes))
        records, at = [], 0
        for entry in entries:
            length = int(entry["length"])
            records.append(memoryview(data[at:at + length]))
            at += length
        return check_records(records, metas, self.transport.layout, dests)


class _Send(SendChannel):
    def __init__(self, transport: TorchDistTransport) -> None:
        self.transport = transport
        self.capacity = transport.batch
        self._work = None
        self._tensor: torch.Tensor | None = None
        self._holding = False

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        import torch.distributed as dist

        transport = self.transport
        transport._check()
        size = transport.slot_bytes
        buffer = np.empty(len(blocks) * size, dtype=np.uint8)
        entries, at = [], 0
        for block in blocks:
            record = assemble_record(block.meta, transport.layout, block.payload,
                                     buffer[at:at + size])
            entries.append({"index": block.index, "length": record.nbytes})
            at += record.nbytes
        if not blocks:
            return []
        transport._send_lock.acquire()  # until `committed`: bytes and commits in one order
        self._holding = True
        try:
            self._tensor = torch.from_numpy(buffer[:at]).to(transport.device)
            self._work = dist.isend(self._tensor, dst=transport.peer)
        except Exception as exc:  # noqa: BLE001
            transport._broken = f"a send failed: {exc}"
            self._unhold()
            raise TransportError(transport._broken) from exc
        return entries

    def committed(self) -> None:
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as exc:  # noqa: BLE001
                self.transport._broken = f"a send failed: {exc}"
                raise TransportError(self.transport._broken) from exc
            finally:
                self._work, self._tensor = None, None
                self._unhold()

    def _unhold(self) -> None:
        if self._holding:
            self._holding = False
            self.transport._send_lock.release()

    def close(self) -> None:
        if self._work is not None:
            # A send whose commit failed: its bytes may never be received; the pair can no
            # longer be trusted to line up.
            self.transport._broken = "a send was never committed"
            self._work, self._tensor = None, None
        self._unhold()
