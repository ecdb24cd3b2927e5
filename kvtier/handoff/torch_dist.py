"""torch.distributed point-to-point as a handoff transport: NCCL between GPUs of one host
(or across hosts), and the same code with gloo on CPU tensors (how CI runs it).

The two instances form a group of two at start (`init_method`, e.g. "tcp://10.0.0.1:29500";
the prefill instance is rank 0, the decode instance rank 1); forming it runs in the
background, and the transport is not `ready` until it has. The bytes never leave the
device: a send posts one `isend` of a group's payloads as gathered from the KV cache, and
the commit that follows carries each block's record header (`kvtier.tiers.record`: magic,
version, layout, parent hash, token ids, header checksum); the decode side checks every
header against the block it expects and every payload against the header's checksum. That
checksum is `device_checksum`, not the stored records' xxh3: xxh3 runs on the host, and
sending every byte through the host would cost the handoff most of its bandwidth. It is a
weighted sum of the payload's 32-bit words (odd weights, modulo 2**64), computed on the
device on both sides: any single damaged word changes it.

The bytes do not wait for their commit. Every send takes the next number of the pair's
sequence and is announced in the rendezvous store (its number and rows) as it is posted;
while a handoff is open, a thread of the decode side (`_land`) looks for the next
announcement (every `POLL_S` to `POLL_MAX_S`), posts the matching `recv` into rows of its
own and computes their checksums. A send is thus on the link as soon as its rows are
gathered, and its commit, which names its number (`seq`), finds it landed and checked: the
commit's HTTP round trip is off the bytes' path, and the decode side receives in number
order whatever order the commits come in. The decode side posts a receive only for a send
it knows is posted, so no NCCL kernel of the transport waits on its GPU beside the decode
steps.

Both sides move and check bytes on a CUDA stream of the transport's own, of high priority
(`urgent_stream`), so a group neither waits behind the engine's queued steps nor behind
each wave of a prefill's matrix products; received rows are allocated on that stream and
marked used where the engine copies them into its pool (`used_on_current_stream`). A send
carries at most `group_bytes` of payloads: each group costs a commit and a checksum pass on
both sides, so fewer, larger groups lose less to that fixed cost, at the price of that much
GPU memory on each side while a group is in flight. At most `in_flight` sends, of all a
prefill instance's handoffs together, await their commits (each holds a group of GPU memory
on both sides), so a prefill instance may post the next group's send while earlier commits
are still on their way. A commit the decode side cannot match (an expired handoff) still
takes its send (`discard`) before it answers 404, so the prefill side counts that send as
done too. On CUDA each send is timed from its rows being ready to their delivery
(`SendChannel.wire_s`): the link's share of the handoff's time.

The group itself, formed again after a break or a restart, is `kvtier.handoff.torch_pair`'s:
sends are numbered within one of its generations, and a commit names its send's generation
(`gen`) as well, so that a commit that arrives after the pair formed again fails that
handoff rather than take another send's bytes. A reservation offers its generation, so that
a prefill instance still in the old one uses another transport until it has formed the new
one too. Handoffs under way at a break fail and their requests are computed again
elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtier.cuda_device import bind_thread, on_stream, urgent_stream
from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    ReceiveChannel,
    SendChannel,
    TransportError,
    check_headers,
    device_checksum,
    payload_rows,
)
from kvtier.handoff.torch_pair import (
    DECODE_RANK,
    PREFILL_RANK,
    WATCH_S,
    Generation,
    TorchPair,
)
from kvtier.layout import KVLayout
from kvtier.tiers.record import BlockMeta, encode_header

#: Payload bytes per send unless set (`--handoff-nccl-group-mib`).
DEFAULT_GROUP_BYTES = 256 << 20
#: Sends of one handoff that may await their commits unless set (`--handoff-nccl-in-flight`):
#: two let the next group be read and sent while the last one's commit is answered.
DEFAULT_IN_FLIGHT = 2
#: How often (seconds) the decode side looks for an announced send while a handoff is open,
#: right after a send landed; each look that finds none doubles the wait, up to
#: `POLL_MAX_S`. A send waits about that much for its receive to be posted, and the engine
#: thread, which shares the GIL with the looking thread, is woken that much less often.
POLL_S = 0.0005
POLL_MAX_S = 0.001


class TorchDistTransport(HandoffTransport):
    """The pair's group. rank: PREFILL_RANK or DECODE_RANK. backend: "nccl" (CUDA tensors)
    or "gloo" (CPU tensors). timeout_s: how long forming the group and each operation may
    take. group_bytes: most payload bytes per send (at least one block). in_flight: sends
    that may await their commits. turn_timeout_s: how long a commit waits for its send to
    land, and a send for a free slot (None: `timeout_s`); a send that never lands then
    breaks the pair after that long instead of holding the threads waiting for it. A broken
    pair forms again (`kvtier.handoff.torch_pair`). Raises ValueError for a bad setting."""

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
        self.stream = urgent_stream(self.device) if backend == "nccl" else None
        # Waits for each send to time its delivery (`_Send`): one stream for all of them,
        # made once, so that no stream doing other work ever waits for a send.
        self.delivery_stream = torch.cuda.Stream(self.device) if backend == "nccl" else None
        self._send_lock = threading.Lock()  # numbers and posts sends in one order
        self.pair = TorchPair(init_method, rank, backend, self.device, in_flight, timeout_s,
                              self.turn_timeout_s)
        # Decode side: a thread receives every send as soon as it is announced, while some
        # handoff may send (`_wanted`: receive channels open and commits waiting for theirs).
        self._wanted = 0
        self._closed = False
        self._wanting_changed = threading.Condition()
        self._lander: threading.Thread | None = None
        if rank == DECODE_RANK:
            self._lander = threading.Thread(target=self._land, name="kvtier-handoff-landing",
                                            daemon=True)
            self._lander.start()

    @property
    def generation(self) -> int | None:
        """The number of the pair's current forming (None before the first)."""
        return self.pair.generation

    @property
    def ready(self) -> bool:
        return self.pair.ready

    @property
    def landed_ahead(self) -> int:
        """Sends of the current generation received and waiting for their commits."""
        generation = self.pair.current_or_none()
        return len(generation.landed) if generation is not None else 0

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group has formed, first or again (False: not within
        `timeout_s`, or it cannot be kept)."""
        return self.pair.wait_ready(timeout_s)

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        return _Receive(self, self.pair.current())

    def want(self, more: int) -> None:
        """`more` (+1 or -1) handoffs or commits may need the sends announced from now."""
        with self._wanting_changed:
            self._wanted += more
            self._wanting_changed.notify_all()

    @contextlib.contextmanager
    def _wanting(self) -> Iterator[None]:
        self.want(1)
        try:
            yield
        finally:
            self.want(-1)

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
                self.pair.announce(generation, generation.next_send, rows.shape[0])
            except TransportError:
                generation.send_slots.release()
                raise
            except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
                generation.send_slots.release()
                self.pair.break_(f"a send failed: {exc}", generation)
                raise TransportError(self.pair.broken or str(exc)) from exc
            seq, generation.next_send = generation.next_send, generation.next_send + 1
        return seq, work

    def take(self, seq: int, number: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """Send `seq` of generation `number` (None: the current one), once it has landed:
        its rows (uint8 `[n, bytes_per_block]` on the device) and each row's checksum. Each
        send is taken once. Raises TransportError when the pair is broken, formed again
        since (the send is gone), or the send does not land within `turn_timeout_s`;
        ValueError for a send taken already."""
        generation = self.pair.current()
        if number is not None and number != generation.number:
            raise TransportError(f"send {seq} of generation {number} is gone: the pair is at "
                                 f"generation {generation.number}")
        with self._wanting():
            return self.pair.take(generation, seq)

    def receive_into(self, rows: torch.Tensor, seq: int, number: int | None = None) -> None:
        """`take` send `seq` into `rows` (uint8 `[n, bytes_per_block]` on the device)."""
        landed, _ = self.take(seq, number)
        with on_stream(self.stream):
            rows.copy_(landed)

    def _land(self) -> None:
        """The decode side's landing thread: receives each announced send, in number order,
        as soon as it is announced (ahead of its commit), and checks its rows."""
        import torch.distributed as dist

        bind_thread(self.device)
        delay = POLL_S
        while True:
            with self._wanting_changed:
                self._wanting_changed.wait_for(lambda: self._wanted > 0 or self._closed)
                if self._closed:
                    return
            try:
                generation = self.pair.current()
            except TransportError:  # not formed yet, or broken: until it forms again
                if not self.pair.wait_ready(WATCH_S):
                    time.sleep(POLL_MAX_S)
                continue
            try:
                num_rows = self.pair.announced(generation)
            except TransportError:
                # The store went with its prefill instance. The keeper sees that within
                # WATCH_S and ends the generation; torch logs a stack trace for every
                # failed look, so the next look waits as long.
                time.sleep(WATCH_S)
                continue
            if num_rows is None:
                time.sleep(delay)
                delay = min(2 * delay, POLL_MAX_S)
                continue
            delay = POLL_S
            rows = self.receive_buffer(num_rows)
            try:
                with on_stream(self.stream), self.pair.calling(generation):
                    dist.recv(rows, src=self.peer)
                    sums = device_checksum(rows)  # waits for the bytes
            except TransportError:
                continue  # the generation ended: its sends went with it
            except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
                self.pair.break_(f"a receive failed: {exc}", generation)
                continue
            self.pair.landed(generation, rows, sums)

    def send_committed(self, generation: Generation) -> None:
        """A send's commit was answered (or it never will be): its slot is free."""
        generation.send_slots.release()

    def receive_buffer(self, num_blocks: int) -> torch.Tensor:
        with on_stream(self.stream):
            return super().receive_buffer(num_blocks)

    def discard(self, entries: Sequence[Json]) -> None:
        try:
            number, seq = send_number(entries)
            self.take(seq, number)  # landed or landing: dropped
        except (TransportError, ValueError):
            pass  # a send of an ended generation went with its group

    def close(self) -> None:
        with self._wanting_changed:
            self._closed = True
            self._wanting_changed.notify_all()
        self.pair.close()
        if self._lander is not None:
            self._lander.join(WATCH_S + 1.0)


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


class _Receive(ReceiveChannel):
    def __init__(self, transport: TorchDistTransport, generation: Generation) -> None:
        self.transport = transport
        self.generation = generation
        self._open = True
        transport.want(1)  # its sends are received as they are announced

    def offer(self) -> Json:
        return {"rank": self.transport.rank, "generation": self.generation.number}

    def receive_into(self, entries: Sequence[Json], metas: Sequence[BlockMeta],
                     dests: torch.Tensor) -> list[bool]:
        number, seq = send_number(entries)
        landed, sums = self.transport.take(seq, number)
        if landed.shape != dests.shape:
            raise ValueError(f"send {seq} carried {landed.shape[0]} rows, its commit "
                             f"announces {dests.shape[0]}")
        with on_stream(self.transport.stream):
            dests.copy_(landed)
        return check_headers(entries, metas, sums, self.transport.layout, dests.shape[1])

    def close(self) -> None:
        if self._open:
            self._open = False
            self.transport.want(-1)


class _Send(SendChannel):
    def __init__(self, transport: TorchDistTransport, generation: Generation) -> None:
        self.transport = transport
        self.generation = generation
        self.capacity = transport.batch
        self.in_flight = transport.in_flight
        # The sends not yet committed, oldest first: their work, the rows it reads, and
        # the events that time it (`_time`).
        self._posted: deque[tuple[Any, torch.Tensor, Any]] = deque()
        self._lock = threading.Lock()

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        transport = self.transport
        transport.pair.check(self.generation)
        if not blocks:
            return []
        rows = payload_rows(blocks).to(transport.device)
        # May wait for a commit's answer: no lock held.
        posting = time.monotonic()
        seq, work = transport.post_send(rows, self.generation)
        self.slot_wait_s += time.monotonic() - posting
        timing = self._time(work)
        sums = device_checksum(rows)  # read beside the send
        with self._lock:
            self._posted.append((work, rows, timing))
        return [{"index": block.index, "gen": self.generation.number, "seq": seq,
                 "header": encode_header(block.meta, transport.layout, rows.shape[1],
                                         checksum).hex()}
                for block, checksum in zip(blocks, sums)]

    def _time(self, work: Any) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Events around a posted send on CUDA: one where its bytes were ready, one where
        they were delivered (recorded on a stream of its own, which alone waits for the
        send). None elsewhere."""
        stream = self.transport.delivery_stream
        if stream is None:
            return None
        posted = torch.cuda.Event(enable_timing=True)
        delivered = torch.cuda.Event(enable_timing=True)
        posted.record()
        with torch.cuda.stream(stream):
            work.wait()
            delivered.record()
        return posted, delivered

    def committed(self) -> None:
        # An answered commit means the decode side received its send, and every send
        # before it (it receives in order): the oldest one is done, whichever was answered.
        with self._lock:
            if not self._posted:
                return
            work, _, timing = self._posted.popleft()
        try:
            if self.transport.pair.is_current(self.generation):
                work.wait()  # else it ended with its group, received or not
                if timing is not None:
                    posted, delivered = timing
                    delivered.synchronize()
                    self.wire_s = (self.wire_s or 0.0) + posted.elapsed_time(delivered) / 1e3
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
