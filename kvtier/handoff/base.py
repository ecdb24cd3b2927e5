"""The seam between the handoff and the engines that move its bytes.

A `HandoffTransport` is one way for block records (`kvtier.tiers.record`, the same
self-checking records the disk and remote tiers store) to go from a prefill instance to a
decode instance. Control (reserve, commit) never goes through it: it is the instances'
HTTP (`kvtier.handoff.control`). Per handoff, each side opens a channel:

  * decode side: `open_receive(handoff_id, num_blocks)` -> `ReceiveChannel`, whose `offer()`
    (JSON) tells the prefill side where to put the records (slots of a registered buffer,
    a store, a rank), and whose `receive_into(entries, metas, dests)` reads the records a
    commit announces and validates each against the block the decode side expects, into
    rows on the transport's `device` (the host, or the GPU for NCCL and CUDA IPC).
  * prefill side: `open_send(offer)` -> `SendChannel`, whose `send(blocks)` moves records
    and returns the commit entries (JSON) that announce them; at most `capacity` blocks
    per send, since a commit frees the room a send used.

A record that fails validation (damaged, another model's or layout's, another block's) is
False in `receive_into`'s answer: the decode side counts it rejected and computes the
block itself. A transport that fails raises `TransportError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.kernels import reference, word_checksum
from kvtier.layout import KVLayout
from kvtier.tiers.record import (
    BlockMeta,
    CorruptRecord,
    check_payload_len,
    decode_header,
    read_record_into,
)

#: JSON-shaped values exchanged through the control messages.
Json = dict[str, Any]


class TransportError(OSError):
    """A transport could not move a handoff's bytes (peer gone, engine error)."""


@dataclass(frozen=True, slots=True)
class OutgoingBlock:
    """One block the prefill side sends: its index in the prompt, what names it, and its
    bytes (`payload`: flat uint8 `[bytes_per_block]`, on the engine's device, a row of one
    group's gathered copy; for a channel that `reads_in_place`, the block's own row of the
    KV cache, whose index there is `cache_row`)."""

    index: int
    meta: BlockMeta
    payload: torch.Tensor
    cache_row: int | None = None

    def host_payload(self) -> np.ndarray:
        """The payload in host memory, as a flat uint8 numpy array (a copy off a GPU)."""
        return self.payload.cpu().numpy()


def payload_rows(blocks: Sequence[OutgoingBlock]) -> torch.Tensor:
    """The payloads of `blocks` as one uint8 `[len(blocks), bytes_per_block]` tensor: the
    rows they already are when they are consecutive rows of one gathered copy (what the
    prefill side sends), else a stacked copy."""
    first = blocks[0].payload
    size, storage = first.numel(), first.untyped_storage()
    consecutive = first.is_contiguous() \
        and first.storage_offset() + len(blocks) * size <= storage.nbytes() \
        and all(block.payload.untyped_storage().data_ptr() == storage.data_ptr()
                and block.payload.data_ptr() == first.data_ptr() + k * size
                for k, block in enumerate(blocks))
    if consecutive:
        return first.as_strided((len(blocks), size), (size, 1))
    return torch.stack([block.payload for block in blocks])


def cache_rows(blocks: Sequence[OutgoingBlock]) -> tuple[torch.Tensor, list[int]]:
    """For blocks read in place (`SendChannel.reads_in_place`): the KV cache's rows as one
    uint8 `[rows, bytes_per_block]` tensor reaching the highest row named, and each block's
    row in it. Raises ValueError for a block without its `cache_row`, or whose payload is
    not that row of the first block's cache."""
    first = blocks[0]
    row_ids = [block.cache_row for block in blocks]
    if any(row is None for row in row_ids):
        raise ValueError("a block read in place needs its cache_row")
    size = first.payload.numel()
    row_bytes = size * first.payload.element_size()
    start = first.payload.data_ptr() - first.cache_row * row_bytes  # type: ignore[operator]
    # Each payload must start where its row does (address arithmetic: a view per block
    # would cost host time on every group).
    for block, row in zip(blocks, row_ids):
        if block.payload.numel() != size or not block.payload.is_contiguous() \
                or block.payload.data_ptr() != start + row * row_bytes:  # type: ignore[operator]
            raise ValueError("a block read in place must be its row of one KV cache")
    origin = first.payload.storage_offset() - first.cache_row * size  # type: ignore[operator]
    num_rows = max(row_ids) + 1  # type: ignore[type-var]
    return first.payload.as_strided((num_rows, size), (size, 1), origin), \
        row_ids  # type: ignore[return-value]


class SendChannel(ABC):
    """The prefill side of one handoff over one transport. Used from one thread."""

    #: Most blocks one `send` may carry before their commit.
    capacity: int
    #: Sends that may await their commits: the next `send` may come before the last one's
    #: commit is answered while fewer are.
    in_flight: int = 1
    #: Seconds `send` has waited, in all, for an earlier send's commit to free its room.
    slot_wait_s: float = 0.0
    #: Seconds the committed sends' bytes took from ready to delivered, in all, where the
    #: transport can tell (NCCL, CUDA IPC); None where it cannot.
    wire_s: float | None = None
    #: Whether `send` reads each block where the KV cache holds it (`OutgoingBlock.payload`
    #: the cache's row, `cache_row` its index) rather than from a gathered copy: a transport
    #: that copies blocks one by one without the GPU's cores (copy engines) then skips the
    #: gather. The sender keeps the blocks until `send` has returned and its stream's work
    #: is done.
    reads_in_place: bool = False

    @abstractmethod
    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        """Move the records of `blocks` (at most `capacity`); return one commit entry per
        block moved, each with its `index` (a block the transport could not take is left
        out, and the decode side computes it). Raises TransportError when nothing can be
        moved any more."""

    def committed(self) -> None:
        """A commit announcing a `send` was answered, its room may be reused: called once
        per send so answered (a 404 too: the decode side consumes an unknown handoff's
        bytes before it answers), from the thread that took the answer (with sends under
        way together, answers may come in any order)."""
        return None  # nothing by default

    def close(self) -> None:
        """Release what the channel holds. Idempotent."""
        return None  # nothing by default


class ReceiveChannel(ABC):
    """The decode side of one handoff over one transport. Used from one thread at a time."""

    @abstractmethod
    def offer(self) -> Json:
        """What the prefill side needs to send (JSON), given in the reservation's answer."""

    @abstractmethod
    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        """Read the records `entries` (a commit's, one per block) announce into `dests`
        (uint8 `[len(entries), bytes_per_block]` on the transport's `device`), each checked
        against `metas[i]`; per
        block, True when it arrived intact and is the block asked for. Raises
        TransportError when the transport failed as a whole."""

    def close(self) -> None:
        """Release what the channel holds (slots, keys). Idempotent."""
        return None  # nothing by default


class HandoffTransport(ABC):
    """One engine that moves handoff bytes (see the module docstring). Thread-safe.

    name: how the control messages, settings and metrics name it ("mooncake", ...).
    layout: the KV layout of every block it moves.
    device: where received blocks land (`ReceiveChannel.receive_into`'s `dests`).
    """

    name: str
    layout: KVLayout
    device: torch.device = torch.device("cpu")

    @property
    def ready(self) -> bool:
        """Whether it can move bytes now (a transport that connects in the background, or
        whose peer went away, says False)."""
        return True

    @abstractmethod
    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        """The decode side of a handoff of at most `num_blocks` blocks. Raises
        TransportError when it has no room now."""

    @abstractmethod
    def open_send(self, offer: Json) -> SendChannel:
        """The prefill side of a handoff whose decode side offered `offer`. Raises
        ValueError for an offer it cannot use, TransportError for a peer it cannot reach."""

    def peer_info(self) -> Json | None:
        """What a decode instance says of this transport in its `/v1/handoff/info`, for a
        prefill instance to tell whether it reaches it (`reaches`); None: nothing."""
        return None

    def reaches(self, peer_info: Json | None) -> bool:
        """Whether this side can send to a decode instance that described its end of the
        transport as `peer_info` (its `peer_info()`, None when it gave none)."""
        return True

    def receive_buffer(self, num_blocks: int) -> torch.Tensor:
        """Rows for one commit's payloads: uint8 `[num_blocks, bytes_per_block]` on
        `device`."""
        return torch.empty((num_blocks, self.layout.bytes_per_block), dtype=torch.uint8,
                           device=self.device)

    def discard(self, entries: Sequence[Json]) -> None:
        """A commit named a handoff the decode side no longer knows (expired): consume
        whatever the transport must consume so that the next handoff's bytes line up."""
        return None  # nothing by default

    def close(self) -> None:
        """Release buffers and connections. Idempotent."""
        return None  # nothing by default


def check_records(records: Sequence[memoryview | bytes | None], metas: Sequence[BlockMeta],
                  layout: KVLayout, dests: torch.Tensor) -> list[bool]:
    """Validate whole records against the blocks `metas` names and copy their payloads
    into `dests` rows (uint8, on the host; `kvtier.tiers.record.read_record_into`: header,
    layout, length, parent hash, token ids, checksum); per block, True when intact. None is
    a miss."""
    fingerprint = layout.fingerprint()
    results = []
    for record, meta, dest in zip(records, metas, dests.numpy()):
        if record is None:
            results.append(False)
            continue
        try:
            read_record_into(record, meta, fingerprint, dest)
        except CorruptRecord:
            results.append(False)
        else:
            results.append(True)
    return results


def device_checksum(rows: torch.Tensor, row_ids: Sequence[int] | None = None) -> list[int]:
    """Per row of `rows` (uint8 `[n, nbytes]`, nbytes a multiple of 4, any device), or per
    row `row_ids` names, the weighted sum of its 32-bit words, word i weighted 2i+1, modulo
    2**64 (as an unsigned int): `kernels.word_checksum` on a GPU (reading the rows named
    where they lie), its torch reference elsewhere. Integer arithmetic: the same on every
    device. Waits for the device's queued work on the current stream."""
    if rows.device.type == "cuda":
        sums = word_checksum(rows.contiguous(), row_ids)  # [n] int64
    else:
        sums = reference.word_checksum(rows if row_ids is None else rows[list(row_ids)])
    return [int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in sums.cpu().tolist()]


def check_headers(entries: Sequence[Json], metas: Sequence[BlockMeta],
                  checksums: Sequence[int | None], layout: KVLayout,
                  payload_bytes: int) -> list[bool]:
    """For transports whose payloads arrive apart from their record headers (NCCL, CUDA
    IPC): per commit entry, whether its header (`entry["header"]`, hex) is a valid header of
    `layout` for a payload of `payload_bytes`, names the block `metas[i]` and carries the
    checksum `checksums[i]` computed over the payload that arrived (None: no payload, a
    miss)."""
    fingerprint = layout.fingerprint()
    results = []
    for entry, meta, checksum in zip(entries, metas, checksums):
        if checksum is None:
            results.append(False)
            continue
        try:
            header, _ = decode_header(bytes.fromhex(str(entry.get("header", ""))), fingerprint)
            check_payload_len(header, payload_bytes, payload_bytes)
        except (CorruptRecord, ValueError):
            results.append(False)
            continue
        results.append(header.matches(meta) and header.payload_checksum == checksum)
    return results


def slot_bytes(layout: KVLayout) -> int:
    """Room for one record of `layout`: the header with the longest hash a record may carry
    and `block_size` token ids, plus the payload."""
    # 44 fixed bytes, a parent hash of at most 64, the token ids, an 8-byte checksum.
    return 44 + 64 + 4 * layout.block_size + 8 + layout.bytes_per_block
