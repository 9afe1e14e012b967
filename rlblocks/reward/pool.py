"""Run a reward over many samples concurrently, bounded, in input order, and account for every sample.

Rewards are computed off the training loop's critical path with a bound on the work in flight (as AReaL's reward
service and OpenRLHF's asynchronous verifier pools do). :class:`RewardPool` takes either

- an ``async`` reward (:class:`~rlblocks.reward.RewardFn`: I/O-bound, a remote reward model, the sandboxed
  ``code_reward``, ``math_reward`` which has its own worker processes): run as asyncio tasks on the caller's loop;
  the timeout cancels the call; or
- a plain (synchronous) function ``fn(sample) -> RewardResult | float``, CPU-bound: run in killable worker
  processes (:class:`~rlblocks.reward.workers.ProcessWorkers`); the timeout kills the worker. A thread is never
  used for it, since a thread cannot be stopped at a timeout.

Guarantees:

- ``await pool.ascore(samples)`` returns one :class:`~rlblocks.reward.RewardResult` per sample, in input order.
- At most ``max_concurrency`` calls are in flight at once (per event loop), across all ``ascore`` calls of the pool.
- A timeout, an exception, a crashed worker or an invalid return value is retried under the pool's
  :class:`~rlblocks.reward.RetryPolicy` (bounded; a crashed or timed-out worker process is replaced by a fresh
  one for the retry), then becomes an error result (``score=None``, ``error`` says why, ``details["failure"]``
  its kind); a failure the reward *returned* (``error`` set) is final, not retried (it is the reward's verdict,
  e.g. an unparsable reference; a code test that ran out of wall time stays ``"timeout"`` in its details). No
  sample is lost and none can stall the batch: an async reward that ignores cancellation is abandoned after
  ``cancel_grace`` seconds (counted).
- :meth:`RewardPool.ascore_groups` scores groups (the responses to one prompt) and fails a group whole when any
  of its samples failed (:class:`~rlblocks.reward.GroupResult`), so a group baseline is never computed over a
  partial group nor with a failed sample read as 0.
- ``stats()`` counts everything: ``submitted == completed + cancelled + pending``, ``completed == ok + failed``.

``seconds``: the pool's wall time for the sample (retries included, waiting for a slot excluded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from rlblocks._checks import check_int, check_seconds
from rlblocks.errors import ArgumentError, RewardTimeout, WorkerCrashed, WorkerError
from rlblocks.reward.retry import RetryPolicy
from rlblocks.reward.types import GroupResult, RewardResult, Sample
from rlblocks.reward.workers import ProcessWorkers, check_importable

__all__ = ["RewardPool"]


def is_async_reward(fn: object) -> bool:
    """True for an ``async def`` function, a partial of one, or an object with an ``async def __call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    try:
        call = type(fn).__call__
    except AttributeError:
        return False
    return inspect.iscoroutinefunction(call)


def as_result(value: object) -> RewardResult:
    """A reward's return value as a :class:`RewardResult`: results pass through, a real number (numpy scalars
    included, not a bool) becomes its score."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        return RewardResult(score=float(value))
    raise ArgumentError(f"reward: expected a RewardResult or a real number, got {type(value).__name__} {value!r}")


def _retrieve(task: asyncio.Future) -> None:
    # An abandoned task's eventual exception is collected so asyncio does not log "exception never retrieved".
    if not task.cancelled():
        task.exception()


class _Failure:
    __slots__ = ("kind", "text")

    def __init__(self, kind: str, text: str) -> None:
        self.kind = kind
        self.text = text


class RewardPool:
    """A bounded, order-keeping, failure-counting runner of one reward.

    Args:
        fn: an async :class:`~rlblocks.reward.RewardFn`, or a synchronous, picklable ``fn(sample)`` returning a
            :class:`~rlblocks.reward.RewardResult` or a number (run in worker processes).
        max_concurrency: most calls in flight at once.
        timeout: seconds one attempt may take (async: from the call; processes: from the moment a worker starts
            it). Finite: a reward can never stall the loop.
        retries: extra attempts after a timeout, an exception, a crash or an invalid return value: an int ``n``
            (``RetryPolicy(max_retries=n)``, at once) or a :class:`~rlblocks.reward.RetryPolicy` (which kinds,
            delays with back-off).
        processes: worker processes for a synchronous ``fn`` (default ``min(max_concurrency, os.cpu_count())``);
            refused for an async ``fn``.
        memory_bytes: ``RLIMIT_AS`` of each worker process (synchronous ``fn`` only).
        cancel_grace: seconds a timed-out async call gets to finish its cancellation before it is abandoned.

    Use ``await pool.ascore(samples)`` in a loop, ``pool.score(samples)`` outside one, ``await pool(sample)`` (the
    pool is itself a RewardFn). ``close()`` stops the pool's worker processes (idempotent; ``with`` works).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        max_concurrency: int = 16,
        timeout: float = 60.0,
        retries: int | RetryPolicy = 0,
        *,
        processes: int | None = None,
        memory_bytes: int | None = None,
        cancel_grace: float = 1.0,
    ) -> None:
        if not callable(fn):
            raise ArgumentError(f"fn: expected a reward function, got {type(fn).__name__}")
        self.fn = fn
        self.max_concurrency = check_int("max_concurrency", max_concurrency, minimum=1)
        self.timeout = check_seconds("timeout", timeout)
        self.retry = retries if isinstance(retries, RetryPolicy) else RetryPolicy(
            max_retries=check_int("retries", retries, minimum=0, what="an int >= 0 or a RetryPolicy"))
        self.cancel_grace = check_seconds("cancel_grace", cancel_grace, allow_zero=True)
        self.is_async = is_async_reward(fn)
        self._workers: ProcessWorkers | None = None
        if self.is_async:
            if processes is not None or memory_bytes is not None:
                raise ArgumentError(
                    "processes: expected None for an async reward (it runs on the event loop; give a synchronous "
                    f"function to run in worker processes), got processes={processes!r}, memory_bytes={memory_bytes!r}"
                )
        else:
            check_importable(fn)  # fail at construction, not once per sample
            n = min(self.max_concurrency, os.cpu_count() or 1) if processes is None else processes
            self._workers = ProcessWorkers(check_int("processes", n, minimum=1), memory_bytes=memory_bytes)
        self._lock = threading.Lock()
        self._sems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._in_flight = 0
        self._counts: dict[str, Any] = dict.fromkeys(
            ("submitted", "completed", "ok", "failed", "cancelled", "attempts", "retries", "timeouts", "exceptions",
             "crashes", "invalid", "returned_errors", "abandoned", "max_in_flight", "groups", "groups_failed",
             "samples_in_failed_groups"), 0)
        self._counts["seconds"] = 0.0

    # ------------------------------------------------------------------ public
    async def ascore(self, samples: Iterable[Sample]) -> list[RewardResult]:
        """One result per sample, in input order (see the class docstring for the guarantees)."""
        if isinstance(samples, (Sample, str, bytes)):
            raise ArgumentError(f"samples: expected an iterable of Sample, got one {type(samples).__name__} (wrap it "
                                "in a list, or await pool(sample))")
        try:
            samples = list(samples)
        except TypeError:
            raise ArgumentError(f"samples: expected an iterable of Sample, got {type(samples).__name__}") from None
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise ArgumentError(f"samples[{i}]: expected a rlblocks.reward.Sample, got {type(s).__name__}")
        n = len(samples)
        results: list[RewardResult | None] = [None] * n
        self._add("submitted", n)
        if n == 0:
            return []
        indices = iter(range(n))

        async def runner() -> None:
            for i in indices:  # shared iterator: each index is taken by exactly one runner
                results[i] = await self._one(samples[i])
                self._finish(results[i])

        runners = [asyncio.ensure_future(runner()) for _ in range(min(self.max_concurrency, n))]
        try:
            await asyncio.gather(*runners)
        except BaseException:
            for r in runners:
                r.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
            self._add("cancelled", sum(1 for r in results if r is None))
            raise
        return results  # every slot is filled: each runner ran until the shared iterator was exhausted

    async def ascore_groups(self, groups: Iterable[Iterable[Sample]]) -> list[GroupResult]:
        """One :class:`~rlblocks.reward.GroupResult` per group, in order: every sample of every group is scored
        as by :meth:`ascore` (concurrently, retried under the pool's policy), then a group with any failed sample
        is failed whole (counted in ``groups_failed`` and ``samples_in_failed_groups``)."""
        if isinstance(groups, (Sample, str, bytes)):
            raise ArgumentError("groups: expected an iterable of groups (lists of Sample), got "
                                f"{type(groups).__name__}")
        parts = [list(g) for g in groups]
        for i, g in enumerate(parts):
            if not g:
                raise ArgumentError(f"groups[{i}]: expected at least one sample, got an empty group")
        flat = await self.ascore([s for g in parts for s in g])
        out, at = [], 0
        for g in parts:
            out.append(GroupResult.of(flat[at:at + len(g)]))
            at += len(g)
        with self._lock:
            self._counts["groups"] += len(out)
            self._counts["groups_failed"] += sum(not r.ok for r in out)
            self._counts["samples_in_failed_groups"] += sum(len(r.results) for r in out if not r.ok)
        return out

    def score(self, samples: Iterable[Sample]) -> list[RewardResult]:
        """Blocking :meth:`ascore` on a fresh event loop. Do not call it from a running event loop."""
        return asyncio.run(self.ascore(samples))

    async def __call__(self, sample: Sample) -> RewardResult:
        return (await self.ascore([sample]))[0]

    @property
    def num_in_flight(self) -> int:
        """Attempts running now."""
        with self._lock:
            return self._in_flight

    def stats(self) -> dict[str, Any]:
        """Counters, a plain dict.

        Per sample: ``submitted``, ``completed`` (= ``ok`` + ``failed``), ``cancelled`` (``ascore`` was cancelled
        before their result), ``pending`` (= submitted − completed − cancelled), ``seconds`` (sum over completed).
        Per attempt: ``attempts``, ``retries``, ``timeouts``, ``exceptions``, ``crashes`` (worker died),
        ``invalid`` (returned neither a result nor a number), ``returned_errors`` (the reward returned an error
        result), ``abandoned`` (timed out and ignored cancellation). ``in_flight`` now and ``max_in_flight`` ever.
        Per group (:meth:`ascore_groups`): ``groups``, ``groups_failed``, ``samples_in_failed_groups``.
        """
        with self._lock:
            out = dict(self._counts)
            out["in_flight"] = self._in_flight
        out["pending"] = out["submitted"] - out["completed"] - out["cancelled"]
        return out

    def close(self) -> None:
        """Stop the worker processes of a synchronous reward (idempotent). The reward itself is not closed."""
        if self._workers is not None:
            self._workers.close()

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> RewardPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _add(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _finish(self, result: RewardResult) -> None:
        with self._lock:
            self._counts["completed"] += 1
            self._counts["ok" if result.ok else "failed"] += 1
            self._counts["seconds"] += result.seconds

    def _semaphore(self) -> asyncio.Semaphore:
        # asyncio primitives belong to one loop; keep one per loop so the blocking score() (a new loop per call)
        # and ascore() on a long-lived loop both work.
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    async def _one(self, sample: Sample) -> RewardResult:
        sem = self._semaphore()
        attempts = 0
        t0: float | None = None
        while True:
            attempts += 1
            async with sem:
                if t0 is None:
                    t0 = time.perf_counter()
                with self._lock:
                    self._in_flight += 1
                    self._counts["attempts"] += 1
                    self._counts["max_in_flight"] = max(self._counts["max_in_flight"], self._in_flight)
                try:
                    outcome = await self._attempt(sample)
                finally:
                    with self._lock:
                        self._in_flight -= 1
            if isinstance(outcome, RewardResult):
                if not outcome.ok:
                    self._add("returned_errors")
                break
            self._add(outcome.kind)
            if attempts > self.retry.max_retries or not self.retry.retries(outcome.kind):
                outcome = RewardResult.failure(
                    f"{outcome.text} (attempt {attempts} of at most {self.retry.max_retries + 1})",
                    details={"failure": outcome.kind},
                )
                break
            self._add("retries")
            if wait := self.retry.wait_before(attempts):
                await asyncio.sleep(wait)
        details = {**outcome.details, "attempts": attempts}
        return dataclasses.replace(outcome, seconds=time.perf_counter() - t0, details=details)

    async def _attempt(self, sample: Sample) -> RewardResult | _Failure:
        if self._workers is not None:
            try:
                value = await self._workers.arun(self.fn, sample, timeout=self.timeout)
            except RewardTimeout as e:
                return _Failure("timeouts", f"RewardTimeout: {e}")
            except WorkerCrashed as e:
                return _Failure("crashes", f"WorkerCrashed: {e}")
            except (WorkerError, ArgumentError) as e:
                return _Failure("exceptions", str(e) if isinstance(e, WorkerError) else f"{type(e).__name__}: {e}")
        else:
            try:
                task = asyncio.ensure_future(self.fn(sample))
            except Exception as e:  # raised by the call itself, before any await
                return _Failure("exceptions", f"{type(e).__name__}: {e}")
            try:
                done, _ = await asyncio.wait({task}, timeout=self.timeout)
            except BaseException:  # this attempt was cancelled from outside: take the call down with it
                task.cancel()
                raise
            if not done:
                task.cancel()
                finished, _ = await asyncio.wait({task}, timeout=self.cancel_grace) if self.cancel_grace else ((), ())
                if not finished:
                    self._add("abandoned")
                task.add_done_callback(_retrieve)
                return _Failure("timeouts", f"RewardTimeout: no result within {self.timeout:g}s")
            if task.cancelled():
                return _Failure("exceptions", "CancelledError: the reward cancelled itself")
            exc = task.exception()
            if exc is not None:
                return _Failure("exceptions", f"{type(exc).__name__}: {exc}")
            value = task.result()
        try:
            return as_result(value)
        except ArgumentError as e:
            return _Failure("invalid", f"ArgumentError: {e}")
