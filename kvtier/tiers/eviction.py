"""Eviction policies: which cached keys a tier gives up first.

A policy owns only its own index of keys; it never touches memory. The tier tells it what
happened (`on_put`, `on_hit`, `on_remove`) and asks it for candidates (`victims`). The tier
decides what may go (`can_evict`: e.g. not pinned, already written back), and reports the
keys it actually dropped with `on_remove`, so a policy with extra state (ARC, S3-FIFO) plugs
in without the tier changing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(Protocol[K]):
    """What a tier needs from an eviction policy."""

    def on_put(self, key: K) -> None:
        """`key` entered the tier. Putting a key that is already tracked counts as a hit."""

    def on_hit(self, key: K) -> None:
        """`key` was read. Unknown keys are ignored."""

    def on_remove(self, key: K) -> None:
        """`key` left the tier. Unknown keys are ignored."""

    def victims(self, num_victims: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Up to `num_victims` tracked keys for which `can_evict` holds, first victim first.

        Does not drop them: the tier calls `on_remove` for each key it really evicts.
        """
        ...

    def __len__(self) -> int:
        """Number of tracked keys."""
        ...


class LRUPolicy(EvictionPolicy[K]):
    """Least recently used first: an OrderedDict from coldest to hottest key.

    `victims` scans from the cold end, skipping keys that cannot go now (pinned ones), so a
    call costs O(number of skipped keys + num_victims).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def on_put(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def victims(self, num_victims: int, can_evict: Callable[[K], bool]) -> list[K]:
        if num_victims <= 0:
            return []
        out: list[K] = []
        for key in self._order:
            if can_evict(key):
                out.append(key)
                if len(out) == num_victims:
                    break
        return out

    def keys(self) -> list[K]:
        """Tracked keys, coldest first (for tests and inspection)."""
        return list(self._order)
