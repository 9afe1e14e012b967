"""A staleness-bounded queue between rollout producers and the trainer: oldest first, never drops silently.

Every item carries the policy ``version`` that produced it (for a generation spanning several versions, pass the
OLDEST one, ``min(output_versions)``). A consumer training policy version ``current_version`` takes items with
``age = current_version - version <= max_staleness`` only; the check is done when the batch is taken (admission
control alone does not bound age at consumption). Items found too old are *stale*: handed to ``on_stale(item,
version)`` or kept for :meth:`StalenessQueue.drain_stale`, and always counted. A full queue makes :meth:`put` block
or raise; it never evicts.

Items *ahead* of the consumer (``version > current_version``, a negative age) are fresh and are returned, but never
without a word: each is counted in ``stats()["ahead"]`` (largest lead in ``"max_ahead"``, and its negative age in
the age histogram). Several consumers sharing a queue produce them legitimately (a producer tags an item with a
version that another consumer already moved to); in a single-consumer loop they mean the trainer passed the wrong
``current_version`` or the engine was given weights from the future, so ``on_ahead="raise"`` makes
:meth:`StalenessQueue.get_batch` refuse them (``ArgumentError``; nothing is taken, the items stay queued).

Accounting invariant (checked by the tests): ``put == returned + stale + len(queue)``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from rlblocks._checks import check_bool, check_int, check_real, check_state_keys, check_timeout
from rlblocks.errors import ArgumentError, QueueClosed, QueueFull


class StalenessQueue:
    """Thread-safe priority queue ordered by ``(version, arrival)`` that returns only fresh items.

    Args:
        max_staleness: ``eta >= 0``; an item is fresh for ``current_version`` iff ``current_version - version <= eta``.
        capacity: maximum number of queued items (``None``: unbounded). Stale items held for :meth:`drain_stale`
            do not count against it.
        on_stale: ``on_stale(item, version)`` is called (outside the lock, in the consuming thread) for each item
            found stale. Without it stale items are kept for :meth:`drain_stale`.
        on_ahead: what to do with an item newer than ``current_version`` (see the module docstring): ``"count"``
            (default: return it, count it in ``stats()["ahead"]``) or ``"raise"`` (refuse the batch).

    Blocking methods (:meth:`put`, :meth:`get_batch`) use a ``threading.Condition``; the coroutine versions
    (:meth:`aput`, :meth:`aget_batch`) never block the event loop: they check under the lock and otherwise await a
    future that producers/consumers in any thread resolve. Taking items is atomic with respect to cancellation, so
    a cancelled ``aget_batch`` loses nothing.

    After :meth:`close`, ``put`` raises :class:`QueueClosed` and ``get_batch`` returns at once with whatever fresh
    items remain (``[]`` once empty); all waiters are woken.

    Checkpointing: :meth:`state_dict` holds the queued and stale-pending items themselves (by reference, not
    copied), so they must be picklable for ``torch.save`` / ``pickle``. Item ages in seconds are saved relative to
    the save time, so wait-time statistics survive a restart.
    """

    def __init__(
        self,
        *,
        max_staleness: int,
        capacity: int | None = None,
        on_stale: Callable[[Any, int], None] | None = None,
        on_ahead: Literal["count", "raise"] = "count",
    ) -> None:
        self.max_staleness = check_int("max_staleness", max_staleness, minimum=0)
        self.capacity = None if capacity is None else check_int("capacity", capacity, minimum=1)
        if on_stale is not None and not callable(on_stale):
            raise ArgumentError(f"on_stale: expected a callable(item, version) or None, got {on_stale!r}")
        self.on_stale = on_stale
        if on_ahead not in ("count", "raise"):
            raise ArgumentError(f"on_ahead: expected 'count' or 'raise', got {on_ahead!r}")
        self.on_ahead = on_ahead
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._heap: list[tuple[int, int, float, Any]] = []  # (version, seq, t_put, item)
        self._seq = itertools.count()
        self._stale_pending: list[tuple[Any, int]] = []
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._getters = 0
        self._putters = 0
        self._closed = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._n_put = 0
        self._n_returned = 0
        self._n_stale = 0
        self._n_drained = 0
        self._n_ahead = 0
        self._max_ahead = 0
        self._age_hist: Counter[int] = Counter()
        self._stale_age_hist: Counter[int] = Counter()
        self._wait_total = 0.0
        self._get_block_total = 0.0
        self._put_block_total = 0.0

    # ------------------------------------------------------------------ helpers (lock held)
    def _wake_async_locked(self) -> None:
        if not self._async_waiters:
            return
        waiters, self._async_waiters = self._async_waiters, set()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _notify_put_locked(self) -> None:
        if self._getters:
            self._not_empty.notify_all()
        self._wake_async_locked()

    def _notify_taken_locked(self) -> None:
        if self._putters:
            self._not_full.notify_all()
        self._wake_async_locked()

    def _full_locked(self) -> bool:
        return self.capacity is not None and len(self._heap) >= self.capacity

    def _push_locked(self, item: Any, version: int) -> None:
        heapq.heappush(self._heap, (version, next(self._seq), time.monotonic(), item))
        self._n_put += 1
        self._notify_put_locked()

    def _purge_locked(self, current_version: int) -> list[tuple[Any, int]]:
        """Pop every stale item (they sit at the top: the heap is ordered by version). Returns them."""
        heap, limit = self._heap, current_version - self.max_staleness
        stale: list[tuple[Any, int]] = []
        while heap and heap[0][0] < limit:
            version, _, _, item = heapq.heappop(heap)
            stale.append((item, version))
            self._stale_age_hist[current_version - version] += 1
        if stale:
            self._n_stale += len(stale)
            if self.on_stale is None:
                self._stale_pending.extend(stale)
            self._notify_taken_locked()
        return stale

    def _take_locked(self, n: int, current_version: int) -> list[Any]:
        """Pop the ``n`` oldest items and account for them (ages, waits, items ahead of ``current_version``)."""
        heap = self._heap
        k = min(n, len(heap))
        if self.on_ahead == "raise" and k:
            newest = max(entry[0] for entry in heapq.nsmallest(k, heap))
            if newest > current_version:
                raise ArgumentError(
                    f"current_version: expected >= the version of every item taken (on_ahead='raise'), got "
                    f"{current_version} while an item of version {newest} would be returned; nothing was taken"
                )
        taken = [heapq.heappop(heap) for _ in range(k)]
        if not taken:
            return []
        self._notify_taken_locked()
        now = time.monotonic()
        self._n_returned += len(taken)
        hist = self._age_hist
        wait = 0.0
        for version, _, t_put, _ in taken:
            age = current_version - version
            hist[age] += 1
            if age < 0:
                self._n_ahead += 1
                self._max_ahead = max(self._max_ahead, -age)
            wait += now - t_put
        self._wait_total += wait
        return [entry[3] for entry in taken]

    def _deliver_stale(self, stale: list[tuple[Any, int]]) -> None:
        """Call ``on_stale`` outside the lock, before any batch is taken. If it raises, the undelivered stale items
        go to the drain list (nothing is lost, nothing was taken) and the error propagates."""
        if not stale or self.on_stale is None:
            return
        for i, (item, version) in enumerate(stale):
            try:
                self.on_stale(item, version)
            except BaseException:
                with self._lock:
                    self._stale_pending.extend(stale[i:])
                raise

    # ------------------------------------------------------------------ producer side
    def put(self, item: Any, version: int, *, block: bool = True, timeout: float | None = None) -> None:
        """Insert ``item`` produced by policy ``version``.

        When the queue is full: ``block=False`` raises :class:`QueueFull` at once; otherwise wait up to ``timeout``
        seconds (``None``: forever) for room, then raise :class:`QueueFull`. Raises :class:`QueueClosed` after
        :meth:`close`. The item is never dropped: on any exception it was not inserted.
        """
        version = check_int("version", version, minimum=0)
        timeout = check_timeout(timeout)
        block = check_bool("block", block)  # a truthy "no" would block
        with self._lock:
            if self._closed:
                raise QueueClosed("put: the queue is closed")
            if self._full_locked():
                if not block:
                    raise QueueFull(f"put: the queue is full (capacity={self.capacity})")
                t0 = time.monotonic()
                deadline = None if timeout is None else t0 + timeout
                self._putters += 1
                try:
                    while self._full_locked() and not self._closed:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            break
                        self._not_full.wait(remaining)
                finally:
                    self._putters -= 1
                    self._put_block_total += time.monotonic() - t0
                if self._closed:
                    raise QueueClosed("put: the queue was closed while waiting for room")
                if self._full_locked():
                    raise QueueFull(f"put: still full after {timeout} s (capacity={self.capacity})")
            self._push_locked(item, version)

    async def aput(self, item: Any, version: int, *, timeout: float | None = None) -> None:
        """Coroutine :meth:`put` that waits for room without blocking the event loop."""
        version = check_int("version", version, minimum=0)
        timeout = check_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._lock:
                if self._closed:
                    raise QueueClosed("aput: the queue is closed")
                if not self._full_locked():
                    self._push_locked(item, version)
                    return
                fut = loop.create_future()
                waiter = (loop, fut)
                self._async_waiters.add(waiter)
            if not await self._await_waiter(waiter, deadline, loop):
                with self._lock:
                    if not self._full_locked() and not self._closed:
                        self._push_locked(item, version)
                        return
                raise QueueFull(f"aput: still full after {timeout} s (capacity={self.capacity})")

    # ------------------------------------------------------------------ consumer side
    def get_batch(self, n: int, *, current_version: int, timeout: float | None = None) -> list[Any]:
        """Up to ``n`` fresh items, oldest first (by version, then arrival).

        Stale items at the head are moved out first (``on_stale`` or the drain list). Waits until ``n`` fresh items
        are queued, the queue is closed, or ``timeout`` seconds pass (``None``: no limit; ``0``: do not wait), then
        returns what there is — possibly fewer than ``n``, possibly ``[]``.
        """
        n = check_int("n", n, minimum=1)
        current_version = check_int("current_version", current_version, minimum=0)
        timeout = check_timeout(timeout)
        deliver = self.on_stale is not None
        t0 = deadline = None
        while True:
            with self._lock:
                stale = self._purge_locked(current_version)
                if not (stale and deliver):
                    if len(self._heap) >= n or self._closed or timeout == 0:
                        return self._take_locked(n, current_version)
                    now = time.monotonic()
                    if t0 is None:
                        t0 = now
                        deadline = None if timeout is None else now + timeout
                    if deadline is not None and now >= deadline:
                        return self._take_locked(n, current_version)
                    self._getters += 1
                    try:
                        self._not_empty.wait(None if deadline is None else deadline - now)
                    finally:
                        self._getters -= 1
                        self._get_block_total += time.monotonic() - now
                    continue
            self._deliver_stale(stale)  # outside the lock; then look again

    async def aget_batch(self, n: int, *, current_version: int, timeout: float | None = None) -> list[Any]:
        """Coroutine :meth:`get_batch`; waits on the event loop, never in a thread. Cancellation loses nothing:
        items are taken only in the step that returns them."""
        n = check_int("n", n, minimum=1)
        current_version = check_int("current_version", current_version, minimum=0)
        timeout = check_timeout(timeout)
        loop = asyncio.get_running_loop()
        deliver = self.on_stale is not None
        t0 = loop.time()
        deadline = None if timeout is None else t0 + timeout
        while True:
            with self._lock:
                stale = self._purge_locked(current_version)
                if not (stale and deliver):
                    expired = deadline is not None and loop.time() >= deadline
                    if len(self._heap) >= n or self._closed or expired:
                        self._get_block_total += loop.time() - t0
                        return self._take_locked(n, current_version)
                    waiter = (loop, loop.create_future())
                    self._async_waiters.add(waiter)
            if stale and deliver:
                self._deliver_stale(stale)
                continue
            await self._await_waiter(waiter, deadline, loop)

    async def _await_waiter(self, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future], deadline, loop) -> bool:
        """Wait for ``waiter`` to be resolved; False on timeout. Always deregisters it."""
        fut = waiter[1]
        try:
            if deadline is None:
                await fut
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            done, _ = await asyncio.wait({fut}, timeout=remaining)
            return bool(done)
        finally:
            with self._lock:
                self._async_waiters.discard(waiter)
            if not fut.done():
                fut.cancel()

    def purge_stale(self, current_version: int) -> int:
        """Move every item stale at ``current_version`` out of the queue now (frees room). Returns how many."""
        current_version = check_int("current_version", current_version, minimum=0)
        with self._lock:
            stale = self._purge_locked(current_version)
        self._deliver_stale(stale)
        return len(stale)

    def drain_stale(self) -> list[tuple[Any, int]]:
        """Stale ``(item, version)`` pairs kept because no ``on_stale`` callback was given, oldest first."""
        with self._lock:
            out, self._stale_pending = self._stale_pending, []
            self._n_drained += len(out)
            return out

    # ------------------------------------------------------------------ lifecycle and introspection
    def close(self) -> None:
        """Refuse further puts and wake every waiter (threads and coroutines)."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
            self._wake_async_locked()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap)

    def stats(self) -> dict[str, Any]:
        """Counts and timings.

        ``put``, ``returned``, ``stale`` (ever found stale), ``stale_pending`` (awaiting :meth:`drain_stale`),
        ``drained``, ``queued``; ``ahead`` (returned items newer than the ``current_version`` they were taken at,
        ``max_ahead`` the largest such lead); ``age_histogram`` ``{age: count}`` of returned items at consumption,
        ``stale_age_histogram`` likewise for stale ones; ``wait_time_total_s`` / ``wait_time_mean_s``: time returned
        items spent queued (put to get); ``get_blocked_s`` / ``put_blocked_s``: time consumers / producers waited.
        Invariant: ``put == returned + stale + queued``.
        """
        with self._lock:
            return {
                "put": self._n_put,
                "returned": self._n_returned,
                "stale": self._n_stale,
                "stale_pending": len(self._stale_pending),
                "drained": self._n_drained,
                "ahead": self._n_ahead,
                "max_ahead": self._max_ahead,
                "queued": len(self._heap),
                "oldest_queued_version": self._heap[0][0] if self._heap else None,
                "age_histogram": dict(sorted(self._age_hist.items())),
                "stale_age_histogram": dict(sorted(self._stale_age_hist.items())),
                "wait_time_total_s": self._wait_total,
                "wait_time_mean_s": self._wait_total / self._n_returned if self._n_returned else 0.0,
                "get_blocked_s": self._get_block_total,
                "put_blocked_s": self._put_block_total,
                "closed": self._closed,
            }

    def state_dict(self) -> dict[str, Any]:
        """Queued items (oldest first) with their versions and queued seconds, stale-pending items, counters."""
        with self._lock:
            now = time.monotonic()
            return {
                "max_staleness": self.max_staleness,
                "items": [(item, version, now - t_put) for version, _, t_put, item in sorted(self._heap)],
                "stale_pending": list(self._stale_pending),
                "counters": {
                    "put": self._n_put,
                    "returned": self._n_returned,
                    "stale": self._n_stale,
                    "drained": self._n_drained,
                    "ahead": self._n_ahead,
                    "max_ahead": self._max_ahead,
                    "age_histogram": dict(self._age_hist),
                    "stale_age_histogram": dict(self._stale_age_hist),
                    "wait_time_total_s": self._wait_total,
                    "get_blocked_s": self._get_block_total,
                    "put_blocked_s": self._put_block_total,
                },
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore items and counters into this EMPTY queue (raises ``ValueError`` if it holds anything).

        The configuration (``max_staleness``, ``capacity``, ``on_stale``) is this queue's own; restored items may
        exceed ``capacity`` (later puts then wait until consumers make room). ``closed`` is not restored.
        """
        where = "StalenessQueue.load_state_dict"
        check_state_keys(f"{where}: state", state, ("items", "stale_pending", "counters"), ("max_staleness",))
        items = []
        for j, entry in enumerate(_entries(f"{where}: state['items']", state["items"], 3)):
            item, v, age = entry
            items.append((item, check_int(f"{where}: state['items'][{j}] version", v, minimum=0),
                          check_real(f"{where}: state['items'][{j}] age", age, finite=True)))
        stale_pending = [
            (item, check_int(f"{where}: state['stale_pending'][{j}] version", v, minimum=0))
            for j, (item, v) in enumerate(_entries(f"{where}: state['stale_pending']", state["stale_pending"], 2))
        ]
        c = check_state_keys(f"{where}: state['counters']", state["counters"], _COUNTERS, _COUNTERS_OPTIONAL)
        counts = {k: check_int(f"{where}: state['counters'][{k!r}]", c[k], minimum=0)
                  for k in ("put", "returned", "stale", "drained", "ahead", "max_ahead") if k in c}
        seconds = {k: check_real(f"{where}: state['counters'][{k!r}]", c[k], finite=True)
                   for k in ("wait_time_total_s", "get_blocked_s", "put_blocked_s")}
        hists = {k: _histogram(f"{where}: state['counters'][{k!r}]", c[k])
                 for k in ("age_histogram", "stale_age_histogram")}
        n_put, n_returned, n_stale = counts["put"], counts["returned"], counts["stale"]
        if n_put != n_returned + n_stale + len(items):
            raise ArgumentError(
                f"{where}: state['counters']: expected put == returned + stale + queued, got {n_put} != "
                f"{n_returned} + {n_stale} + {len(items)}"
            )
        with self._lock:
            if self._heap or self._stale_pending:
                raise ArgumentError(
                    f"{where}: expected an empty queue, this one holds {len(self._heap)} queued and "
                    f"{len(self._stale_pending)} stale-pending items (loading would lose them)"
                )
            now = time.monotonic()
            for item, version, age in items:
                heapq.heappush(self._heap, (version, next(self._seq), now - age, item))
            self._stale_pending = stale_pending
            self._reset_counters()
            self._n_put, self._n_returned, self._n_stale = n_put, n_returned, n_stale
            self._n_drained = counts["drained"]
            self._n_ahead = counts.get("ahead", 0)  # absent from checkpoints written before it was counted
            self._max_ahead = counts.get("max_ahead", 0)
            self._age_hist = Counter(hists["age_histogram"])
            self._stale_age_hist = Counter(hists["stale_age_histogram"])
            self._wait_total = seconds["wait_time_total_s"]
            self._get_block_total = seconds["get_blocked_s"]
            self._put_block_total = seconds["put_blocked_s"]
            self._notify_put_locked()


_COUNTERS = ("put", "returned", "stale", "drained", "age_histogram", "stale_age_histogram", "wait_time_total_s",
             "get_blocked_s", "put_blocked_s")
_COUNTERS_OPTIONAL = ("ahead", "max_ahead")  # absent from checkpoints written before items ahead were counted


def _entries(where: str, value: object, width: int) -> list[tuple]:
    """The ``(item, version[, age])`` tuples of a saved queue, each checked to hold ``width`` fields."""
    if not isinstance(value, (list, tuple)):
        raise ArgumentError(f"{where}: expected a list, got {type(value).__name__}")
    for j, entry in enumerate(value):
        if not isinstance(entry, (list, tuple)) or len(entry) != width:
            raise ArgumentError(f"{where}[{j}]: expected a {width}-tuple, got {entry!r:.80}")
    return list(value)


def _histogram(where: str, value: object) -> dict[int, int]:
    """A saved ``{age: count}`` histogram (ages may be negative: items ahead of the consumer; an age written as a
    decimal string, as a JSON round trip leaves it, is read back as the int)."""
    if not isinstance(value, dict):
        raise ArgumentError(f"{where}: expected a dict {{age: count}}, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        age = int(k) if isinstance(k, str) and k.lstrip("-").isdecimal() else check_int(f"{where} key", k)
        out[age] = check_int(f"{where}[{k!r}]", v, minimum=0)
    return out


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
