"""StalenessQueue: ordering, blocking, timeouts, close, callbacks, stats, checkpoints, threads and asyncio."""

from __future__ import annotations

import asyncio
import pickle
import random
import threading
import time

import pytest

from rlblocks.errors import QueueClosed, QueueFull
from rlblocks.sched import StalenessQueue


def test_oldest_first_by_version_then_arrival():
    q = StalenessQueue(max_staleness=10)
    entries = [("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 1)]
    for item, v in entries:
        q.put(item, v)
    expected = [item for item, _ in sorted(entries, key=lambda e: (e[1], entries.index(e)))]
    assert q.get_batch(3, current_version=3, timeout=0) + q.get_batch(9, current_version=3, timeout=0) == expected


def test_stale_items_go_to_drain_and_are_counted():
    q = StalenessQueue(max_staleness=1)
    for v in (0, 1, 2, 3, 0):
        q.put(f"v{v}", v)
    assert q.get_batch(10, current_version=3, timeout=0) == ["v2", "v3"]
    assert q.drain_stale() == [("v0", 0), ("v0", 0), ("v1", 1)]
    s = q.stats()
    assert (s["put"], s["returned"], s["stale"], s["drained"], s["queued"]) == (5, 2, 3, 3, 0)
    assert s["age_histogram"] == {0: 1, 1: 1} and s["stale_age_histogram"] == {2: 1, 3: 2}


def test_on_stale_callback_and_failure_loses_nothing():
    seen = []

    def cb(item, version):
        if item == "boom":
            raise RuntimeError("callback failed")
        seen.append((item, version))

    q = StalenessQueue(max_staleness=0, on_stale=cb)
    for item, v in [("x", 0), ("boom", 0), ("y", 0), ("fresh", 2)]:
        q.put(item, v)
    with pytest.raises(RuntimeError, match="callback failed"):
        q.get_batch(1, current_version=2, timeout=0)
    assert seen == [("x", 0)]
    assert q.drain_stale() == [("boom", 0), ("y", 0)]  # undelivered stale items are kept ...
    s = q.stats()
    assert (s["put"], s["returned"], s["stale"], s["queued"]) == (4, 0, 3, 1)  # ... and nothing was taken
    assert q.get_batch(1, current_version=2, timeout=0) == ["fresh"]


def test_get_batch_waits_for_n_or_timeout():
    q = StalenessQueue(max_staleness=0)
    q.put("early", 0)
    timer = threading.Timer(0.05, lambda: [q.put(i, 0) for i in range(2)])
    timer.start()
    assert q.get_batch(3, current_version=0, timeout=10) == ["early", 0, 1]
    timer.join()
    q.put("only", 0)
    assert q.get_batch(5, current_version=0, timeout=0.02) == ["only"]
    assert q.get_batch(5, current_version=0, timeout=0) == []


def test_full_queue_blocks_or_raises_never_drops():
    q = StalenessQueue(max_staleness=0, capacity=2)
    q.put("a", 0)
    q.put("b", 0)
    with pytest.raises(QueueFull):
        q.put("c", 0, block=False)
    with pytest.raises(QueueFull):
        q.put("c", 0, timeout=0.01)
    done = threading.Event()

    def producer():
        q.put("c", 0)  # blocks until a consumer makes room
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    assert not done.wait(0.05)
    assert q.get_batch(1, current_version=0, timeout=0) == ["a"]
    t.join(5)
    assert done.is_set()
    assert q.get_batch(5, current_version=0, timeout=0) == ["b", "c"]
    assert q.stats()["put"] == 3


def test_close_wakes_waiters():
    q = StalenessQueue(max_staleness=0, capacity=1)
    q.put("a", 0)
    q2 = StalenessQueue(max_staleness=0)
    q2.put("x", 0)
    results = {}

    def getter():
        results["get"] = q2.get_batch(4, current_version=0)  # wants 4, has 1, no timeout: only close() ends it

    def putter():
        try:
            q.put("b", 0)
        except QueueClosed as e:
            results["put"] = e

    threads = [threading.Thread(target=getter), threading.Thread(target=putter)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    q.close()
    q2.close()
    for t in threads:
        t.join(5)
    assert results["get"] == ["x"] and isinstance(results["put"], QueueClosed)
    with pytest.raises(QueueClosed):
        q.put("c", 0)
    assert q.get_batch(3, current_version=0) == ["a"]  # a closed queue still hands out what it holds


def test_state_dict_round_trip():
    q = StalenessQueue(max_staleness=1)
    for i, v in enumerate([2, 0, 1, 2, 3]):
        q.put({"id": i}, v)
    assert q.get_batch(1, current_version=2, timeout=0) == [{"id": 2}]
    state = pickle.loads(pickle.dumps(q.state_dict()))
    q2 = StalenessQueue(max_staleness=1)
    q2.load_state_dict(state)
    s1, s2 = q.stats(), q2.stats()
    for key in ("put", "returned", "stale", "stale_pending", "queued", "age_histogram"):
        assert s1[key] == s2[key]
    assert q2.drain_stale() == q.drain_stale() == [({"id": 1}, 0)]
    assert q2.get_batch(9, current_version=3, timeout=0) == q.get_batch(9, current_version=3, timeout=0)
    with pytest.raises(ValueError, match="empty queue"):
        q3 = StalenessQueue(max_staleness=1)
        q3.put("x", 0)
        q3.load_state_dict(state)
    with pytest.raises(ValueError, match="counters"):
        StalenessQueue(max_staleness=1).load_state_dict({**state, "counters": {**state["counters"], "put": 99}})


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessQueue(max_staleness=-1)
    with pytest.raises(ValueError, match="capacity"):
        StalenessQueue(max_staleness=0, capacity=0)
    q = StalenessQueue(max_staleness=0)
    with pytest.raises(ValueError, match="n"):
        q.get_batch(0, current_version=0)
    with pytest.raises(ValueError, match="current_version"):
        q.get_batch(1, current_version=-1)
    with pytest.raises(ValueError, match="version"):
        q.put("x", -2)
    with pytest.raises(ValueError, match="timeout"):
        q.get_batch(1, current_version=0, timeout=-1)


def test_threads_four_producers_two_consumers():
    """10^4 items; versions advance while producing. No loss, no duplicates, and the staleness bound holds."""
    eta, n_items, n_prod = 2, 10_000, 4
    version = [0]
    version_lock = threading.Lock()
    stale: list[tuple[int, int]] = []
    stale_lock = threading.Lock()

    def on_stale(item, v):
        with stale_lock:
            stale.append(item)

    q = StalenessQueue(max_staleness=eta, capacity=256, on_stale=on_stale)
    got: list[list[tuple[int, int]]] = [[], []]
    born = [-1] * n_items  # version each item was put with, written by its producer

    def producer(p):
        rng = random.Random(p)
        for i in range(p, n_items, n_prod):
            with version_lock:
                v = version[0]
            born[i] = max(0, v - rng.randint(0, 3))  # some items are born old
            q.put(i, born[i])

    def consumer(c):
        rng = random.Random(100 + c)
        while True:
            with version_lock:
                if rng.random() < 0.3:
                    version[0] += 1
                cur = version[0]
            items = q.get_batch(rng.randint(1, 64), current_version=cur, timeout=0.01)
            got[c].extend((i, cur) for i in items)
            if not items and q.closed and len(q) == 0:
                return

    producers = [threading.Thread(target=producer, args=(p,)) for p in range(n_prod)]
    consumers = [threading.Thread(target=consumer, args=(c,)) for c in range(2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(60)
    q.close()
    for t in consumers:
        t.join(60)
    assert not any(t.is_alive() for t in producers + consumers)
    returned = [i for g in got for i, _ in g]
    assert len(returned) == len(set(returned)) and len(stale) == len(set(stale))
    assert sorted(returned + stale) == list(range(n_items))
    assert len(returned) > 0 and len(stale) > 0
    s = q.stats()
    assert s["put"] == n_items and s["returned"] == len(returned) and s["stale"] == len(stale)
    assert max(s["age_histogram"]) <= eta and min(s["stale_age_histogram"]) > eta
    # Age at consumption, from the versions recorded here (an item may be newer than a consumer's version: a
    # producer can read a version bumped by the other consumer).
    assert all(cur - born[i] <= eta for g in got for i, cur in g)


def test_async_get_put_and_cancellation_loses_nothing():
    async def main():
        q = StalenessQueue(max_staleness=1, capacity=3)
        # aget_batch waits without blocking the loop
        waiter = asyncio.create_task(q.aget_batch(2, current_version=0, timeout=5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await q.aput("a", 0)
        await q.aput("b", 0)
        assert await waiter == ["a", "b"]
        # a cancelled waiter takes nothing
        waiter = asyncio.create_task(q.aget_batch(5, current_version=0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        for i in range(3):
            await q.aput(i, 0)
        # aput waits for room while full, then proceeds when a consumer takes
        blocked = asyncio.create_task(q.aput("late", 1))
        await asyncio.sleep(0.01)
        assert not blocked.done() and len(q) == 3
        with pytest.raises(QueueFull):
            await q.aput("x", 0, timeout=0.01)
        assert await q.aget_batch(1, current_version=0) == [0]
        await asyncio.wait_for(blocked, 5)
        assert await q.aget_batch(9, current_version=1, timeout=0) == [1, 2, "late"]
        # an item put from another thread wakes an async waiter; timeout returns what there is
        waiter = asyncio.create_task(q.aget_batch(1, current_version=1, timeout=5))
        threading.Timer(0.02, lambda: q.put("from-thread", 1)).start()
        assert await waiter == ["from-thread"]
        assert await q.aget_batch(4, current_version=1, timeout=0.01) == []
        q.close()
        with pytest.raises(QueueClosed):
            await q.aput("y", 1)
        s = q.stats()
        assert s["put"] == 7 and s["returned"] == 7

    asyncio.run(main())


def test_async_with_on_stale_callback():
    async def main():
        seen = []
        q = StalenessQueue(max_staleness=0, on_stale=lambda item, v: seen.append((item, v)))
        await q.aput("old", 0)
        waiter = asyncio.create_task(q.aget_batch(1, current_version=1, timeout=5))
        await asyncio.sleep(0.01)
        assert seen == [("old", 0)] and not waiter.done()
        await q.aput("new", 1)
        assert await waiter == ["new"]
        assert q.stats()["stale"] == 1 and q.drain_stale() == []

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- regressions
def test_item_ahead_of_current_version_is_counted_or_refused():
    q = StalenessQueue(max_staleness=1)
    q.put("now", 3)
    q.put("future", 5)
    assert q.get_batch(2, current_version=3, timeout=0) == ["now", "future"]  # fresh, returned ...
    s = q.stats()
    assert (s["ahead"], s["max_ahead"]) == (1, 2) and s["age_histogram"] == {-2: 1, 0: 1}  # ... and reported
    state = pickle.loads(pickle.dumps(q.state_dict()))
    q2 = StalenessQueue(max_staleness=1)
    q2.load_state_dict(state)
    assert (q2.stats()["ahead"], q2.stats()["max_ahead"]) == (1, 2)
    strict = StalenessQueue(max_staleness=1, on_ahead="raise")
    strict.put("now", 3)
    strict.put("future", 5)
    assert strict.get_batch(1, current_version=3, timeout=0) == ["now"]  # the oldest item is not ahead
    with pytest.raises(ValueError, match=r"current_version.*version 5"):
        strict.get_batch(1, current_version=3, timeout=0)
    assert len(strict) == 1 and strict.stats()["returned"] == 1  # nothing was taken
    assert strict.get_batch(1, current_version=5, timeout=0) == ["future"]
    with pytest.raises(ValueError, match="on_ahead"):
        StalenessQueue(max_staleness=0, on_ahead="ignore")


def test_infinite_timeout_means_no_limit():
    import math

    q = StalenessQueue(max_staleness=0, capacity=1)
    threading.Timer(0.05, lambda: q.put("x", 0)).start()
    assert q.get_batch(1, current_version=0, timeout=math.inf) == ["x"]
    q.put("y", 0)
    threading.Timer(0.05, lambda: q.get_batch(1, current_version=0, timeout=0)).start()
    q.put("z", 0, timeout=math.inf)  # waits for room instead of raising OverflowError

    async def main():
        asyncio.get_running_loop().call_later(0.05, lambda: q.close())
        return await q.aget_batch(2, current_version=0, timeout=math.inf)

    assert asyncio.run(main()) == ["z"]
    with pytest.raises(ValueError, match="timeout"):
        q.get_batch(1, current_version=0, timeout=float("nan"))
