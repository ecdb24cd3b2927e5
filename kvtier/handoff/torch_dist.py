"""torch.distributed point-to-point as a handoff transport: NCCL between GPUs of one host
(or across hosts), and the same code with gloo on CPU tensors (how CI runs it).

The two instances form a group of two at start (`init_method`, e.g. "tcp://10.0.0.1:29500";
the prefill instance is rank 0, the decode instance rank 1); forming it runs in the
background, and the transport is not `ready` until it has. The bytes never leave the
device: a send posts one `isend` of a group's payloads as gathered from the KV cache, and
the commit that follows carries each block's record header (`kvtier.tiers.record`: magic,
version, layout, parent hash, token ids, header checksum); the decode side posts the
matching `recv` into rows on its device and checks every header against the block it
expects and every payload against the header's checksum. That checksum is
`device_checksum`, not the stored records' xxh3: xxh3 runs on the host, and sending every
byte through the host would cost the handoff most of its bandwidth. It is a weighted sum of
the payload's 32-bit words (odd weights, modulo 2**64), computed on the device on both
sides: any single damaged word changes it.

Both sides move and check bytes on a CUDA stream of the transport's own, so a group never
waits behind the engine's queued steps; received rows are allocated on that stream and
marked used where the engine copies them into its pool (`used_on_current_stream`). A send
carries at most `group_bytes` of payloads: each group costs a commit round trip and a
checksum pass on both sides, so fewer, larger groups lose less to that fixed cost, at the
price of that much GPU memory on each side while a group is in flight.

Every send takes the next number of the pair's sequence, and its commit entries carry it
(`seq`); the decode side receives in that order whatever order the commits reach it in, so
a prefill instance may post the next group's send while earlier commits are still on their
way. At most `in_flight` sends, of all its handoffs together, await their commits: each
holds a group of GPU memory on both sides, and a commit that comes early holds a thread of
the decode instance while it waits for its turn. A commit the decode side cannot match (an
expired handoff) still receives its bytes (`discard`) before it answers 404, so the prefill
side counts that send as done too.

The group itself, formed again after a break or a restart, is `kvtier.handoff.torch_pair`'s:
sends are numbered within one of its generations, and a commit names its send's generation
(`gen`) as well, so that a commit that arrives after the pair formed again fails that
handoff rather than take another send's bytes. A reservation offers its generation, so that
a prefill instance still in the old one uses another transport until it has formed the new
one too. Handoffs under way at a break fail and their requests are computed again
elsewhere.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.cuda_device import on_stream
from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    ReceiveChannel,
    SendChannel,
    TransportError,
    payload_rows,
)
from kvtier.handoff.torch_pair import DECODE_RANK, PREFILL_RANK, Generation, TorchPair
from kvtier.kernels import reference, word_checksum
from kvtier.layout import KVLayout
from kvtier.tiers.record import (
    BlockMeta,
    CorruptRecord,
    check_payload_len,
    decode_header,
    encode_header,
)

#: Payload bytes per send unless set (`--handoff-nccl-group-mib`).
DEFAULT_GROUP_BYTES = 256 << 20
#: Sends of one handoff that may await their commits unless set (`--handoff-nccl-in-flight`):
#: two let the next group be read and sent while the last one's commit is answered.
DEFAULT_IN_FLIGHT = 2


class TorchDistTransport(HandoffTransport):
    """The pair's group. rank: PREFILL_RANK or DECODE_RANK. backend: "nccl" (CUDA tensors)
    or "gloo" (CPU tensors). timeout_s: how long forming the group and each operation may
    take. group_bytes: most payload bytes per send (at least one block). in_flight: sends
    that may await their commits. turn_timeout_s: how long a receive waits for the sends
    numbered before it, and a send for a free slot (None: `timeout_s`); a send whose commit
    never comes (lost with its connection) then breaks the pair after that long instead of
    holding the threads waiting behind it. A broken pair forms again
    (`kvtier.handoff.torch_pair`). Raises ValueError for a bad setting."""

    name = "nccl"

    def __init__(self, layout: KVLayout, init_method: str, rank: int, backend: str = "nccl",
                 timeout_s: float = 600.0, group_bytes: int = DEFAULT_GROUP_BYTES,
                 in_flight: int = DEFAULT_IN_FLIGHT,
                 turn_timeout_s: float | None = None) -> None:
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
        if group_bytes < 1:
            raise ValueError(f"group_bytes must be positive, got {group_bytes}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        if turn_timeout_s is not None and not turn_timeout_s > 0:
            raise ValueError(f"turn_timeout_s must be > 0, got {turn_timeout_s}")
        self.layout, self.rank, self.backend = layout, rank, backend
        self.batch = max(1, group_bytes // layout.bytes_per_block)  # blocks per send
        self.in_flight, self.timeout_s = in_flight, timeout_s
        self.turn_timeout_s = timeout_s if turn_timeout_s is None else turn_timeout_s
        self.peer = DECODE_RANK if rank == PREFILL_RANK else PREFILL_RANK
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self.stream = torch.cuda.Stream(self.device) if backend == "nccl" else None
        self._send_lock = threading.Lock()  # numbers and posts sends in one order
        self.pair = TorchPair(init_method, rank, backend, self.device, in_flight, timeout_s,
                              self.turn_timeout_s)

    @property
    def generation(self) -> int | None:
        """The number of the pair's current forming (None before the first)."""
        return self.pair.generation

    @property
    def ready(self) -> bool:
        return self.pair.ready

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group has formed, first or again (False: not within
        `timeout_s`, or it cannot be kept)."""
        return self.pair.wait_ready(timeout_s)

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        return _Receive(self, self.pair.current())

    def open_send(self, offer: Json) -> SendChannel:
        generation = self.pair.current()
        if offer.get("rank") != self.peer:
            raise ValueError(f"the decode side is rank {offer.get('rank')}, this instance's "
                             f"peer is rank {self.peer}")
        if offer.get("generation") != generation.number:
            raise TransportError(f"the pair is forming again (generation {generation.number} "
                                 f"here, {offer.get('generation')} at the decode instance)")
        return _Send(self, generation)

    def post_send(self, rows: torch.Tensor, generation: Generation | None = None
                  ) -> tuple[int, Any]:
        """Number the next send of `generation` (None: the current one) and post it: `rows`
        (uint8 `[n, bytes_per_block]` on the device) go to the peer, once fewer than
        `in_flight` sends await their commits (each one's `send_committed` says so).
        Returns (its sequence number, the send's work). TransportError when the pair broke
        or formed again."""
        import torch.distributed as dist

        generation = generation or self.pair.current()
        self.pair.check(generation)
        if not generation.send_slots.acquire(timeout=self.turn_timeout_s):
            raise TransportError(f"no earlier send was committed within "
                                 f"{self.turn_timeout_s:g} s")
        with self._send_lock:
            try:
                with self.pair.calling(generation):
                    work = dist.isend(rows, dst=self.peer)
            except TransportError:
                generation.send_slots.release()
                raise
            except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
                generation.send_slots.release()
                self.pair.break_(f"a send failed: {exc}", generation)
                raise TransportError(self.pair.broken or str(exc)) from exc
            seq, generation.next_send = generation.next_send, generation.next_send + 1
        return seq, work

    def receive_into(self, rows: torch.Tensor, seq: int, number: int | None = None) -> None:
        """Receive send `seq` of generation `number` (None: the current one) into `rows`
        (uint8 `[n, bytes_per_block]` on the device), once every earlier send has been
        received. Raises TransportError when the pair is broken, formed again since (the
        send is gone), or the sends before it do not come within `turn_timeout_s`;
        ValueError for a number already received."""
        import torch.distributed as dist

        generation = self.pair.current()
        if number is not None and number != generation.number:
            raise TransportError(f"send {seq} of generation {number} is gone: the pair is at "
                                 f"generation {generation.number}")
        self.pair.wait_turn(generation, seq)
        try:
            with self.pair.calling(generation):
                dist.recv(rows, src=self.peer)
        except TransportError:
            raise
        except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
            self.pair.break_(f"a receive failed: {exc}", generation)
            raise TransportError(self.pair.broken or str(exc)) from exc
        self.pair.received(generation)

    def send_committed(self, generation: Generation) -> None:
        """A send's commit was answered (or it never will be): its slot is free."""
        generation.send_slots.release()

    def receive_buffer(self, num_blocks: int) -> torch.Tensor:
        with on_stream(self.stream):
            return super().receive_buffer(num_blocks)

    def discard(self, entries: Sequence[Json]) -> None:
        rows = self.receive_buffer(len(entries))
        try:
            number, seq = send_number(entries)
            with on_stream(self.stream):
                self.receive_into(rows, seq, number)
        except (TransportError, ValueError):
            pass  # a send of an ended generation went with its group

    def close(self) -> None:
        self.pair.close()


def send_number(entries: Sequence[Json]) -> tuple[int, int]:
    """The send a commit's entries announce: (its generation, its sequence number within
    it), the same in each entry. Raises ValueError."""
    numbers = {(entry.get("gen"), entry.get("seq")) for entry in entries}
    if len(numbers) != 1:
        raise ValueError(f"a commit's blocks must name one send, got {sorted(map(str, numbers))}")
    generation, seq = numbers.pop()
    for name, value in (("generation", generation), ("sequence number", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"a send's {name} must be an integer >= 0, got {value!r}")
    return generation, seq


def device_checksum(rows: torch.Tensor) -> list[int]:
    """Per row of `rows` (uint8 `[n, nbytes]`, nbytes a multiple of 4, any device), the
    weighted sum of its 32-bit words, word i weighted 2i+1, modulo 2**64 (as an unsigned
    int): `kernels.word_checksum` on a GPU, its torch reference elsewhere. Integer
    arithmetic: the same on every device."""
    sums = word_checksum(rows.contiguous()) if rows.device.type == "cuda" \
        else reference.word_checksum(rows)  # [n] int64
    return [int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in sums.cpu().tolist()]


class _Receive(ReceiveChannel):
    def __init__(self, transport: TorchDistTransport, generation: Generation) -> None:
        self.transport = transport
        self.generation = generation

    def offer(self) -> Json:
        return {"rank": self.transport.rank, "generation": self.generation.number}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        number, seq = send_number(entries)
        with on_stream(self.transport.stream):
            self.transport.receive_into(dests, seq, number)
            sums = device_checksum(dests)
        fingerprint = self.transport.layout.fingerprint()
        results = []
        for entry, meta, checksum in zip(entries, metas, sums):
            try:
                header, _ = decode_header(bytes.fromhex(str(entry.get("header", ""))),
                                          fingerprint)
                check_payload_len(header, dests.shape[1], dests.shape[1])
            except (CorruptRecord, ValueError):
                results.append(False)
                continue
            results.append(header.matches(meta) and header.payload_checksum == checksum)
        return results


class _Send(SendChannel):
    def __init__(self, transport: TorchDistTransport, generation: Generation) -> None:
        self.transport = transport
        self.generation = generation
        self.capacity = transport.batch
        self.in_flight = transport.in_flight
        # The sends not yet committed, oldest first: their work and the rows it reads.
        self._posted: deque[tuple[Any, torch.Tensor]] = deque()
        self._lock = threading.Lock()

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        transport = self.transport
        transport.pair.check(self.generation)
        if not blocks:
            return []
        rows = payload_rows(blocks).to(transport.device)
        sums = device_checksum(rows)
        # May wait for a commit's answer: no lock held.
        seq, work = transport.post_send(rows, self.generation)
        with self._lock:
            self._posted.append((work, rows))
        return [{"index": block.index, "gen": self.generation.number, "seq": seq,
                 "header": encode_header(block.meta, transport.layout, rows.shape[1],
                                         checksum).hex()}
                for block, checksum in zip(blocks, sums)]

    def committed(self) -> None:
        # An answered commit means the decode side received its send, and every send
        # before it (it receives in order): the oldest one is done, whichever was answered.
        with self._lock:
            if not self._posted:
                return
            work, _ = self._posted.popleft()
        try:
            if self.transport.pair.is_current(self.generation):
                work.wait()  # else it ended with its group, received or not
        except Exception as exc:  # noqa: BLE001
            self.transport.pair.break_(f"a send failed: {exc}", self.generation)
            raise TransportError(self.transport.pair.broken or str(exc)) from exc
        finally:
            self.transport.send_committed(self.generation)

    def close(self) -> None:
        with self._lock:
            unanswered, self._posted = len(self._posted), deque()
        if unanswered:
            # A send whose commit failed: its bytes may never be received; the pair can no
            # longer be trusted to line up.
            self.transport.pair.break_("a send was never committed", self.generation)
        for _ in range(unanswered):
            self.transport.send_committed(self.generation)
