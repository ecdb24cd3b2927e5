"""The decode side of the handoff: reservations, validation on arrival, placement, holds.

A handoff is reserved with the prompt's token ids: the receiver hashes them itself (its own
model, layout, hash algorithm and the request's cache salt), so a record computed by another
model or for other tokens fails the record checks and is never used. It answers which of the
prompt's full blocks it already holds (those are not sent; the GPU ones are held from then
on) and what the transport needs (`ReceiveChannel.offer`). Each commit names blocks whose
records have landed: each is validated like any tier's read (`check_records`) and placed in
the GPU pool (`PoolPlacement`), held. The last commit ends the handoff; its blocks stay held
until the request has taken them (`taken` names the last block it can take, or a sweep
sees it holding that block) or `hold_s` has passed, then they are ordinary cached blocks.

A reservation whose next commit does not come within `timeout_s` (the prefill instance died,
the network went) expires: what it placed stays cached (a block's hash names its whole
prefix, so a partial prefix is safe to use: the request computes the rest), its holds are
given back and its channel closed. Nothing ever waits for a handoff: the request itself is
never blocked on one.

Thread-safe: control calls come from HTTP worker threads; every touch of the pool goes
through `on_engine` (run on the engine thread, blocking the caller).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.cuda_device import bind_thread, used_on_current_stream
from kvtier.free_queue import KVCacheBlock
from kvtier.handoff.base import HandoffTransport, Json, ReceiveChannel, TransportError
from kvtier.handoff.placement import PoolPlacement
from kvtier.handoff.stats import HandoffCounters
from kvtier.hashing import BlockHash, hash_blocks
from kvtier.tiers.record import BlockMeta, metas_for

T = TypeVar("T")
log = logging.getLogger("kvtier.handoff")

#: on_engine(fn): run fn() on the engine thread and return its result.
OnEngine = Callable[[Callable[[], Any]], Any]


class UnknownHandoff(KeyError):
    """A commit or abort names a handoff this instance does not know (never reserved, or
    expired)."""


@dataclass(slots=True)
class _Reservation:
    handoff_id: str
    transport: HandoffTransport
    channel: ReceiveChannel
    metas: list[BlockMeta]
    deadline: float
    #: Blocks the request can take from the pool: never the one holding its last token
    #: (the engine computes at least one token), so a prompt of whole blocks leaves its
    #: last block to the handoff's hold alone.
    num_usable: int
    #: The hash of the last of those (None: none), which `taken` watches for.
    awaited: BlockHash | None
    #: The GPU blocks held for the request, by block index.
    held: dict[int, KVCacheBlock] = field(default_factory=dict)
    done: bool = False
    claimed: bool = False  # its request took the awaited block (`taken`)
    busy: bool = False  # a commit is under way: it is not ended meanwhile
    #: The `part` the next numbered commit must carry (commits are taken in their order).
    next_part: int = 0
    #: An end asked for while a commit was under way (its outcome), done once it returns.
    end_after: str | None = None


class HandoffReceiver:
    """The decode side (see the module docstring).

    placement: where blocks go (engine thread). on_engine: runs a callable there.
    namespace(cache_salt): the hash chain's root for a request with that salt (None: the
    engine's default), as the engine hashes its requests. block_size, hash_algorithm: as
    the engine's. transports: those this instance receives with, by name. timeout_s:
    seconds a reservation waits for its next commit. hold_s: seconds placed blocks wait for
    their request after the last commit. counters: the handoff metrics.
    """

    def __init__(self, placement: PoolPlacement, on_engine: OnEngine,
                 namespace: Callable[[str | None], BlockHash], block_size: int,
                 hash_algorithm: str, transports: dict[str, HandoffTransport],
                 timeout_s: float = 30.0, hold_s: float = 60.0,
                 counters: HandoffCounters | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or hold_s < 0:
            raise ValueError(f"timeout_s must be > 0 and hold_s >= 0, got {timeout_s}, "
                             f"{hold_s}")
        self.placement = placement
        self.on_engine = on_engine
        self.namespace = namespace
        self.block_size = block_size
        self.hash_algorithm = hash_algorithm
        self.transports = transports
        self.timeout_s = timeout_s
        self.hold_s = hold_s
        self.counters = counters if counters is not None else HandoffCounters()
        self.clock = clock
        self._reservations: dict[str, _Reservation] = {}
        #: Reservations by the hash of the last block their request can take.
        self._awaited: dict[BlockHash, set[str]] = {}
        self._lock = threading.Lock()
        #: Notified when a commit ends or a reservation goes: a numbered commit that came
        #: early waits on it for its turn.
        self._changed = threading.Condition(self._lock)
        self._ids = itertools.count()

    # ---- control verbs (any thread) ------------------------------------------------------

    def reserve(self, token_ids: Sequence[int], cache_salt: str | None,
                transport: str) -> Json:
        """Start a handoff of the prompt `token_ids`: {"handoff_id", "held": [bool per full
        block], "offer": the transport's, "timeout_s"}. Raises ValueError for an unknown
        transport or bad token ids, TransportError when the transport cannot take it now."""
        chosen = self.transports.get(transport)
        if chosen is None or not chosen.ready:
            raise ValueError(f"this instance does not receive over {transport!r}; it "
                             f"receives over {sorted(self._ready())}")
        ids = [int(t) for t in token_ids]
        if not ids or any(not 0 <= t < 2**32 for t in ids):
            raise ValueError("token_ids must be a non-empty list of token ids")
        parent = self.namespace(cache_salt)
        hashes = hash_blocks(parent, ids, self.block_size, self.hash_algorithm)
        metas = metas_for(parent, hashes, ids, self.block_size)
        held, blocks = self.on_engine(lambda: self.placement.held(hashes))
        kept = {i: block for i, block in enumerate(blocks) if block is not None}
        handoff_id = f"ho-{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        try:
            channel = chosen.open_receive(handoff_id, len(hashes) - sum(held))
        except BaseException:
            self.on_engine(lambda: self.placement.release(list(kept.values())))
            raise
        num_usable = (len(ids) - 1) // self.block_size
        awaited = hashes[num_usable - 1] if num_usable else None
        with self._lock:
            self._reservations[handoff_id] = _Reservation(
                handoff_id, chosen, channel, metas, self.clock() + self.timeout_s,
                num_usable, awaited, kept)
            if awaited is not None:
                self._awaited.setdefault(awaited, set()).add(handoff_id)
        return {"handoff_id": handoff_id, "held": held, "offer": channel.offer(),
                "timeout_s": self.timeout_s}

    def commit(self, handoff_id: str, entries: Sequence[Json], last: bool,
               transport: str | None = None, part: int | None = None) -> Json:
        """The records `entries` announce have landed: validate and place them. Answers
        {"accepted": [index...], "rejected": [index...]}. `last` ends the handoff (its
        blocks are then held until the request arrives). Raises UnknownHandoff (the
        transport's announced bytes are consumed first), ValueError for bad entries,
        TransportError when the transport failed. `transport`: the sender's, named so that
        an unknown handoff's bytes can be consumed. `part`: the commit's number within the
        handoff (0, 1, ...), given by a sender that does not wait for one commit's answer
        before the next: a commit that comes early waits (at most `timeout_s`) for those
        before it. None: the commit must come alone."""
        with self._changed:
            reservation = self._reservations.get(handoff_id)
            if reservation is not None and part is not None:
                self._changed.wait_for(
                    lambda: self._reservations.get(handoff_id) is not reservation
                    or (reservation.next_part >= part and not reservation.busy),
                    self.timeout_s)
            if reservation is not None and self._reservations.get(handoff_id) is reservation \
                    and not reservation.done and not reservation.busy \
                    and part in (None, reservation.next_part):
                reservation.busy = True
            else:
                reservation = None
        if reservation is None:
            sender = self.transports.get(transport) if transport is not None else None
            if entries and sender is not None:
                sender.discard(entries)
            raise UnknownHandoff(handoff_id)
        name = reservation.transport.name
        received = False
        try:
            indexes = [int(entry["index"]) for entry in entries]
            if any(not 0 <= i < len(reservation.metas) for i in indexes):
                raise ValueError(f"a block index is outside the prompt's "
                                 f"{len(reservation.metas)} blocks")
            metas = [reservation.metas[i] for i in indexes]
            layout = reservation.transport.layout
            bind_thread(reservation.transport.device)
            began = time.monotonic()
            dests = reservation.transport.receive_buffer(len(entries))
            received = True
            intact = reservation.channel.receive_into(entries, metas, dests) if entries else []
            good = [k for k, ok in enumerate(intact) if ok]
            landed = time.monotonic()
            if good:
                def place() -> list[KVCacheBlock | None]:
                    rows = dests if len(good) == len(entries) else dests[good]
                    placed = self.placement.place([metas[k] for k in good], rows)
                    used_on_current_stream(dests)  # read there, maybe after it is freed here
                    return placed

                placed = self.on_engine(place)
                twice = []
                with self._lock:
                    for k, block in zip(good, placed):
                        if block is not None:
                            previous = reservation.held.get(indexes[k])
                            reservation.held[indexes[k]] = block
                            if previous is not None:  # sent twice: one hold is enough
                                twice.append(previous)
                if twice:
                    self.on_engine(lambda: self.placement.release(twice))
            num_rejected = len(entries) - len(good)
            self.counters.add_blocks("decode", name, "rejected", num_rejected)
            self.counters.add_bytes("decode", name, len(good) * layout.bytes_per_block)
            if num_rejected:
                log.warning("handoff %s: %d of %d blocks rejected (damaged or not the "
                            "blocks asked for); they will be computed", handoff_id,
                            num_rejected, len(entries))
        except BaseException:
            if not received and entries:
                reservation.transport.discard(entries)  # bad entries: the bytes still go
            self._end(reservation, "failed", during_commit=True)
            raise
        with self._lock:
            reservation.busy = False
            reservation.next_part += 1
            self._changed.notify_all()
            reservation.deadline = self.clock() + (self.hold_s if last else self.timeout_s)
            if last:
                reservation.done = True
            ended = reservation.end_after
        if ended is not None:  # aborted meanwhile
            self._end(reservation, ended)
            raise UnknownHandoff(handoff_id)
        if last:
            reservation.channel.close()
            self.counters.add_handoff("decode", name, "ok")
        # Where this commit's time went, for the sender's figures.
        timings = {"receive": landed - began, "place": time.monotonic() - landed} \
            if entries else {}
        return {"accepted": [indexes[k] for k in good],
                "rejected": [indexes[k] for k, ok in enumerate(intact) if not ok],
                "timings": timings}

    def abort(self, handoff_id: str) -> None:
        """The prefill side gave the handoff up: release it now. Raises UnknownHandoff."""
        with self._lock:
            reservation = self._reservations.get(handoff_id)
        if reservation is None:
            raise UnknownHandoff(handoff_id)
        self._end(reservation, "failed")

    def taken(self, block_hashes: Sequence[BlockHash]) -> None:
        """A request now holds the blocks `block_hashes` (the server's block tap on the
        requests it runs, see `num_awaited`): the handoffs whose last usable block is one
        of them are claimed, and the next sweep gives their holds back. Any thread."""
        with self._lock:
            for block_hash in block_hashes:
                for handoff_id in self._awaited.get(block_hash, ()):
                    self._reservations[handoff_id].claimed = True

    @property
    def num_awaited(self) -> int:
        """Handoffs waiting for their request to take their blocks (when 0, a request
        needs no tap)."""
        with self._lock:
            return len(self._awaited)

    def sweep(self) -> None:
        """Expire reservations whose commit is overdue, and give back the holds of finished
        handoffs whose request arrived or whose hold ran out. Call it every few tenths of a
        second (the server does), from any thread but the engine's."""
        now = self.clock()
        with self._lock:
            due = [r for r in self._reservations.values()
                   if not r.busy and (now >= r.deadline or r.done)]
            held = [_in_order({i: b for i, b in r.held.items() if i < r.num_usable})
                    for r in due]
        if not due:
            return
        claimed = self.on_engine(lambda: [self.placement.claimed(blocks) for blocks in held])
        for reservation, taken in zip(due, claimed):
            if reservation.done and (reservation.claimed or taken
                                     or now >= reservation.deadline):
                self._end(reservation, None)
            elif not reservation.done and now >= reservation.deadline:
                log.warning("handoff %s expired: no commit for %.1f s; what landed stays "
                            "cached, the rest is computed", reservation.handoff_id,
                            self.timeout_s)
                self._end(reservation, "timeout")

    def close(self) -> None:
        """Release every reservation (at shutdown, the engine thread still running)."""
        with self._lock:
            reservations = list(self._reservations.values())
        for reservation in reservations:
            self._end(reservation, None if reservation.done else "failed")

    @property
    def num_reservations(self) -> int:
        with self._lock:
            return len(self._reservations)

    # ---- internals -----------------------------------------------------------------------

    def _ready(self) -> list[str]:
        return [name for name, t in self.transports.items() if t.ready]

    def _end(self, reservation: _Reservation, outcome: str | None,
             during_commit: bool = False) -> None:
        """Forget a reservation: close its channel, give its holds back; count `outcome`.
        While a commit is under way (unless this is that commit), only mark it to end when
        the commit returns: the commit may still be adding holds."""
        with self._lock:
            if reservation.busy and not during_commit:
                reservation.end_after = reservation.end_after or outcome or "failed"
                return
            if self._reservations.pop(reservation.handoff_id, None) is None:
                return
            self._changed.notify_all()
            waiting = self._awaited.get(reservation.awaited) \
                if reservation.awaited is not None else None
            if waiting is not None:
                waiting.discard(reservation.handoff_id)
                if not waiting:
                    del self._awaited[reservation.awaited]
            held, reservation.held = _in_order(reservation.held), {}
        reservation.channel.close()
        if held:
            try:
                self.on_engine(lambda: self.placement.release(held))
            except Exception:  # noqa: BLE001 (the engine is gone: nothing left to hold)
                log.debug("could not release handoff %s's blocks", reservation.handoff_id)
        if outcome is not None:
            self.counters.add_handoff("decode", reservation.transport.name, outcome)


def _in_order(held: dict[int, KVCacheBlock]) -> list[KVCacheBlock]:
    """Held blocks in prompt order (a release frees them in sequence order)."""
    return [held[i] for i in sorted(held)]


__all__ = ["HandoffReceiver", "TransportError", "UnknownHandoff"]
