"""The prefill side of one handoff: blocks in as the engine computes them, records out.

The engine gives the request's prompt blocks to `PrefillHandoff.tap` as each chunk makes
them full (on the engine thread, each block with a reference taken for the handoff); they
wait in a queue until the decode instance's reservation is known (`start`: it is made while
the prefill computes), then a worker thread running `pump` sends them, at most a channel's
`capacity` at a time, and commits each group to the decode instance while the engine
computes the next chunk. A channel that allows it (`SendChannel.in_flight`) has the next
group read and sent while the last one's commit is still on its way: the commits then go
out on threads of their own, numbered (`part`) so that the decode side takes them in order,
and the worker settles their answers oldest first. Blocks the decode instance said it holds
are not sent. The last group leaves as soon as every full block of the prompt has been
tapped, without waiting for the engine to hand the request's end to its caller. While no
block comes (the request waits its turn, a long chunk computes), an empty commit every
third of the decode side's reservation timeout keeps the reservation alive. Every block's
reference is given back (`release`, thread-safe) once its bytes are out, whatever happens;
a failure ends the handoff with an abort sent to the decode instance and `HandoffFailed`
raised.

On a GPU the worker reads blocks on a CUDA stream of its own, once an event the tap
recorded on the engine's stream, when the chunk that filled them was launched, has passed:
a group then waits only for that chunk, not behind the later chunks the engine has queued
meanwhile (on the engine's stream a group would wait for the whole queue to drain).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from kvtier.cuda_device import bind_thread, on_stream, urgent_stream
from kvtier.free_queue import KVCacheBlock
from kvtier.handoff.base import (
    HandoffTransport,
    Json,
    OutgoingBlock,
    SendChannel,
    TransportError,
)
from kvtier.handoff.control import ControlError, DecodeControl
from kvtier.handoff.stats import HandoffCounters
from kvtier.stats import busy_seconds
from kvtier.tiers.record import BlockMeta

#: release(blocks): give back the handoff's reference on each block (thread-safe).
Release = Callable[[list[KVCacheBlock]], None]

_DONE = object()


class HandoffFailed(RuntimeError):
    """A handoff could not complete. `status`: what the prefill endpoint answers (502: the
    decode instance refused or could not be reached, or the transport failed; 504: it ran
    out of time)."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """What one handoff did; `transfer_s` is the time during which some group was being
    read, sent or committed (not waiting for the prefill to fill the blocks; overlapping
    groups counted once), `wire_s` the part of it the bytes took on the link, `wait_s` the
    time from the end of the prefill to the last commit's answer, `phases` the seconds of
    each part (`PrefillHandoff.phases`), `num_groups` the sends it took."""

    handoff_id: str
    transport: str
    blocks_total: int
    blocks_sent: int
    blocks_skipped: int
    blocks_rejected: int
    bytes: int
    transfer_s: float
    wait_s: float
    phases: dict[str, float]
    num_groups: int
    #: Seconds the sends' bytes took from ready to delivered, in all (`SendChannel.wire_s`;
    #: None where the transport cannot tell).
    wire_s: float | None = None


class PrefillHandoff:
    """One handoff, prefill side (see the module docstring).

    control: the decode instance. kv_cache: the engine's `[num_blocks, *block_shape]` cache
    the blocks are read from. release: see `Release`. timeout_s: the whole handoff's budget,
    from now. The engine may tap blocks at once; they wait in a queue until `start` gives
    the decode's reservation (made while the prefill computes) and `pump` runs.
    `phases` adds up where the time went (seconds): `chunk` (waiting for the prefill to
    fill a group's blocks), `read` (gathering, checking and moving them), `slot` (a send
    waiting for an earlier one's commit to free its room), `commit` (from a
    commit's call to its answer; commits under way together each count), and, within that,
    the decode side's own `receive` (bytes and validation) and `place` as its answers
    report them.
    """

    channel: SendChannel  # opened by `start`

    def __init__(self, control: DecodeControl, kv_cache: torch.Tensor, release: Release,
                 counters: HandoffCounters, timeout_s: float) -> None:
        self.control = control
        self.kv_cache = kv_cache
        self.release = release
        self.counters = counters
        self.deadline = time.monotonic() + timeout_s
        self.transport: HandoffTransport | None = None
        self.handoff_id = ""
        self.held: list[bool] = []
        #: Seconds without a commit after which an empty one keeps the reservation alive.
        self.keepalive_s = 10.0
        self._last_commit = time.monotonic()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._prompt_done_at: float | None = None
        self._lock = threading.Lock()
        self._closed = False  # taps from now on are released at once (`discard`)
        self._num_tapped = 0  # blocks tapped so far (they come in prompt order)
        on_gpu = kv_cache.device.type == "cuda"
        self._stream = urgent_stream(kv_cache.device) if on_gpu else None
        self.phases: dict[str, float] = {}
        self.num_groups = 0
        self.num_sent = self.num_rejected = self.num_bytes = 0
        self._commits: deque[Future] = deque()  # commits not yet settled, oldest first
        self._next_part = 0
        self._committer: ThreadPoolExecutor | None = None
        self._spans: list[tuple[float, float]] = []  # (read began, answered) per commit

    def start(self, transport: HandoffTransport, reservation: Json) -> None:
        """Take the decode's answer to `reserve` over `transport`; call it once, before
        `pump`. Raises KeyError, TypeError or ValueError for a malformed reservation,
        TransportError when the transport cannot open its channel."""
        handoff_id = str(reservation["handoff_id"])
        held = [bool(h) for h in reservation["held"]]
        keepalive_s = float(reservation.get("timeout_s", 30.0)) / 3
        self.channel = transport.open_send(reservation["offer"])
        if self.channel.in_flight > 1:
            self._committer = ThreadPoolExecutor(self.channel.in_flight,
                                                 thread_name_prefix="kvtier-handoff-commit")
        self.transport, self.handoff_id, self.held = transport, handoff_id, held
        self.keepalive_s = keepalive_s
        self._last_commit = time.monotonic()

    # ---- the engine's side ---------------------------------------------------------------

    def tap(self, first_index: int, metas: list[BlockMeta], blocks: list[KVCacheBlock]) -> None:
        """`kvtier.engine.block_taps.BlockTap`: queue newly ready blocks for the worker
        (after `discard`, give them back at once). Called on the engine thread right after
        the step that fills them was launched: an event recorded on its stream now marks
        when their bytes are there."""
        with self._lock:
            if not self._closed:
                filled = torch.cuda.current_stream(self.kv_cache.device).record_event() \
                    if self._stream is not None else None
                self._queue.put((first_index, metas, blocks, filled))
                return
        self.release(blocks)

    def discard(self) -> None:
        """Take no more blocks: release those queued and any tapped from now on. `pump`
        does it when it ends; call it where `pump` never ran (no reservation)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _DONE:
                self.release(item[2])

    def prompt_done(self) -> None:
        """The engine has finished the prompt: every block has been tapped."""
        self._prompt_done_at = time.monotonic()
        self._queue.put(_DONE)

    def cancel(self) -> None:
        """Stop sending (the caller gave up); `pump` releases what is left and raises."""
        self._cancelled.set()
        self._queue.put(_DONE)

    # ---- the worker ----------------------------------------------------------------------

    def pump(self) -> HandoffResult:
        """Send and commit blocks until the prompt is done (run on a worker thread). Raises
        HandoffFailed; every block is released either way."""
        assert self.transport is not None, "start() comes before pump()"
        bind_thread(self.kv_cache.device)
        name = self.transport.name
        pending: list[_Pending] = []
        failure: HandoffFailed | None = None
        done = committed_last = False
        try:
            while not done:
                collected = self._collect(pending)
                done = bool(collected)
                if collected is None and not pending and failure is None:
                    # nothing came for a while: keep the reservation alive
                    failure = self._attempt(lambda: self._send([], last=False))
                if self._cancelled.is_set() and failure is None:
                    failure = HandoffFailed(f"handoff {self.handoff_id} ran out of time", 504)
                if failure is not None:
                    self.release([item.block for item in pending])
                    pending = []
                    continue
                while pending and (done or len(pending) >= self.channel.capacity
                                   or self._overdue()):
                    group, pending = (pending[:self.channel.capacity],
                                      pending[self.channel.capacity:])
                    ended = done and not pending
                    failure = self._attempt(partial(self._send, group, ended))
                    if failure is not None:
                        break
                    committed_last = ended
                if done and failure is None and not pending and not committed_last:
                    failure = self._attempt(lambda: self._send([], last=True))
            while self._commits and failure is None:
                failure = self._attempt(self._settle)
            if failure is not None:
                self.release([item.block for item in pending])
                raise failure
        finally:
            self._forget_commits()
            self.channel.close()
            self.discard()
            if failure is not None:
                self.control.abort(self.handoff_id)
        num_skipped = sum(self.held)
        self.counters.add_blocks("prefill", name, "sent", self.num_sent)
        self.counters.add_blocks("prefill", name, "skipped", num_skipped)
        self.counters.add_blocks("prefill", name, "rejected", self.num_rejected)
        self.counters.add_bytes("prefill", name, self.num_bytes)
        ended = time.monotonic()
        return HandoffResult(self.handoff_id, name, len(self.held), self.num_sent, num_skipped,
                             self.num_rejected, self.num_bytes, busy_seconds(self._spans),
                             ended - (self._prompt_done_at or ended), dict(self.phases),
                             self.num_groups, self.channel.wire_s)

    @staticmethod
    def _attempt(step: Callable[[], None]) -> HandoffFailed | None:
        """Run `step`; the HandoffFailed it raised, if any."""
        try:
            step()
        except HandoffFailed as exc:
            return exc
        return None

    def _forget_commits(self) -> None:
        """Wait for the commits still under way without taking their answers (after a
        failure: the handoff is aborted next), and stop the committing threads."""
        while self._commits:
            self._commits.popleft().exception()
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None

    def _collect(self, pending: list[_Pending]) -> bool | None:
        """Wait for tapped blocks (until the deadline, or `keepalive_s`), then take every
        one queued; add those to send to `pending`, release the others. Returns whether
        the prompt is done, None when nothing came within `keepalive_s`."""
        items = []
        left = self.deadline - time.monotonic()
        try:
            items.append(self._queue.get(timeout=max(0.0, min(left, self.keepalive_s))))
        except queue.Empty:
            if left > self.keepalive_s:
                return None
            # Out of time: fail, but go on releasing what is tapped until the caller ends
            # the handoff (`prompt_done` or `cancel`, which it always calls).
            self._cancelled.set()
            items.append(self._queue.get())
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        done = False
        skipped = []
        for item in items:
            if item is _DONE:
                done = True
                continue
            first, metas, blocks, filled = item
            self._num_tapped = max(self._num_tapped, first + len(blocks))
            for k, (meta, block) in enumerate(zip(metas, blocks)):
                index = first + k
                if index < len(self.held) and self.held[index]:
                    skipped.append(block)
                else:
                    pending.append(_Pending(index, meta, block, filled))
        if skipped:
            self.release(skipped)
        # Every full block of the prompt is here: the last group can leave now, while the
        # engine still samples and hands the request's end to the caller.
        return done or 0 < len(self.held) <= self._num_tapped

    def _overdue(self) -> bool:
        """Whether the decode side has waited `keepalive_s` for a commit: blocks that
        trickle in are committed before a group is full, so the reservation stays alive."""
        return time.monotonic() - self._last_commit >= self.keepalive_s

    def _send(self, group: Sequence[_Pending], last: bool) -> None:
        """Move `group`'s records (its blocks are released once read) and commit them. The
        answer is settled here, or later while the channel lets commits be under way."""
        if not group:
            # No bytes to announce (a keepalive, or the end after the last group left): sent
            # once the commits under way are answered, it never waits for them at the decode
            # instance, where a burst of such waits held its threads and connections.
            while self._commits:
                self._settle()
        entries: list[Json] = []
        began = time.monotonic()
        try:
            if began >= self.deadline:
                raise HandoffFailed(f"handoff {self.handoff_id} ran out of time", 504)
            if group:
                # The chunks that fill the group compute first: waited for here, on the host,
                # so that the transfer's own time is told apart from the prefill's.
                for filled in {id(i.filled): i.filled for i in group if i.filled}.values():
                    filled.synchronize()
                self._add_phase("chunk", time.monotonic() - began)
                began = time.monotonic()
                waited = self.channel.slot_wait_s
                with on_stream(self._stream):
                    entries = self.channel.send(self._outgoing(group))
                if self._stream is not None:
                    # The blocks go back to the engine next: their bytes must have been read.
                    self._stream.synchronize()
                self.num_groups += 1
                waited = self.channel.slot_wait_s - waited
                self._add_phase("slot", waited)
                self._add_phase("read", time.monotonic() - began - waited)
        except TransportError as exc:
            raise HandoffFailed(f"the {self.transport.name} transport failed: {exc}") from exc
        finally:
            self.release([item.block for item in group])
        part, self._next_part = self._next_part, self._next_part + 1
        commit = partial(self._commit, entries, last, part, began, bool(group))
        if self._committer is not None:
            self._commits.append(self._committer.submit(commit))
        else:
            future: Future = Future()
            try:
                future.set_result(commit())
            except BaseException as exc:  # noqa: BLE001 (settled below, as a thread's would be)
                future.set_exception(exc)
            self._commits.append(future)
        while len(self._commits) >= self.channel.in_flight:
            self._settle()

    def _outgoing(self, group: Sequence[_Pending]) -> list[OutgoingBlock]:
        """`group` as the channel reads it: rows of one gathered copy, or the cache's own
        rows for a channel that reads in place."""
        ids = [item.block.block_id for item in group]
        if self.channel.reads_in_place:
            rows = _cache_rows(self.kv_cache)
            return [OutgoingBlock(item.index, item.meta, rows[i], cache_row=i)
                    for item, i in zip(group, ids)]
        rows = _read_blocks(self.kv_cache, ids)
        return [OutgoingBlock(item.index, item.meta, rows[k]) for k, item in enumerate(group)]

    def _commit(self, entries: list[Json], last: bool, part: int, began: float,
                sent: bool) -> tuple[Json, float, float]:
        """Call the decode instance's commit (on a committing thread, or the worker's): its
        answer, and when the call was made and answered. `sent`: it announces a send."""
        called = time.monotonic()
        try:
            answer = self.control.commit(self.handoff_id, self.transport.name, entries, last,
                                         part)
        except ControlError as exc:
            if sent and exc.status == 404:
                # The decode side consumes the bytes a commit announces before it answers
                # that its handoff is unknown (expired or ended): the send is done, and a
                # pair that sends in step (NCCL) stays in step.
                self.channel.committed()
            raise
        self._last_commit = answered = time.monotonic()
        self._spans.append((began, answered))
        if sent:
            # Here, not when the answer is settled: the room it frees may be what another
            # handoff's worker, or this one's, waits for.
            self.channel.committed()
        return answer, called, answered

    def _settle(self) -> None:
        """Take the oldest commit's answer: count its blocks, or raise HandoffFailed."""
        future = self._commits.popleft()
        try:
            answer, called, answered = future.result()
        except ControlError as exc:
            raise HandoffFailed(f"the decode instance failed handoff {self.handoff_id}: "
                                f"{exc}", 504 if exc.timed_out else 502) from exc
        except TransportError as exc:
            raise HandoffFailed(f"the {self.transport.name} transport failed: {exc}") from exc
        self._add_phase("commit", answered - called)
        timings = answer.get("timings")
        if isinstance(timings, dict):
            for phase, seconds in timings.items():
                if isinstance(seconds, (int, float)):
                    self._add_phase(str(phase), float(seconds))
        if not isinstance(answer.get("accepted"), list) \
                or not isinstance(answer.get("rejected"), list):
            raise HandoffFailed(f"the decode instance's commit answer is malformed: "
                                f"{str(answer)[:200]}")
        self.num_sent += len(answer["accepted"]) + len(answer["rejected"])
        self.num_rejected += len(answer["rejected"])
        self.num_bytes += len(answer["accepted"]) * self.transport.layout.bytes_per_block

    def _add_phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


@dataclass(frozen=True, slots=True)
class _Pending:
    """A tapped block waiting for its group: its index in the prompt, what names it, its
    GPU block, and the event after which its bytes are there (None off CUDA)."""

    index: int
    meta: BlockMeta
    block: KVCacheBlock
    filled: torch.cuda.Event | None


def _cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 rows `[num_blocks, bytes_per_block]`, one block each (a view)."""
    return kv_cache.view(-1).view(torch.uint8).view(kv_cache.shape[0], -1)


def _read_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The bytes of blocks `block_ids` as uint8 rows `[n, bytes_per_block]`: one gathered
    copy, on the cache's device."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    return _cache_rows(kv_cache)[ids]
