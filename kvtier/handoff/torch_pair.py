"""The torch.distributed group of a handoff pair, kept through breaks and restarts.

The prefill instance (rank 0) and the decode instance (rank 1) meet at a rendezvous store
(`init_method`, e.g. "tcp://10.0.0.1:29500": the prefill instance hosts it) and form a
group of two; a keeper thread on each side forms it in the background, and the pair is not
`ready` until it has. Sends and receives over it are numbered within a `Generation`, one
forming of the group.

Sends are announced in the store as they are posted (`announce`); the decode side receives
each as soon as it reads the announcement (`announced`, `landed`), and a commit takes its
send by number (`take`). A failed send or receive, a send that never lands, or a send the
prefill side gave up on unanswered, leaves the generation out of step (`break_`). The
pair then says it is not ready (handoffs use another transport or none) and forms again:
the side that found the break writes it into the store, which both sides' keepers watch
(`WATCH_S`); once neither side has a call inside
torch.distributed (`calling`), each ends the group (on NCCL that aborts the sends still
posted, which torch's watchdog would otherwise answer by ending the process after
`timeout_s`) and forms the next generation with the other. A call of an ended generation
fails (`check`), so nothing of it reaches the next one.

Either instance may restart. The store names the generation the prefill instance formed
last; a decode instance that joins ends that generation (its old peer is gone) and forms
the next with it. A decode instance whose store went away with its prefill instance ends
its generation alone and joins whichever prefill instance listens at the address next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch

from kvtier.handoff.base import TransportError

log = logging.getLogger("kvtier.handoff")

PREFILL_RANK, DECODE_RANK = 0, 1
#: How often (seconds) each side's keeper looks in the rendezvous store for a break that the
#: other side found: the pair is down at most this much longer than it takes to form again.
WATCH_S = 0.5
#: How long (seconds) a decode instance's keeper waits for the prefill instance's store at
#: each try: it tries until it joins, and a try is what `close` waits for.
_JOIN_ATTEMPT_S = 5.0
#: The rendezvous store's key holding the generation the prefill instance formed last.
_CURRENT_KEY = "kvtier-handoff/current"


class Generation:
    """One forming of the pair's group. Sends and receives are numbered from 0 within it;
    a send posted in one generation is never received in another (its group is gone)."""

    def __init__(self, number: int, in_flight: int) -> None:
        self.number = number
        self.send_slots = threading.Semaphore(in_flight)  # one per send awaiting its commit
        self.next_send = 0  # the sequence number of the next send
        self.next_recv = 0  # the sequence number the next receive must carry
        #: Sends received ahead of their commits, by number, until a commit takes them:
        #: (rows, each row's checksum).
        self.landed: dict[int, tuple[torch.Tensor, list[int]]] = {}


class TorchPair:
    """One side of the pair (see the module docstring). rank: PREFILL_RANK or DECODE_RANK.
    backend: "nccl" or "gloo"; device: where its tensors live. in_flight: sends of a
    generation that may await their commits. timeout_s: how long forming the group and each
    operation may take. turn_timeout_s: how long a commit waits for its send to land
    (`take`)."""

    def __init__(self, init_method: str, rank: int, backend: str, device: torch.device,
                 in_flight: int, timeout_s: float, turn_timeout_s: float) -> None:
        self.rank, self.backend, self.device = rank, backend, device
        self.peer = DECODE_RANK if rank == PREFILL_RANK else PREFILL_RANK
        self.in_flight, self.timeout_s, self.turn_timeout_s = in_flight, timeout_s, \
            turn_timeout_s
        self._store: Any = None  # the rendezvous store (the decode side's: the latest)
        self._generation: Generation | None = None  # None until the group first formed
        self._broken: str | None = None
        self._state = threading.Condition()  # guards what follows, and the generation
        self._in_calls = 0  # threads inside a torch.distributed call
        self._wake = threading.Event()  # this side broke the pair: the keeper acts now
        self._gave_up = False  # the group cannot be kept: broken for good
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, args=(init_method,),
                                        name="kvtier-handoff-group", daemon=True)
        self._keeper.start()

    # ---- what the transport asks -----------------------------------------------------------

    @property
    def generation(self) -> int | None:
        """The number of the group's current forming (None before the first)."""
        generation = self._generation
        return generation.number if generation is not None else None

    @property
    def ready(self) -> bool:
        return self._generation is not None and self._broken is None and not self._closed

    @property
    def broken(self) -> str | None:
        """Why the pair is not ready now (None while it is, or before it first formed)."""
        return self._broken

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the group has formed, first or again (False: not within
        `timeout_s`, or it cannot be kept)."""
        with self._state:
            self._state.wait_for(lambda: self.ready or self._closed or self._gave_up,
                                 timeout_s)
        return self.ready

    def current(self) -> Generation:
        """The generation handoffs may use now; TransportError when there is none."""
        generation = self._generation
        if generation is None or not self.ready:
            raise TransportError(self._broken or "the torch.distributed group has not formed "
                                 "yet (the other instance has not started?)")
        return generation

    def current_or_none(self) -> Generation | None:
        """The latest generation formed (broken or not), None before the first."""
        return self._generation

    def is_current(self, generation: Generation) -> bool:
        return generation is self._generation

    def check(self, generation: Generation) -> None:
        """TransportError unless `generation` is the one handoffs may use now."""
        if generation is not self.current():
            raise TransportError(f"the pair formed again since generation "
                                 f"{generation.number}: its sends are gone")

    @contextlib.contextmanager
    def calling(self, generation: Generation) -> Iterator[None]:
        """Around a call of `generation` into torch.distributed: counted, so that the
        keeper ends no group under it, and checked in the same hold of the lock that the
        keeper marks the generation broken under, so that no call goes into a group being
        ended (or into the next one). Raises TransportError."""
        with self._state:
            self.check(generation)
            self._in_calls += 1
        try:
            yield
        finally:
            with self._state:
                self._in_calls -= 1
                self._state.notify_all()

    def announce(self, generation: Generation, seq: int, num_rows: int) -> None:
        """Prefill side: send `seq` of `generation`, of `num_rows` rows, is posted; the
        decode side receives it as soon as it reads this (`announced`), ahead of its commit.
        Raises TransportError when the store fails (the send can then never be received:
        the pair is broken)."""
        try:
            self._store.set(_sent_key(generation.number, seq), str(num_rows))
        except Exception as exc:  # noqa: BLE001 (the store is this process's own)
            self.break_(f"announcing send {seq} failed: {exc}", generation)
            raise TransportError(self._broken or str(exc)) from exc

    def announced(self, generation: Generation) -> int | None:
        """Decode side: the rows of the next send of `generation` to receive
        (`next_recv`), once the prefill side has announced it (the key is then removed);
        None while it has not. Raises TransportError when the store fails."""
        key = _sent_key(generation.number, generation.next_recv)
        try:
            if not self._store.check([key]):
                return None
            num_rows = int(self._store.get(key))
            self._store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 (the prefill instance is gone: the keeper
            raise TransportError(f"reading the announced sends failed: {exc}") from exc
        return num_rows

    def landed(self, generation: Generation, rows: torch.Tensor, sums: list[int]) -> None:
        """Decode side: send `next_recv` of `generation` was received into `rows` (their
        checksums `sums`); the next number is the next to receive."""
        with self._state:
            generation.landed[generation.next_recv] = (rows, sums)
            generation.next_recv += 1
            self._state.notify_all()

    def take(self, generation: Generation, seq: int) -> tuple[torch.Tensor, list[int]]:
        """Decode side: send `seq` of `generation` once it has landed, given up to the
        caller (a commit takes each send once). Raises ValueError for a send taken
        already, TransportError when the pair broke or formed again meanwhile, or the send
        does not land within `turn_timeout_s` (which breaks the pair: its number was never
        sent, or its bytes never came)."""
        with self._state:
            if seq < generation.next_recv and seq not in generation.landed:
                raise ValueError(f"send {seq} was taken already")
            came = self._state.wait_for(
                lambda: seq in generation.landed or self._broken is not None
                or generation is not self._generation, self.turn_timeout_s)
            missing = generation.next_recv
            item = generation.landed.pop(seq, None)
        if item is not None:
            return item
        if not came:
            self.break_(f"send {missing} never came while send {seq} waited "
                        f"{self.turn_timeout_s:g} s for it", generation)
        self.check(generation)  # raises: the pair broke or formed again
        raise TransportError(self._broken or f"send {seq} did not land")

    def break_(self, reason: str, generation: Generation) -> None:
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

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._state.notify_all()
        self._wake.set()
        # The keeper leaves at its next look (a process that ends while it is inside
        # torch.distributed may abort); it may be waiting for a peer that never comes.
        self._keeper.join(_JOIN_ATTEMPT_S + WATCH_S)

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
            options = None
            if self.backend == "nccl":
                # NCCL's own stream runs the sends and receives: beside a prefill's compute
                # they wait behind its kernels unless the stream is urgent too.
                options = dist.ProcessGroupNCCL.Options()
                options.is_high_priority_stream = True
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(f"kvtier-handoff/{number}/", store),
                rank=self.rank, world_size=2, timeout=timedelta(seconds=self.timeout_s),
                pg_options=options)
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
            self._generation = Generation(number, self.in_flight)
            self._broken = None
            self._state.notify_all()
        if again:
            log.warning("handoff over %s: the pair formed again (generation %d)",
                        self.backend, number)
        return True

    def _watch(self, store: Any, number: int) -> bool:
        """Wait until generation `number` breaks (True) or the pair is closed (False);
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


def _sent_key(number: int, seq: int) -> str:
    """The key announcing send `seq` of generation `number` (its value: the rows)."""
    return f"kvtier-handoff/{number}/sent/{seq}"


def _done_key(number: int, rank: int) -> str:
    """The key by which side `rank` says it has no call left in generation `number`."""
    return f"kvtier-handoff/done/{number}/{rank}"
