"""CUDA IPC as a handoff transport between GPUs of one host: the prefill GPU's copy engines
write each block from its row of the KV cache straight into the decode GPU's memory.

Why not only NCCL: NCCL moves bytes in kernels, which wait for the SMs that the prefill's
matrix products hold, and its send needs the blocks gathered first (another kernel); a
copy engine needs no SM. The decode side allocates one receive buffer on its GPU at the
first reservation (`receive_bytes`, rows of one block) and exports it once through torch's
CUDA IPC sharing (a cudaIpcMemHandle, the offset in its allocation, torch's reference
counter). Each reservation lends the handoff rows of it (`in_flight` turns of `group`
blocks, at most a quarter of the buffer, fewer when other handoffs hold the rest; with none
free the reservation is refused and the prefill side takes its next transport) and offers
them with the GPU's UUID. The prefill side maps the buffer into its process once per
decode instance (on its own device, peer access enabled on first use; a UUID this process
cannot see means another host or a hidden GPU: the offer is refused, and NCCL, Mooncake or
Redis go where CUDA IPC cannot). Each send then copies every block from its cache row to a
lent row with the copy engines (`kernels.plan_dma`: one cudaMemcpyBatchAsync; a copy per
run of adjacent rows where the runtime lacks the call), beside a checksum of each block
read where it lies (`kernels.word_checksum` with row ids), which the commit's record
header carries as over NCCL; the decode side copies the announced rows out of the buffer
into the commit's rows and checks every header and payload checksum there.

A handoff's sends take its rows in turns: the next send writes while the last one's commit
is on its way, and an answered commit frees the oldest turn (the decode side takes a
handoff's commits in their order). A row a commit announces must be one lent to that
handoff, else the block is a miss. If a handoff expires at the decode side while its
prefill side still writes, its rows may already be lent again: the checksums then reject
what the late writes spoiled, and those blocks are computed, never used.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.cuda_device import on_stream, urgent_stream
from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    ReceiveChannel,
    SendChannel,
    TransportError,
    cache_rows,
    check_headers,
    device_checksum,
)
from kvtier.kernels import plan_dma
from kvtier.layout import KVLayout
from kvtier.tiers.record import BlockMeta, encode_header

#: The receive buffer unless set (`--handoff-cuda-ipc-mib`): four handoffs of two turns of
#: 256 MiB at once.
DEFAULT_RECEIVE_BYTES = 2 << 30
#: Payload bytes per send: each send costs a commit's round trip, so larger groups lose
#: less to it, at the price of as many rows lent per turn.
DEFAULT_GROUP_BYTES = 256 << 20
#: Sends of one handoff that may await their commits (turns of its lent rows).
DEFAULT_IN_FLIGHT = 2

#: The fields of torch's CUDA IPC export (`UntypedStorage._share_cuda_`), in order; the
#: byte strings among them travel as hex.
_SHARED_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset",
                  "event_handle", "event_sync")
_BYTES_FIELDS = ("handle", "ref_handle", "event_handle")


def gpu_uuid(device: torch.device) -> str:
    """The UUID of CUDA device `device`, as torch prints it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int | None:
    """The index this process gives the GPU of UUID `uuid` (None: not visible here)."""
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None


class CudaIpcTransport(HandoffTransport):
    """This process's end of CUDA IPC handoffs on CUDA device `device` (see the module
    docstring). receive_bytes: the decode side's receive buffer; group_bytes: most payload
    bytes per send (at least one block); in_flight: sends of a handoff that may await their
    commits; turn_timeout_s: how long a send waits for a turn. Raises ValueError for a bad
    setting or without CUDA."""

    name = "cuda_ipc"

    def __init__(self, layout: KVLayout, device: torch.device,
                 receive_bytes: int = DEFAULT_RECEIVE_BYTES,
                 group_bytes: int = DEFAULT_GROUP_BYTES, in_flight: int = DEFAULT_IN_FLIGHT,
                 turn_timeout_s: float = 30.0) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError("the CUDA IPC handoff needs CUDA devices; use nccl (gloo), "
                             "mooncake or redis without them")
        if receive_bytes < layout.bytes_per_block:
            raise ValueError(f"the CUDA IPC receive buffer must hold a block "
                             f"({layout.bytes_per_block} bytes), got {receive_bytes}")
        if group_bytes < 1 or in_flight < 1 or not turn_timeout_s > 0:
            raise ValueError(f"group_bytes, in_flight and turn_timeout_s must be positive, "
                             f"got {group_bytes}, {in_flight}, {turn_timeout_s}")
        self.layout = layout
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.stream = urgent_stream(self.device)
        self.group_rows = max(1, group_bytes // layout.bytes_per_block)
        self.in_flight, self.turn_timeout_s = in_flight, turn_timeout_s
        self.receive_rows = receive_bytes // layout.bytes_per_block
        #: Most rows lent to one handoff: a quarter of the buffer, so that four handoffs
        #: can be under way at once.
        self.lend_rows = max(1, self.receive_rows // 4)
        self.uuid = gpu_uuid(self.device)
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None  # [receive_rows, bytes_per_block] uint8
        self._shared: Json = {}
        self._free: deque[int] = deque()
        #: Prefill side: the decode buffer mapped here, by its GPU's UUID: (the export's
        #: key, the mapping). One per decode GPU: a decode instance that restarted exports
        #: a new buffer, and the old mapping goes once no send holds it, so mappings of
        #: buffers whose instance is gone do not pile up.
        self._mapped: dict[str, tuple[str, torch.Tensor]] = {}

    # ---- the decode side -----------------------------------------------------------------

    def _receive_buffer(self) -> tuple[torch.Tensor, Json]:
        """The exported receive buffer and its export (lock held)."""
        if self._buffer is None:
            try:
                with on_stream(self.stream):
                    buffer = torch.empty((self.receive_rows, self.layout.bytes_per_block),
                                         dtype=torch.uint8, device=self.device)
            except torch.cuda.OutOfMemoryError as exc:
                # Refused like a full buffer: the prefill side takes its next transport.
                raise TransportError(
                    f"no room on {self.device} for the CUDA IPC receive buffer "
                    f"({self.receive_rows * self.layout.bytes_per_block >> 20} MiB); lower "
                    "--handoff-cuda-ipc-mib or the engine's --gpu-memory-utilization") from exc
            shared = buffer.untyped_storage()._share_cuda_()
            self._shared = {name: value.hex() if name in _BYTES_FIELDS else value
                            for name, value in zip(_SHARED_FIELDS, shared)}
            self._buffer = buffer
            self._free.extend(range(self.receive_rows))
        return self._buffer, self._shared

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        with self._lock:
            buffer, shared = self._receive_buffer()
            if num_blocks and not self._free:
                raise TransportError("every CUDA IPC receive row is lent to a handoff; retry, "
                                     "or raise --handoff-cuda-ipc-mib")
            wanted = min(num_blocks, self.in_flight * self.group_rows, self.lend_rows)
            rows = [self._free.popleft() for _ in range(min(wanted, len(self._free)))]
        return _Receive(self, buffer, shared, rows)

    def _give_back(self, rows: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(rows)

    def receive_buffer(self, num_blocks: int) -> torch.Tensor:
        with on_stream(self.stream):
            return super().receive_buffer(num_blocks)

    # ---- the prefill side ----------------------------------------------------------------

    def peer_info(self) -> Json:
        return {"gpu": self.uuid}

    def reaches(self, peer_info: Json | None) -> bool:
        return isinstance(peer_info, dict) and self.sees(peer_info.get("gpu"))

    def sees(self, uuid: object) -> bool:
        """Whether the decode GPU of UUID `uuid` is one this process can reach: visible
        here, and this GPU itself or a peer of it."""
        index = local_index(uuid) if isinstance(uuid, str) else None
        return index is not None and (index == self.device.index
                                      or torch.cuda.can_device_access_peer(self.device.index,
                                                                           index))

    def open_send(self, offer: Json) -> SendChannel:
        try:
            uuid = str(offer["gpu"])
            rows = [int(r) for r in offer["rows"]]
            row_bytes = int(offer["row_bytes"])
            shared = dict(offer["buffer"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a CUDA IPC offer needs gpu, rows, row_bytes and buffer: "
                             f"{exc}") from exc
        if row_bytes != self.layout.bytes_per_block:
            raise ValueError(f"the decode side's rows hold {row_bytes} bytes, a block here "
                             f"{self.layout.bytes_per_block}: the two layouts differ")
        index = local_index(uuid)
        if index is None:
            raise ValueError(f"the decode instance's GPU {uuid} is not visible to this "
                             "process: CUDA IPC works between GPUs of one host that both "
                             "processes see (check CUDA_VISIBLE_DEVICES); use nccl, mooncake "
                             "or redis otherwise")
        if index != self.device.index \
                and not torch.cuda.can_device_access_peer(self.device.index, index):
            raise ValueError(f"cuda:{self.device.index} cannot reach cuda:{index} as a peer; "
                             "use nccl between these GPUs")
        table = self._map(uuid, shared)
        if any(not 0 <= r < table.shape[0] for r in rows):
            raise ValueError(f"the offer lends rows outside the decode buffer's "
                             f"{table.shape[0]}")
        return _Send(self, table, rows)

    def _map(self, uuid: str, shared: Json) -> torch.Tensor:
        """The decode buffer `shared` exports on GPU `uuid`, mapped into this process on
        this device (torch labels it with this device; its bytes are on the peer): uint8
        `[rows, bytes_per_block]`. Raises ValueError for a malformed export and
        TransportError when CUDA cannot open it."""
        try:
            values = [bytes.fromhex(str(shared[name])) if name in _BYTES_FIELDS
                      else shared[name] for name in _SHARED_FIELDS]
            size, offset = int(shared["size"]), int(shared["offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a CUDA IPC offer's buffer is malformed: {exc}") from exc
        if size < self.layout.bytes_per_block or size % self.layout.bytes_per_block:
            raise ValueError(f"the decode buffer's {size} bytes are not whole rows of "
                             f"{self.layout.bytes_per_block}")
        key = f"{shared['handle']}:{offset}"
        with self._lock:
            mapped = self._mapped.get(uuid)
            if mapped is not None and mapped[0] == key:
                return mapped[1]
            self._mapped.pop(uuid, None)  # another export on that GPU: this one replaces it
            values[0] = self.device.index  # opened on this device, reaching the peer
            try:
                storage = torch.UntypedStorage._new_shared_cuda(*values)
            except RuntimeError as exc:
                raise TransportError(f"CUDA could not open the decode instance's "
                                     f"buffer: {exc}") from exc
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            table = flat.view(-1, self.layout.bytes_per_block)
            self._mapped[uuid] = (key, table)
        return table

    @property
    def num_mapped(self) -> int:
        """Decode buffers mapped into this process now."""
        with self._lock:
            return len(self._mapped)

    def close(self) -> None:
        with self._lock:
            self._mapped.clear()
            self._buffer = None
            self._free.clear()


def _row_entries(entries: Sequence[Json], lent: set[int]) -> list[int | None]:
    """The receive row each entry announces, None where it is not one lent here."""
    rows: list[int | None] = []
    for entry in entries:
        row = entry.get("row")
        rows.append(row if isinstance(row, int) and not isinstance(row, bool) and row in lent
                    else None)
    return rows


class _Receive(ReceiveChannel):
    def __init__(self, transport: CudaIpcTransport, buffer: torch.Tensor, shared: Json,
                 rows: list[int]) -> None:
        self.transport, self.buffer, self.shared, self.rows = transport, buffer, shared, rows
        self._lent = set(rows)
        self._closed = False

    def offer(self) -> Json:
        return {"gpu": self.transport.uuid, "rows": self.rows,
                "row_bytes": self.transport.layout.bytes_per_block, "buffer": self.shared}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        rows = _row_entries(entries, self._lent)
        known = [row for row in rows if row is not None]
        if not known:
            return [False] * len(entries)
        with on_stream(self.transport.stream):
            # [n] int64, copied on the stream that reads it: a miss reads a lent row, and
            # fails its check below
            ids = torch.tensor([row if row is not None else known[0] for row in rows],
                               dtype=torch.int64).to(self.transport.device, non_blocking=True)
            torch.index_select(self.buffer, 0, ids, out=dests)
            sums = device_checksum(dests)  # waits for the copy
        return check_headers(entries, metas,
                             [s if row is not None else None for row, s in zip(rows, sums)],
                             self.transport.layout, dests.shape[1])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport._give_back(self.rows)


class _Send(SendChannel):
    reads_in_place = True

    def __init__(self, transport: CudaIpcTransport, table: torch.Tensor,
                 rows: list[int]) -> None:
        self.transport, self.table = transport, table
        turns = max(1, min(transport.in_flight, len(rows)))
        self.capacity = max(1, min(transport.group_rows, len(rows) // turns))
        self.in_flight = turns
        self._turns = [rows[k * self.capacity:(k + 1) * self.capacity] for k in range(turns)]
        self._next_turn = 0
        self._free_turns = threading.Semaphore(turns)
        # Sends not yet committed, oldest first: the events around their copies.
        self._posted: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._lock = threading.Lock()

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        if not blocks:
            return []
        assert len(blocks) <= self.capacity, "more blocks than a turn's rows"
        waiting = time.monotonic()
        if not self._free_turns.acquire(timeout=self.transport.turn_timeout_s):
            raise TransportError(f"no earlier send was committed within "
                                 f"{self.transport.turn_timeout_s:g} s")
        self.slot_wait_s += time.monotonic() - waiting
        try:
            turn = self._turns[self._next_turn % len(self._turns)]
            self._next_turn += 1
            source, source_rows = cache_rows(blocks)
            targets = turn[:len(blocks)]
            # [n, 2] (cache row, lent row): one batched copy on the copy engines, planned
            # before `began`: an idle stream passes that event at once, and the checks and
            # planning (a few hundred microseconds a group) are the host's time, not the
            # link's. The runtime call that enqueues the copies still counts.
            mapping = torch.from_numpy(np.array([source_rows, targets], dtype=np.int64).T.copy())
            plan = plan_dma(source, self.table, mapping)
            copied = torch.cuda.Event(enable_timing=True)
            began = torch.cuda.Event(enable_timing=True)
            began.record()
            plan.enqueue()
            copied.record()
            sums = device_checksum(source, source_rows)  # beside the copies
        except BaseException:
            self._free_turns.release()
            raise
        with self._lock:
            self._posted.append((began, copied))
        layout = self.transport.layout
        return [{"index": block.index, "row": row,
                 "header": encode_header(block.meta, layout, layout.bytes_per_block,
                                         checksum).hex()}
                for block, row, checksum in zip(blocks, targets, sums)]

    def committed(self) -> None:
        with self._lock:
            if not self._posted:
                return
            began, copied = self._posted.popleft()
        try:
            copied.synchronize()
            with self._lock:  # commits may be answered on several threads at once
                self.wire_s = (self.wire_s or 0.0) + began.elapsed_time(copied) / 1e3
        finally:
            self._free_turns.release()

    def close(self) -> None:
        with self._lock:
            unanswered, self._posted = len(self._posted), deque()
        for _ in range(unanswered):
            self._free_turns.release()

