"""The simulator's clock: an event queue in work time, and the real time that busy devices sharing a host stretch.

Two clocks. ``now`` is work time: a busy device does one second of its work per second of it, so every cost composes
exactly. While ``n`` devices are busy, a second of work takes ``1 + c·(n − 1)`` seconds of real time (a shared host,
``c`` = ``Hardware.host_contention``); every reported time is real. With ``c = 0``
the two are the same. The clock knows nothing of engines or loops: the engine model and the loops schedule their
events on it and tell it when devices start and stop working.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Clock:
    """Discrete events on a virtual clock (ties run in the order they were scheduled)."""

    def __init__(self, contention: float) -> None:
        self.now = 0.0  # work time of the event being run
        self._contention = contention
        self._n_busy = 0
        self._real = self._last = 0.0  # real time at work time _last, the last change of _n_busy
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()

    def real_now(self) -> float:
        """Real time at ``now``."""
        return self._real + (self.now - self._last) * (1.0 + self._contention * max(0, self._n_busy - 1))

    def busy_change(self, delta: int) -> None:
        """``delta`` devices became busy (> 0) or idle (< 0) at ``now``."""
        self._real = self.real_now()
        self._last = self.now
        self._n_busy += delta

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at work time ``when``."""
        heapq.heappush(self._events, (when, next(self._seq), fn, args))

    def run(self, done: Callable[[], bool]) -> None:
        """Run events in time order until none is left or ``done()``."""
        while self._events and not done():
            when, _, fn, args = heapq.heappop(self._events)
            self.now = when
            fn(*args)
