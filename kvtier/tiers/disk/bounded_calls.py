"""Calls on a thread of their own, each waited for at most a deadline: how the disk tier
answers lookups and stats reads in bounded time while the disk under it may stall."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

#: What `BoundedCalls.call` answers for a call that outlasted its deadline.
TIMED_OUT = object()


class BoundedCalls:
    """Calls on a thread of their own, each waited for at most a deadline. A call past its
    deadline stalls the thread: until it returns, later calls are not started (they get no
    answer at once), so a frozen disk holds one thread, not one per call."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._stalled: Future | None = None  # a call past its deadline, until it returns
        # The executor starts its thread at the first call: started now, so that a fresh
        # engine's first prefix lookup does not wait for a thread to be scheduled, which on
        # a loaded machine can take longer than restoring a short prompt.
        self._executor.submit(int)

    @property
    def stalled(self) -> bool:
        """Whether a call past its deadline has not returned yet."""
        stalled = self._stalled
        return stalled is not None and not stalled.done()

    def call(self, deadline_s: float, fn: Callable, *args: object) -> tuple[bool | None, Any]:
        """(True, `fn(*args)`) when it returned within `deadline_s`; (False, `TIMED_OUT`)
        when it did not (the thread is stalled from now on), (False, None) while an earlier
        call is still stalled, and (None, None) once shut down."""
        with self._lock:
            if self._stalled is not None:
                if not self._stalled.done():
                    return False, None
                self._stalled = None
        try:
            future = self._executor.submit(fn, *args)
        except RuntimeError:  # shut down: the tier is closing
            return None, None
        try:
            return True, future.result(timeout=deadline_s)
        except FutureTimeout:
            with self._lock:
                self._stalled = future
            return False, TIMED_OUT

    def shutdown(self) -> None:
        """Start no more calls; a call under way is not waited for."""
        self._executor.shutdown(wait=False)
