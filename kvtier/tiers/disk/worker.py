"""The disk worker process: serves one disk tier to the engine's process, reading records
into and writing them from the host slab both processes map.

Why a process: the disk tier's Python work (LMDB calls, checksums, header checks) takes and
gives back the GIL several times per block, and each time it wants the GIL back the engine
thread, which launches the model's kernels from Python, is made to hand it over. With the
disk tier in the engine's process a step's kernel launches took three times as long under
disk traffic (docs/BENCHMARKS.md, "The engine thread beside the I/O threads"). Here the
disk tier has a GIL of its own; the engine's process sends a job's block names and slot
offsets and waits for one answer per job.

Started by `kvtier.tiers.disk.worker_tier.DiskWorkerTier` as
`python -m kvtier.tiers.disk.worker FD`, FD one end of a Unix socket pair. Over it come
pickled messages (`multiprocessing.connection` framing):

  * first an `OpenRequest`; the answer is `("ready", info)` with the tier's attributes and
    what recovery did, `("off", recovery)` when recovery turned the disk tier off,
    `("unmapped", message)` when the host slab cannot be mapped here, or
    `("failed", exception)` when opening the tier raised;
  * then `(request_id, verb, args)`, answered `(request_id, True, result)` or
    `(request_id, False, exception)`, on a pool of threads, in any order;
  * unasked, `(None, "keys", (shard, event))`: every change of each shard's copy of its
    stored hashes (`kvtier.tiers.disk.keys.KeyEvent`), in order, and "current" as a
    thread of its own finds each copy at the stored generation every `KEYS_FRESH_S / 2`
    seconds. The engine's side keeps a replica and answers lookups from it. A commit's
    changes are sent before the answer to the request that made it, so the replica has
    them when the caller learns the blocks are stored.

EOF on the socket (the engine's process is gone) closes the tier and ends the process;
SIGINT and SIGTERM are ignored (see `main`).
"""

from __future__ import annotations

import functools
import logging
import mmap
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import lmdb
import numpy as np

from kvtier.layout import KVLayout
from kvtier.shared_host_memory import map_shared
from kvtier.tiers.disk.keys import KeyEvent
from kvtier.tiers.disk.recovery import open_disk_tier
from kvtier.tiers.disk.shards import ShardedDiskTier
from kvtier.tiers.disk.tier import KEYS_FRESH_S, DiskTier
from kvtier.tiers.record import BlockMeta

logger = logging.getLogger("kvtier.tiers.disk.worker")

#: A block as sent between the processes: (block_hash, parent_hash, token_ids).
MetaTuple = tuple[bytes, bytes, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """How the worker opens its tier (`open_disk_tier`'s arguments) and maps the slab."""

    path: str
    layout: KVLayout
    budget_bytes: int
    shards: int
    durable: bool
    lookup_deadline_s: float
    shared_path: str
    shared_bytes: int
    threads: int


@dataclass(frozen=True, slots=True)
class TierInfo:
    """The opened tier's attributes the engine's side mirrors."""

    write_batch: int
    serial_writes: bool
    durable: bool
    budget_bytes: int
    num_shards: int


def meta_tuples(metas: list[BlockMeta]) -> list[MetaTuple]:
    """`metas` as plain tuples (cheaper to pickle than the dataclasses)."""
    return [(m.block_hash, m.parent_hash, m.token_ids) for m in metas]


class _Server:
    """One opened tier and the slab's mapping; `handle` runs one request."""

    def __init__(self, tier: DiskTier | ShardedDiskTier, slab: mmap.mmap,
                 bytes_per_block: int) -> None:
        self.tier, self.bytes_per_block = tier, bytes_per_block
        self._slab = np.frombuffer(slab, dtype=np.uint8)  # [shared_bytes], writable

    def _rows(self, offsets: list[int]) -> list[np.ndarray]:
        size = self.bytes_per_block
        return [self._slab[offset:offset + size] for offset in offsets]

    def handle(self, verb: str, args: tuple) -> Any:
        if verb == "contains":
            return self.tier.contains(args[0])
        if verb == "get":
            metas, offsets = _metas(args[0]), args[1]
            if offsets is not None:
                return self.tier.get_many_into(metas, self._rows(offsets))
            buffers = [np.empty(self.bytes_per_block, dtype=np.uint8) for _ in metas]
            hits = self.tier.get_many_into(metas, buffers)
            return hits, [buf.tobytes() if hit else None for buf, hit in zip(buffers, hits)]
        if verb == "put":
            metas, payloads = _metas(args[0]), args[1]
            if payloads and isinstance(payloads[0], int):
                payloads = self._rows(payloads)
            return self.tier.put_counted(metas, payloads)
        if verb == "delete":
            return self.tier.delete(args[0])
        if verb == "sync":
            return self.tier.sync()
        if verb == "stats":
            return self.tier.stats()
        raise ValueError(f"the disk worker has no verb {verb!r}")


def _metas(tuples: list[MetaTuple]) -> list[BlockMeta]:
    return [BlockMeta(h, p, t) for h, p, t in tuples]


def _open(conn: Connection) -> tuple[_Server, OpenRequest] | None:
    request: OpenRequest = conn.recv()
    try:
        slab = map_shared(request.shared_path, request.shared_bytes)
    except OSError as exc:  # this process cannot serve the engine's slab
        conn.send(("unmapped", str(exc)))
        return None
    try:
        tier, recovery = open_disk_tier(request.path, request.layout, request.budget_bytes,
                                        shards=request.shards, tier_class=DiskTier,
                                        durable=request.durable,
                                        lookup_deadline_s=request.lookup_deadline_s)
    except Exception as exc:  # told to the engine's side, which raises it
        conn.send(("failed", exc))
        return None
    if tier is None:
        conn.send(("off", recovery))
        return None
    conn.send(("ready", (TierInfo(tier.write_batch, tier.serial_writes, tier.durable,
                                  tier.budget_bytes, len(_shards(tier))), recovery)))
    return _Server(tier, slab, request.layout.bytes_per_block), request


def _shards(tier: DiskTier | ShardedDiskTier) -> list[DiskTier]:
    return tier.shards if isinstance(tier, ShardedDiskTier) else [tier]


def _tell_keys(tier: DiskTier | ShardedDiskTier, send: Callable[[tuple], None],
               stop: threading.Event) -> threading.Thread:
    """Send every shard's key events, and confirm the copies current on a thread of its own
    (returned, started) until `stop` is set."""
    shards = _shards(tier)
    for index, shard in enumerate(shards):
        shard.watch_keys(functools.partial(_send_key_event, send, index))

    def confirm() -> None:
        while not stop.wait(KEYS_FRESH_S / 2):
            for shard in shards:
                try:
                    shard.keys_in_memory()  # "current" when it is; a load when it is not
                except (lmdb.Error, OSError, ValueError):  # closing, or the files went away
                    pass

    thread = threading.Thread(target=confirm, name="kvtier-disk-keys-current", daemon=True)
    thread.start()
    return thread


def _send_key_event(send: Callable[[tuple], None], shard: int, event: KeyEvent) -> None:
    send((None, "keys", (shard, event)))


def serve(conn: Connection) -> None:
    """Open the tier the first message asks for, then answer requests until EOF or
    "close" (whose answer is sent once the tier has closed)."""
    opened = _open(conn)
    if opened is None:
        return
    server, request = opened
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        try:
            with send_lock:
                conn.send(message)
        except (OSError, ValueError):  # the engine is gone: the receive loop ends
            pass

    stop_keys = threading.Event()
    keys_thread = _tell_keys(server.tier, send, stop_keys)

    def answer(request_id: int, verb: str, args: tuple) -> None:
        try:
            reply = (request_id, True, server.handle(verb, args))
        except Exception as exc:
            logger.exception("disk worker: %s failed", verb)
            reply = (request_id, False, exc)
        send(reply)

    pool = ThreadPoolExecutor(request.threads, thread_name_prefix="kvtier-disk-worker")
    close_id = None
    try:
        while True:
            try:
                request_id, verb, args = conn.recv()
            except (EOFError, OSError):
                break
            if verb == "close":
                close_id = request_id
                break
            pool.submit(answer, request_id, verb, args)
    finally:
        stop_keys.set()
        keys_thread.join()
        pool.shutdown(wait=True)
        server.tier.close()
        if close_id is not None:
            send((close_id, True, None))


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group and a service manager may signal every process
    # of the engine: the engine's process flushes its host blocks through this one while it
    # shuts down, so the worker ends when the engine closes it or goes away (EOF), never on
    # a signal of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format="%(levelname)s kvtier disk worker: %(message)s")
    with Connection(int(argv[1])) as conn:
        serve(conn)
    return 0


if __name__ == "__main__":
    # Run under the module's own name, so what it pickles names classes the engine's
    # process can find (not `__main__.TierInfo`).
    from kvtier.tiers.disk import worker
    sys.exit(worker.main(sys.argv))
