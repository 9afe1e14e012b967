"""RewardPool: order kept, concurrency bound held, every sample accounted for, timeouts and crashes as results."""

import asyncio
import os
import random
import sys
from pathlib import Path

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.reward import RewardPool, RewardResult, Sample

sys.path.insert(0, str(Path(__file__).parent))
import reward_helpers


class Recorder:
    """An async reward whose behaviour per sample is drawn from a seeded RNG; it records concurrency."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        kinds = ["ok"] * 70 + ["raise"] * 8 + ["hang"] * 5 + ["error_result"] * 5 + ["invalid"] * 4 + ["flaky"] * 8
        self.kind = [rng.choice(kinds) for _ in range(n)]
        self.latency = [rng.uniform(0.0, 0.003) for _ in range(n)]
        self.active = 0
        self.max_active = 0
        self.calls = [0] * n

    async def __call__(self, sample: Sample) -> RewardResult:
        i = sample.metadata["i"]
        self.calls[i] += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.latency[i])
            k = self.kind[i]
            if k == "hang":
                await asyncio.sleep(3600)
            if k == "raise" or (k == "flaky" and self.calls[i] == 1):
                raise ConnectionError(f"lost {i}")
            if k == "error_result":
                return RewardResult.failure(f"bad reference {i}")
            if k == "invalid":
                return {"score": i}
            return RewardResult(float(i), {"twice": 2.0 * i})
        finally:
            self.active -= 1


def test_1000_random_latencies_and_failures():
    n, bound = 1000, 32
    fn = Recorder(n, seed=1234)
    # ok calls take at most 3 ms; the timeout only has to tell them from a hang, with room for a busy machine to
    # stall this event loop (a spurious timeout would show as a retry of an ok sample)
    pool = RewardPool(fn, max_concurrency=bound, timeout=0.5, retries=1, cancel_grace=1.0)
    samples = [Sample(f"r{i}", metadata={"i": i}) for i in range(n)]
    results = asyncio.run(pool.ascore(samples))

    assert len(results) == n
    assert fn.max_active <= bound  # the bound held ...
    assert fn.max_active == bound  # ... and was reached, so the check above means something
    assert fn.active == 0  # every hung call was cancelled, none is left running
    kinds = fn.kind
    for i, (k, r) in enumerate(zip(kinds, results)):
        if k in ("ok", "flaky"):  # flaky fails once, then the retry succeeds
            assert r.ok and r.score == float(i) and r.components == {"twice": 2.0 * i}, (i, k, r)
            assert r.details["attempts"] == (2 if k == "flaky" else 1)
        else:
            assert not r.ok and r.score is None, (i, k, r)
            want = {"raise": "ConnectionError: lost", "hang": "RewardTimeout", "error_result": "bad reference",
                    "invalid": "expected a RewardResult or a real number"}[k]
            assert want in r.error, (i, k, r.error)
            assert r.details["attempts"] == (1 if k == "error_result" else 2)  # returned errors are final
        assert r.seconds >= 0
    count = {k: kinds.count(k) for k in set(kinds)}
    s = pool.stats()
    assert s["submitted"] == s["completed"] == n and s["pending"] == 0 and s["cancelled"] == 0
    assert s["ok"] == count["ok"] + count["flaky"]
    assert s["failed"] == n - s["ok"] == count["raise"] + count["hang"] + count["error_result"] + count["invalid"]
    assert s["timeouts"] == 2 * count["hang"]
    assert s["exceptions"] == 2 * count["raise"] + count["flaky"]
    assert s["invalid"] == 2 * count["invalid"] and s["returned_errors"] == count["error_result"]
    assert s["retries"] == count["hang"] + count["raise"] + count["invalid"] + count["flaky"]
    assert s["attempts"] == n + s["retries"] == sum(fn.calls)
    assert s["in_flight"] == 0 and s["max_in_flight"] == bound and s["abandoned"] == 0
    assert s["crashes"] == 0


def test_a_reward_that_ignores_cancellation_is_abandoned_not_awaited():
    class Stubborn:
        async def __call__(self, sample):
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue  # refuses to stop

    async def main():
        pool = RewardPool(Stubborn(), max_concurrency=2, timeout=0.05, cancel_grace=0.05)
        return await asyncio.wait_for(pool.ascore([Sample("a"), Sample("b")]), 5), pool

    (results, pool) = asyncio.new_event_loop().run_until_complete(main())
    assert [r.error.startswith("RewardTimeout") for r in results] == [True, True]
    assert pool.stats()["abandoned"] == 2 and pool.stats()["completed"] == 2


def test_cancelled_score_is_counted_and_nothing_stays_in_flight():
    async def slow(sample):
        await asyncio.sleep(10)
        return 1.0

    pool = RewardPool(slow, max_concurrency=3, timeout=60)

    async def main():
        task = asyncio.ensure_future(pool.ascore([Sample(str(i)) for i in range(7)]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    s = pool.stats()
    assert s["submitted"] == 7 and s["cancelled"] == 7 and s["completed"] == 0 and s["pending"] == 0
    assert s["in_flight"] == 0


def test_blocking_score_works_across_event_loops_and_pool_is_a_reward():
    async def double(sample):
        return 2.0 * sample.metadata["i"]

    pool = RewardPool(double, max_concurrency=4, timeout=5)
    for _ in range(2):  # each score() runs its own event loop
        assert [r.score for r in pool.score([Sample("x", metadata={"i": i}) for i in range(10)])] == [
            2.0 * i for i in range(10)]
    outer = RewardPool(pool, max_concurrency=2, timeout=5)  # a pool is an async reward itself
    assert asyncio.run(outer(Sample("y", metadata={"i": 21}))).score == 42.0
    assert pool.stats()["completed"] == 21


def test_process_pool_kills_hangs_survives_crashes_and_keeps_order():
    modes = ["ok", "hang", "ok", "crash", "result", "raise", "segv", "ok", "error_result", "invalid", "print", "ok",
             "memory", "ok"]
    samples = [Sample("x", metadata={"i": i, "mode": m}) for i, m in enumerate(modes)]
    with RewardPool(reward_helpers.behave, max_concurrency=3, timeout=2.0, processes=2,
                    memory_bytes=2 << 30) as pool:
        results = pool.score(samples)
        stats = pool.stats()
        workers = pool._workers.stats()
    assert len(results) == len(modes)
    for i, (m, r) in enumerate(zip(modes, results)):
        if m in ("ok", "print", "result"):
            assert r.ok and r.score == float(i), (m, r)
        else:
            assert not r.ok and r.score is None, (m, r)
    by_mode = dict(zip(modes, results))
    assert by_mode["result"].components == {"half": 2.0} and "pid" in by_mode["result"].details
    assert "RewardTimeout" in by_mode["hang"].error and "killed" in by_mode["hang"].error
    assert "WorkerCrashed" in by_mode["crash"].error and "exit status 3" in by_mode["crash"].error
    assert "SIGSEGV" in by_mode["segv"].error
    assert "ValueError: bad sample 5" in by_mode["raise"].error
    assert "MemoryError" in by_mode["memory"].error
    assert by_mode["error_result"].error == "verifier says no to 8"
    assert "expected a RewardResult" in by_mode["invalid"].error
    assert stats["timeouts"] == 1 and stats["crashes"] == 2 and stats["exceptions"] == 2 and stats["invalid"] == 1
    assert stats["completed"] == len(modes) and stats["max_in_flight"] <= 3
    # killed workers are replaced when their thread takes the next call: the ok calls after each kill passed
    assert workers["started"] >= 4 and workers["timeouts"] == 1 and workers["crashes"] == 2
    assert 1 <= workers["alive"] <= 2  # never more workers than processes=2
    assert pool._workers.stats()["alive"] == 0  # closed by the with block: the worker processes are gone
    pid = by_mode["result"].details["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_process_pool_timeout_counts_from_the_start_not_the_queue():
    # 8 calls of 0.4 s on ONE worker: the last waits ~2.8 s in the queue, more than the 2 s timeout, yet passes
    # (each call itself has 1.6 s to spare for a busy machine).
    samples = [Sample("x", metadata={"i": i, "mode": "ok", "sleep": 0.4}) for i in range(8)]
    with RewardPool(reward_helpers.behave, max_concurrency=8, timeout=2.0, processes=1) as pool:
        results = pool.score(samples)
    assert [r.score for r in results] == [float(i) for i in range(8)]


@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_concurrency": 0}, "max_concurrency"), ({"timeout": float("inf")}, "timeout"), ({"timeout": 0}, "timeout"),
     ({"retries": -1}, "retries"), ({"retries": True}, "retries"), ({"processes": 2}, "processes")],
)
def test_bad_arguments_name_themselves(kwargs, match):
    async def fn(sample):
        return 1.0

    with pytest.raises(ArgumentError, match=match):
        RewardPool(fn, **kwargs)


def test_bad_samples_and_fns():
    async def fn(sample):
        return 1.0

    with pytest.raises(ArgumentError, match=r"samples\[1\]"):
        asyncio.run(RewardPool(fn).ascore([Sample("a"), "b"]))
    with pytest.raises(ArgumentError, match="fn"):
        RewardPool(3)
    with pytest.raises(ArgumentError, match="module level"):
        RewardPool(lambda s: 1.0, processes=1)  # a worker process could not import a lambda by name

    def local(sample):
        return 1.0

    with pytest.raises(ArgumentError, match="module level"):
        RewardPool(local)
    local.__module__, local.__qualname__ = "__main__", "local"  # as if defined in the caller's script
    with pytest.raises(ArgumentError, match=r"__main__\.local"):
        RewardPool(local)
    with RewardPool(reward_helpers.behave, processes=1) as p:  # an unpicklable argument is refused at once
        with pytest.raises(ArgumentError, match="fn/args"):
            asyncio.run(p._workers.arun(reward_helpers.behave, lambda: 0, timeout=1))


def test_result_invariants():
    with pytest.raises(ArgumentError, match="score"):
        RewardResult(None)
    with pytest.raises(ArgumentError, match="score"):
        RewardResult(float("nan"))
    with pytest.raises(ArgumentError, match="score"):
        RewardResult(1.0, error="boom")
    with pytest.raises(ArgumentError, match="components"):
        RewardResult(1.0, {"a": float("inf")})
    with pytest.raises(ArgumentError, match="response_len"):
        Sample("x", response_len=-1)
    with pytest.raises(ArgumentError, match="response"):
        Sample(b"x")
    r = RewardResult.failure("why", seconds=0.5)
    assert not r.ok and r.score is None and r.seconds == 0.5


def test_a_worker_that_cannot_start_is_a_crash_result():
    from rlblocks.errors import WorkerCrashed
    from rlblocks.reward import ProcessWorkers

    with ProcessWorkers(1, preload=("no_such_module_for_rlblocks_tests",)) as w:
        with pytest.raises(WorkerCrashed, match="no_such_module_for_rlblocks_tests"):
            w.run(reward_helpers.behave, Sample("x", metadata={"i": 0, "mode": "ok"}), timeout=5)
        assert w.stats()["crashes"] == 1 and w.stats()["alive"] == 0
