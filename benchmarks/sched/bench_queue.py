"""Per-item overhead of StalenessQueue put/get, side by side with the standard library's queue.Queue.

Run: .venv/bin/python benchmarks/sched/bench_queue.py [--items 200000]
Goal: < 20 us per item (put + get) for the single-threaded paths.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time

from rlblocks.sched import StalenessQueue


def best_of(fn, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    n, b = args.items, args.batch

    def sq_put_then_batches():
        q = StalenessQueue(max_staleness=2)
        for i in range(n):
            q.put(i, i % 3)  # three versions, all fresh at current_version 2 (the heap orders them)
        got = 0
        while got < n:
            got += len(q.get_batch(b, current_version=2, timeout=0))

    def sq_interleaved_single():
        q = StalenessQueue(max_staleness=2, capacity=16)
        for i in range(n):
            q.put(i, 0)
            q.get_batch(1, current_version=0, timeout=0)

    def stdlib_put_then_get():
        q = queue.Queue()
        for i in range(n):
            q.put(i)
        for _ in range(n):
            q.get_nowait()

    def stdlib_interleaved():
        q = queue.Queue(maxsize=16)
        for i in range(n):
            q.put(i)
            q.get_nowait()

    def sq_threads():
        q = StalenessQueue(max_staleness=1_000_000, capacity=1024)

        def producer():
            for i in range(n):
                q.put(i, 0)
            q.close()

        t = threading.Thread(target=producer)
        t.start()
        got = 0
        while True:
            items = q.get_batch(b, current_version=0, timeout=0.1)
            got += len(items)
            if not items and q.closed and len(q) == 0:
                break
        t.join()
        assert got == n

    def sq_async():
        async def run():
            q = StalenessQueue(max_staleness=2, capacity=1024)

            async def producer():
                for i in range(n):
                    await q.aput(i, 0)
                q.close()

            task = asyncio.create_task(producer())
            got = 0
            while True:
                items = await q.aget_batch(b, current_version=0)
                got += len(items)
                if not items:
                    break
            await task
            assert got == n

        asyncio.run(run())

    cases = [
        (f"StalenessQueue put x{n}, get_batch({b})", sq_put_then_batches),
        ("queue.Queue put, get_nowait (reference)", stdlib_put_then_get),
        ("StalenessQueue put + get_batch(1) interleaved", sq_interleaved_single),
        ("queue.Queue put + get_nowait interleaved (ref.)", stdlib_interleaved),
        (f"StalenessQueue 1 producer thread, get_batch({b})", sq_threads),
        (f"StalenessQueue aput / aget_batch({b}), one loop", sq_async),
    ]
    width = max(len(c[0]) for c in cases)
    print(f"{'case':<{width}}  us/item (put+get, best of 3)", flush=True)
    for name, fn in cases:
        t = best_of(fn, repeats=3)
        print(f"{name:<{width}}  {t / n * 1e6:7.2f}", flush=True)


if __name__ == "__main__":
    main()
