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

A failed send or receive, or a number that never comes (its commit lost), leaves the pair
out of step. The transport then says it is not ready (handoffs use another transport or
none) and the pair forms again: the side that found the break writes it into the
rendezvous store (the prefill instance's), which both sides' keeper threads watch
(`WATCH_S`); once neither side has a call inside torch.distributed, each ends the group (on
NCCL that aborts the sends still posted, which torch's watchdog would otherwise answer by
ending the process after `timeout_s`) and forms the next generation with the other. Sends
are numbered within a generation, and a commit names its send's generation (`gen`) as
well: a commit that arrives after the pair formed again fails that handoff rather than
take another send's bytes, and a reservation offers its generation, so that a prefill
instance still in the old one uses another transport until it has formed the new one too.
Handoffs under way at the break fail and their requests are computed again elsewhere.

Either instance may restart. The store names the generation the prefill instance formed
last; a decode instance that joins ends that generation (its old peer is gone) and forms
the next with it. A decode instance whose store went away with its prefill instance ends
its generation alone and joins whichever prefill instance listens at the address next.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

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
from kvtier.kernels import reference, word_checksum
from kvtier.layout import KVLayout
from kvtier.tiers.record import (
    BlockMeta,
    CorruptRecord,
    check_payload_len,
    decode_header,
    encode_header,
)

log = logging.getLogger("kvtier.handoff")

PREFILL_RANK, DECODE_RANK = 0, 1
#: Payload bytes per send unless set (`--handoff-nccl-group-mib`).
DEFAULT_GROUP_BYTES = 256 << 20
#: Sends of one handoff that may await their commits unless set (`--handoff-nccl-in-flight`):
#: two let the next group be read and sent while the last one's commit is answered.
DEFAULT_IN_FLIGHT = 2
#: How often (seconds) each side's keeper looks in the rendezvous store for a break that the
#: other side found: the pair is down at most this much longer than it takes to form again.
WATCH_S = 0.5
#: How long (seconds) a decode instance's keeper waits for the prefill instance's store at
#: each try: it tries until it joins, and a try is what its transport's close waits for.
_JOIN_ATTEMPT_S = 5.0


class _Generation:
    """One forming of the pair's group. Sends and receives are numbered from 0 within it;
    a send posted in one generation is never received in another (its group is gone)."""

    def __init__(self, number: int, in_flight: int) -> None:
        self.number = number
        self.send_slots = threading.Semaphore(in_flight)  # one per send awaiting its commit
        self.next_send = 0  # the sequence number of the next send
        self.next_recv = 0  # the sequence number the next receive must carry


class TorchDistTransport(HandoffTransport):
    """The pair's group. rank: PREFILL_RANK or DECODE_RANK. backend: "nccl" (CUDA tensors)
    or "gloo" (CPU tensors). timeout_s: how long forming the group and each operation may
    take. group_bytes: most payload bytes per send (at least one block). in_flight: sends
    that may await their commits. turn_timeout_s: how long a receive waits for the sends
    numbered before it, and a send for a free slot (None: `timeout_s`); a send whose commit
    never comes (lost with its connection) then breaks the pair after that long instead of
    holding the threads waiting behind it. A broken pair forms again (see the module
    docstring). Raises ValueError for a bad setting."""

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
        self._store: Any = None  # the rendezvous store, kept across generations
        self._generation: _Generation | None = None  # None until the group first formed
        self._broken: str | None = None
        self._send_lock = threading.Lock()  # numbers and posts sends in one order
        self._state = threading.Condition()  # guards what follows, and the generation
        self._in_calls = 0  # threads inside a torch.distributed call
        self._wake = threading.Event()  # this side broke the pair: the keeper acts now
        self._gave_up = False  # the group could not be formed (again): broken for good
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, args=(init_method,),
                                        name="kvtier-handoff-group", daemon=True)
        self._keeper.start()

    # ---- the group's life ----------------------------------------------------------------

    def _keep(self, init_method: str) -> None:
        """The keeper thread: forms the group and keeps it (see the module docstring)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # A timed-out operation aborts the communicator (its works then fail and the
            # pair forms again) instead of torch's default, which ends the process.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        try:
            if self.rank == PREFILL_RANK:
                self._keep_prefill(init_method)
            else:
                self._keep_decode(init_method)
        except Exception as exc:  # noqa: BLE001 (reported through `ready` and the log)
            self._give_up(f"keeping the pair failed: {exc}")

    def _keep_prefill(self, init_method: str) -> None:
        """Host the rendezvous store and form generation after generation: each is ended by
        a break (either side's, or a new decode instance's) and followed by the next."""
        try:
            store = self._store = self._rendezvous(init_method, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 (reported through `ready` and the log)
            self._give_up(f"the rendezvous store could not start: {exc}")
            return
        number = 0
        while not self._closed:
            if not self._form(store, number):
                continue  # the decode instance did not join in time: wait for it again
            store.set(_CURRENT_KEY, str(number))
            if self._watch(store, number):
                self._end(store, number)
                number += 1

    def _keep_decode(self, init_method: str) -> None:
        """Join the prefill instance's store (again after losing it: a restarted prefill
        instance) and form the generation after the one it had, then keep it as the
        prefill side does."""
        while not self._closed:
            if not _listening(init_method):  # a quiet look first: torch logs failed joins
                self._wake.wait(WATCH_S)
                continue
            try:
                store = self._rendezvous(init_method, _JOIN_ATTEMPT_S)
                store.set_timeout(timedelta(seconds=self.timeout_s))
                self._store = store
                # A prefill instance that formed a generation without this process (with a
                # decode instance that is gone) ends it and forms the next with this one.
                number = 0
                if store.check([_CURRENT_KEY]):
                    current = int(store.get(_CURRENT_KEY))
                    store.set(_broken_key(current), "a decode instance joined anew")
                    store.set(_done_key(current, self.rank), "1")
                    number = current + 1
            except Exception:  # noqa: BLE001 (the prefill instance is not up: try again)
                log.debug("handoff over %s: no prefill instance to join yet", self.backend,
                          exc_info=True)
                self._wake.wait(WATCH_S)
                continue
            while not self._closed and self._form(store, number):
                if not self._watch(store, number):
                    break  # the store is gone with its prefill instance: join again
                self._end(store, number)
                number += 1

    def _rendezvous(self, init_method: str, timeout_s: float) -> Any:
        import torch.distributed as dist

        store, _, _ = next(dist.rendezvous(init_method, rank=self.rank, world_size=2,
                                           timeout=timedelta(seconds=timeout_s)))
        return store

    def _form(self, store: Any, number: int) -> bool:
        """Form generation `number` of the group with the peer (both sides call it) and
        make its point-to-point communicator. False when the peer did not join within
        `timeout_s` (or the store failed)."""
        import torch.distributed as dist

        try:
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(f"kvtier-handoff/{number}/", store),
                rank=self.rank, world_size=2, timeout=timedelta(seconds=self.timeout_s))
            # NCCL creates the pair's point-to-point communicator at the first send or
            # receive, with both ranks taking part: made here, so that a handoff's first
            # `isend` does not wait for a `recv` its own commit has not asked for yet.
            probe = torch.zeros(1, dtype=torch.uint8, device=self.device)
            if self.rank == PREFILL_RANK:
                dist.send(probe, dst=self.peer)
            else:
                dist.recv(probe, src=self.peer)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 (reported through `ready` and the log)
            reason = f"the group did not form: {exc}"
            with self._state:
                repeated, self._broken = self._broken == reason, reason
                self._state.notify_all()
            if not repeated:  # the keeper tries again and again: said once
                log.warning("handoff over %s: %s", self.backend, reason)
            if dist.is_initialized():
                dist.destroy_process_group()
            self._wake.wait(WATCH_S)  # a failure at once is not tried again at once
            self._wake.clear()
            return False
        with self._state:
            again = self._generation is not None
            self._generation = _Generation(number, self.in_flight)
            self._broken = None
            self._state.notify_all()
        if again:
            log.warning("handoff over %s: the pair formed again (generation %d)",
                        self.backend, number)
        return True

    def _watch(self, store: Any, number: int) -> bool:
        """Wait until generation `number` breaks (True) or this transport closes (False);
        False too when the store cannot be reached (its prefill instance is gone), after
        ending the generation here."""
        while not self._closed:
            try:
                if store.check([_broken_key(number)]):
                    return True
            except Exception as exc:  # noqa: BLE001 (the store's host is gone: the peer)
                self._end(None, number, f"the prefill instance cannot be reached: {exc}")
                return False
            self._wake.wait(WATCH_S)
            self._wake.clear()
        return False

    def _end(self, store: Any, number: int, reason: str | None = None) -> None:
        """End generation `number`: once no call of this side is inside torch.distributed,
        and the peer says the same (through `store`; None: it is gone), end its group, which
        takes the sends still posted with it."""
        import torch.distributed as dist

        if store is not None:
            reason = store.get(_broken_key(number)).decode(errors="replace")
        with self._state:
            self._broken = self._broken or reason
            self._state.notify_all()
            idle = self._state.wait_for(lambda: self._in_calls == 0, self.timeout_s)
        if not idle:  # ending the group under a call could crash the process: leave it be
            self._give_up(f"{reason}; calls still under way after {self.timeout_s:g} s")
            self._closed = True
            return
        if store is not None:
            # Each side says it is done with the generation and waits for the other: a
            # receive still under way at the decode side finishes before the prefill
            # side's end of the group takes the send it reads.
            try:
                store.set(_done_key(number, self.rank), "1")
                store.wait([_done_key(number, self.peer)],
                           timedelta(seconds=self.turn_timeout_s))
            except Exception:  # noqa: BLE001 (the peer is gone: nothing of it to wait for)
                log.debug("the other instance did not end generation %d", number,
                          exc_info=True)
        dist.destroy_process_group()
        log.warning("handoff over %s: generation %d of the pair ended: %s", self.backend,
                    number, reason)

    def _give_up(self, reason: str) -> None:
        """The group cannot be kept: the transport stays broken (handoffs use another)."""
        with self._state:
            self._broken, self._gave_up = reason, True
            self._state.notify_all()
        log.error("handoff over %s: %s", self.backend, reason)

    def _break(self, reason: str, generation: _Generation) -> None:
        """`generation` is out of step: say so, wake every receive waiting for its turn, and
        tell both keepers to form the next one. Nothing for a generation already ended."""
        with self._state:
            if generation is not self._generation or self._broken is not None:
                return
            self._broken = reason
            self._state.notify_all()
        log.error("handoff over %s: %s; forming the pair again", self.backend, reason)
        try:
            self._store.set(_broken_key(generation.number), reason)
        except Exception:  # noqa: BLE001 (the peer's store is gone: the keeper sees it)
            log.debug("telling the other instance of the break failed", exc_info=True)
        self._wake.set()

    @property
    def generation(self) -> int | None:
        """The number of the group's current forming (None before the first)."""
        generation = self._generation
        return generation.number if generation is not None else None

    @property
    def ready(self) -> bool:
        return self._generation is not None and self._broken is None and not self._closed

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group has formed, first or again (False: not within
        `timeout_s`, or forming failed)."""
        with self._state:
            self._state.wait_for(lambda: self.ready or self._closed or self._gave_up,
                                 timeout_s)
        return self.ready

    def _current(self) -> _Generation:
        """The generation handoffs may use now; TransportError when there is none."""
        generation = self._generation
        if generation is None or not self.ready:
            raise TransportError(self._broken or "the torch.distributed group has not formed "
                                 "yet (the other instance has not started?)")
        return generation

    def _check(self, generation: _Generation) -> None:
        if generation is not self._current():
            raise TransportError(f"the pair formed again since generation "
                                 f"{generation.number}: its sends are gone")

    def _enter_call(self, generation: _Generation) -> None:
        """A call of `generation` goes into torch.distributed: counted, so that the keeper
        ends no group under it; checked in the same hold of the lock that the keeper marks
        the generation broken under, so that no call goes into a group being ended (or
        into the next one). Raises TransportError."""
        with self._state:
            self._check(generation)
            self._in_calls += 1

    def _leave_call(self) -> None:
        with self._state:
            self._in_calls -= 1
            self._state.notify_all()

    # ---- channels ------------------------------------------------------------------------

    def open_receive(self, handoff_id: str, num_blocks: int) -> ReceiveChannel:
        return _Receive(self, self._current())

    def open_send(self, offer: Json) -> SendChannel:
        generation = self._current()
        if offer.get("rank") != self.peer:
            raise ValueError(f"the decode side is rank {offer.get('rank')}, this instance's "
                             f"peer is rank {self.peer}")
        if offer.get("generation") != generation.number:
            raise TransportError(f"the pair is forming again (generation {generation.number} "
                                 f"here, {offer.get('generation')} at the decode instance)")
        return _Send(self, generation)

    def post_send(self, rows: torch.Tensor, generation: _Generation | None = None
                  ) -> tuple[int, Any]:
        """Number the next send of `generation` (None: the current one) and post it: `rows`
        (uint8 `[n, bytes_per_block]` on the device) go to the peer, once fewer than
        `in_flight` sends await their commits (each one's `send_committed` says so).
        Returns (its sequence number, the send's work). TransportError when the pair broke
        or formed again."""
        import torch.distributed as dist

        generation = generation or self._current()
        self._check(generation)
        if not generation.send_slots.acquire(timeout=self.turn_timeout_s):
            raise TransportError(f"no earlier send was committed within "
                                 f"{self.turn_timeout_s:g} s")
        with self._send_lock:
            try:
                self._enter_call(generation)
            except TransportError:
                generation.send_slots.release()
                raise
            try:
                work = dist.isend(rows, dst=self.peer)
            except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
                generation.send_slots.release()
                self._break(f"a send failed: {exc}", generation)
                raise TransportError(self._broken or str(exc)) from exc
            finally:
                self._leave_call()
            seq, generation.next_send = generation.next_send, generation.next_send + 1
        return seq, work

    def receive_into(self, rows: torch.Tensor, seq: int, number: int | None = None) -> None:
        """Receive send `seq` of generation `number` (None: the current one) into `rows`
        (uint8 `[n, bytes_per_block]` on the device), once every earlier send has been
        received.
        Raises TransportError when the pair is broken, formed again since (the send is
        gone), or the sends before it do not come within `turn_timeout_s`; ValueError for a
        number already received."""
        import torch.distributed as dist

        generation = self._current()
        if number is not None and number != generation.number:
            raise TransportError(f"send {seq} of generation {number} is gone: the pair is at "
                                 f"generation {generation.number}")
        with self._state:
            if seq < generation.next_recv:
                raise ValueError(f"send {seq} was received already "
                                 f"(next: {generation.next_recv})")
            if not self._state.wait_for(
                    lambda: generation.next_recv == seq or self._broken is not None
                    or generation is not self._generation, self.turn_timeout_s):
                turn_missed = (f"send {generation.next_recv} never came while send {seq} "
                               f"waited {self.turn_timeout_s:g} s for its turn")
            else:
                turn_missed = None
        if turn_missed is not None:
            self._break(turn_missed, generation)
        self._enter_call(generation)
        try:
            dist.recv(rows, src=self.peer)
        except Exception as exc:  # noqa: BLE001 (the pair is out of step from here on)
            self._break(f"a receive failed: {exc}", generation)
            raise TransportError(self._broken or str(exc)) from exc
        finally:
            self._leave_call()
        with self._state:
            generation.next_recv += 1
            self._state.notify_all()

    def send_committed(self, generation: _Generation) -> None:
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
        with self._state:
            self._closed = True
            self._state.notify_all()
        self._wake.set()
        # The keeper leaves at its next look (a process that ends while it is inside
        # torch.distributed may abort); it may be waiting for a peer that never comes.
        self._keeper.join(_JOIN_ATTEMPT_S + WATCH_S)


#: The rendezvous store's key holding the generation the prefill instance formed last.
_CURRENT_KEY = "kvtier-handoff/current"


def _listening(init_method: str) -> bool:
    """Whether a tcp:// rendezvous address takes connections (True for other methods)."""
    address = urlparse(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        return True
    try:
        with socket.create_connection((address.hostname, address.port), timeout=1.0):
            return True
    except OSError:
        return False


def _broken_key(number: int) -> str:
    """The rendezvous store's key whose presence says generation `number` broke."""
    return f"kvtier-handoff/broken/{number}"


def _done_key(number: int, rank: int) -> str:
    """The key by which side `rank` says it has no call left in generation `number`."""
    return f"kvtier-handoff/done/{number}/{rank}"


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
    def __init__(self, transport: TorchDistTransport, generation: _Generation) -> None:
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
    def __init__(self, transport: TorchDistTransport, generation: _Generation) -> None:
        self.transport = transport
        self.generation = generation
        self.capacity = transport.batch
        self.in_flight = transport.in_flight
        # The sends not yet committed, oldest first: their work and the rows it reads.
        self._posted: deque[tuple[Any, torch.Tensor]] = deque()
        self._lock = threading.Lock()

    def send(self, blocks: Sequence[OutgoingBlock]) -> list[Json]:
        transport = self.transport
        transport._check(self.generation)
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
            if self.generation is self.transport._generation:
                work.wait()  # else it ended with its group, received or not
        except Exception as exc:  # noqa: BLE001
            self.transport._break(f"a send failed: {exc}", self.generation)
            raise TransportError(self.transport._broken or str(exc)) from exc
        finally:
            self.transport.send_committed(self.generation)

    def close(self) -> None:
        with self._lock:
            unanswered, self._posted = len(self._posted), deque()
        if unanswered:
            # A send whose commit failed: its bytes may never be received; the pair can no
            # longer be trusted to line up.
            self.transport._break("a send was never committed", self.generation)
        for _ in range(unanswered):
            self.transport.send_committed(self.generation)
