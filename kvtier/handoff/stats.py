"""The handoff's counters, as /metrics names them:

    kvtier_handoffs_total{role,transport,outcome}     outcome: ok | failed | timeout
    kvtier_handoff_bytes_total{role,transport}
    kvtier_handoff_blocks_total{role,transport,kind}  kind: sent | skipped | rejected
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HandoffStats:
    """A snapshot: per label tuple, the count."""

    handoffs: dict[tuple[str, str, str], int]
    bytes: dict[tuple[str, str], int]
    blocks: dict[tuple[str, str, str], int]


class HandoffCounters:
    """Thread-safe counters of handoffs, their bytes and blocks, by role and transport."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handoffs: Counter[tuple[str, str, str]] = Counter()
        self._bytes: Counter[tuple[str, str]] = Counter()
        self._blocks: Counter[tuple[str, str, str]] = Counter()

    def add_handoff(self, role: str, transport: str, outcome: str) -> None:
        assert outcome in ("ok", "failed", "timeout"), f"unknown outcome {outcome}"
        with self._lock:
            self._handoffs[role, transport, outcome] += 1

    def add_bytes(self, role: str, transport: str, num_bytes: int) -> None:
        with self._lock:
            self._bytes[role, transport] += num_bytes

    def add_blocks(self, role: str, transport: str, kind: str, num_blocks: int) -> None:
        assert kind in ("sent", "skipped", "rejected"), f"unknown kind {kind}"
        with self._lock:
            self._blocks[role, transport, kind] += num_blocks

    def snapshot(self) -> HandoffStats:
        with self._lock:
            return HandoffStats(dict(self._handoffs), dict(self._bytes), dict(self._blocks))
