"""Reward workers that die: a worker killed mid-call (by pid) or hung is replaced and its call retried under a
bounded RetryPolicy; when the retries run out the sample gets a recorded error and its group fails whole (counted),
never a silent 0; a code test that runs out of wall time says "timeout" through the pool."""

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.reward import CodeReward, GroupResult, RetryPolicy, RewardPool, RewardResult, Sample
from rlblocks.sandbox import SandboxLimits, isolation_support

sys.path.insert(0, str(Path(__file__).parent))
import reward_helpers


def _sample(tmp_path, how: str, i: int = 5) -> Sample:
    return Sample("x", metadata={"i": i, "how": how, "marker": str(tmp_path / f"first-{i}")})


def test_a_worker_killed_mid_call_is_replaced_and_the_call_retried(tmp_path):
    s = _sample(tmp_path, "killed")
    with RewardPool(reward_helpers.first_attempt_dies, timeout=120, retries=RetryPolicy(max_retries=2),
                    processes=1) as pool:

        async def main():
            task = asyncio.ensure_future(pool.ascore([s]))
            marker = Path(s.metadata["marker"])
            for _ in range(60000):  # until the worker has taken the call (an event: its pid file); a hang guard
                if marker.exists():
                    break
                await asyncio.sleep(0.005)
            os.kill(int(marker.read_text()), signal.SIGKILL)
            return await task

        (r,) = asyncio.run(main())
        st, workers = pool.stats(), pool._workers.stats()
    assert r.ok and r.score == 5.0 and r.details["attempts"] == 2
    assert st["crashes"] == 1 and st["retries"] == 1 and st["ok"] == 1 and st["failed"] == 0
    assert workers["started"] == 2 and workers["crashes"] == 1  # the dead worker was replaced


def test_a_hung_worker_is_killed_at_the_timeout_and_the_call_retried(tmp_path):
    with RewardPool(reward_helpers.first_attempt_dies, timeout=1.0, retries=1, processes=1) as pool:
        (r,) = pool.score([_sample(tmp_path, "hang")])
        st = pool.stats()
    assert r.ok and r.score == 5.0 and r.details["attempts"] == 2
    assert st["timeouts"] == 1 and st["retries"] == 1


def test_retries_run_out_the_sample_records_why_and_its_group_fails_whole(tmp_path):
    ok = [Sample("a", metadata={"i": i, "mode": "ok"}) for i in range(3)]
    dies = Sample("b", metadata={"i": 9, "mode": "crash"})  # crashes on every attempt
    with RewardPool(reward_helpers.behave, timeout=30, retries=RetryPolicy(max_retries=1), processes=2) as pool:
        groups = asyncio.run(pool.ascore_groups([ok[:2], [ok[2], dies], [ok[0]]]))
        st = pool.stats()
    assert [g.ok for g in groups] == [True, False, True]
    assert groups[0].scores == [0.0, 1.0] and groups[2].scores == [0.0]
    bad = groups[1]
    assert bad.scores is None  # no score for any sample of the group: its baseline would be biased
    assert bad.results[0].ok and bad.results[0].score == 2.0  # the other sample's own result is kept
    r = bad.results[1]
    assert not r.ok and r.score is None and r.details["failure"] == "crashes" and r.details["attempts"] == 2
    assert "WorkerCrashed" in r.error and "attempt 2 of at most 2" in r.error
    assert bad.error.startswith("sample 1 of 2 failed (1 in all): WorkerCrashed")
    assert st["groups"] == 3 and st["groups_failed"] == 1 and st["samples_in_failed_groups"] == 2
    assert st["crashes"] == 2 and st["failed"] == 1 and st["submitted"] == st["completed"] == 5


def test_a_retry_policy_retries_only_its_kinds_with_growing_delays():
    pol = RetryPolicy(max_retries=3, delay=0.5, backoff=2.0, max_delay=1.5, retry_on=("timeouts", "crashes"))
    assert [pol.wait_before(k) for k in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert pol.retries("crashes") and not pol.retries("exceptions")
    with RewardPool(reward_helpers.behave, timeout=30, retries=pol, processes=1) as pool:
        (r,) = pool.score([Sample("x", metadata={"i": 1, "mode": "raise"})])  # an exception: not retried
    assert not r.ok and r.details == {"failure": "exceptions", "attempts": 1} and "ValueError: bad sample 1" in r.error
    for bad, match in (({"max_retries": -1}, "max_retries"), ({"backoff": 0.5}, "backoff"),
                       ({"retry_on": ("oops",)}, "retry_on"), ({"delay": float("inf")}, "delay")):
        with pytest.raises(ArgumentError, match=match):
            RetryPolicy(**bad)
    with pytest.raises(ArgumentError, match="retries"):
        RewardPool(reward_helpers.behave, retries=1.5, processes=1)
    assert GroupResult.of([RewardResult(1.0), RewardResult.failure("no")]).error == \
        "sample 1 of 2 failed (1 in all): no"


ISO = "strict" if isolation_support()["available"] else "weak"


def test_a_code_test_out_of_wall_time_says_timeout_through_the_pool():
    code = CodeReward(SandboxLimits(cpu_seconds=5, wall_seconds=1, isolation=ISO))
    sample = Sample("import time; time.sleep(60)", [{"input": "", "output": ""}])
    with RewardPool(code, timeout=30, retries=RetryPolicy(max_retries=2)) as pool:
        (r,) = pool.score([sample])
        st = pool.stats()
    # the sandbox's wall clock stopped the program: the reward's verdict, not retried, and a timeout (not a
    # wrong answer) in the result
    assert r.ok and r.score == 0.0 and r.details["attempts"] == 1
    assert r.details["tests"][0]["status"] == "timeout" and "wall" in r.details["tests"][0]["reason"]
    assert st["timeouts"] == 0 and st["retries"] == 0
    # the pool's own timeout shorter than the sandbox's: the call is cancelled, and the sample is an error that
    # says so, never a score
    slow = CodeReward(SandboxLimits(cpu_seconds=5, wall_seconds=20, isolation=ISO))
    t0 = time.perf_counter()
    with RewardPool(slow, timeout=1.0, retries=0) as pool:
        (r,) = pool.score([sample])
    assert not r.ok and r.score is None and r.details["failure"] == "timeouts" and "RewardTimeout" in r.error
    assert time.perf_counter() - t0 < 15  # the sandboxed program was stopped with the call, not waited for
