"""Staleness-bounded admission control (AReaL's rule).

A rollout may be *submitted* only while the controller has capacity at the current policy version ``v``::

    capacity(v) = max(0, min(C - running, (eta + v + 1) * B - (accepted + running)))

with ``B`` the per-rank batch size (samples consumed per train step), ``C`` the per-rank cap on concurrent
rollouts, ``eta`` the maximum staleness (``eta = 0`` is synchronous RL) and the cumulative counters ``accepted``
(rollouts kept for training) and ``running`` (submitted, not yet accepted or rejected). A rejected rollout frees its
slot: ``rejected`` does not appear in the formula. The second term bounds how far sample production may run ahead of
training: after ``v`` train steps ``v * B`` samples have been consumed, and at most ``eta + 1`` further batches may be
accepted or in flight.

Admission bounds age at *submission*; it does not bound age at *consumption* (a slow rollout can finish after
several version bumps). Re-check on consumption with :class:`rlblocks.sched.StalenessQueue`.
"""

from __future__ import annotations

import threading
from typing import Any

from rlblocks._checks import check_int, check_state_keys
from rlblocks.errors import ArgumentError


class StalenessController:
    """AReaL admission control for one data-parallel rank.

    Args:
        batch_size: GLOBAL number of samples consumed per train step (all DP ranks together).
        max_staleness: ``eta >= 0``, how many versions a sample may lag behind the policy it trains.
        max_concurrent: GLOBAL cap on rollouts in flight (all DP ranks together).
        dp_size: number of data-parallel ranks, each holding its own controller.

    The global ``batch_size`` and ``max_concurrent`` are divided by ``dp_size`` exactly once, here, and the
    per-rank values are what the formula uses (``self.batch_size``, ``self.max_concurrent``); the global values
    stay available as ``global_batch_size`` / ``global_max_concurrent``. A value that ``dp_size`` does not divide
    raises ``ValueError`` (no remainder is silently dropped or given to some ranks). Never pass per-rank values:
    dividing twice shrinks capacity and can stall training (AReaL #1396).

    Counters (cumulative, per rank): ``submitted``, ``running``, ``accepted``, ``rejected``, with the invariant
    ``submitted == accepted + rejected + running`` — every submitted rollout is either still running or has
    been accepted or rejected exactly once (an accepted rollout discarded later, e.g. found stale by the
    :class:`StalenessQueue`, moves to ``rejected`` with :meth:`on_discard`). :meth:`on_accept` /
    :meth:`on_reject` with nothing running raise ``ValueError`` rather than drive ``running`` negative.

    Every method takes one internal lock, so a controller may be shared by threads. Use :meth:`try_submit`
    (atomic check-and-reserve) from concurrent submitters; :meth:`capacity` followed by :meth:`on_submit` is
    racy when several threads submit.
    """

    def __init__(self, *, batch_size: int, max_staleness: int, max_concurrent: int, dp_size: int = 1) -> None:
        dp_size = check_int("dp_size", dp_size, minimum=1)
        batch_size = check_int("batch_size", batch_size, minimum=1)
        max_concurrent = check_int("max_concurrent", max_concurrent, minimum=1)
        self.max_staleness = check_int("max_staleness", max_staleness, minimum=0)
        for name, value in (("batch_size", batch_size), ("max_concurrent", max_concurrent)):
            if value % dp_size != 0 or value < dp_size:
                raise ArgumentError(
                    f"{name}: expected a GLOBAL value that is a positive multiple of dp_size={dp_size} "
                    f"(it is divided by dp_size once per rank), got {value}"
                )
        self.dp_size = dp_size
        self.global_batch_size = batch_size
        self.global_max_concurrent = max_concurrent
        self.batch_size = batch_size // dp_size
        self.max_concurrent = max_concurrent // dp_size
        self._lock = threading.Lock()
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    # ------------------------------------------------------------------ counters
    @property
    def submitted(self) -> int:
        with self._lock:
            return self._accepted + self._rejected + self._running

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    @property
    def accepted(self) -> int:
        with self._lock:
            return self._accepted

    @property
    def rejected(self) -> int:
        with self._lock:
            return self._rejected

    # ------------------------------------------------------------------ admission
    def _capacity_locked(self, version: int) -> int:
        by_concurrency = self.max_concurrent - self._running
        by_staleness = (self.max_staleness + version + 1) * self.batch_size - (self._accepted + self._running)
        return max(0, min(by_concurrency, by_staleness))

    def capacity(self, version: int) -> int:
        """How many rollouts may be submitted now at policy ``version`` (>= 0)."""
        version = check_int("version", version, minimum=0)
        with self._lock:
            return self._capacity_locked(version)

    def try_submit(self, version: int, n: int = 1) -> bool:
        """Atomically reserve ``n`` slots if ``capacity(version) >= n``; returns whether it did."""
        version = check_int("version", version, minimum=0)
        n = check_int("n", n, minimum=1)
        with self._lock:
            if self._capacity_locked(version) < n:
                return False
            self._running += n
            return True

    def on_submit(self, n: int = 1) -> None:
        """Record ``n`` submitted rollouts (``running += n``). Does not check capacity; see :meth:`try_submit`."""
        n = check_int("n", n, minimum=1)
        with self._lock:
            self._running += n

    def _finish(self, n: int, what: str) -> None:
        n = check_int("n", n, minimum=1)
        with self._lock:
            if n > self._running:
                raise ArgumentError(f"n: cannot {what} {n} rollout(s), only {self._running} running")
            self._running -= n
            if what == "accept":
                self._accepted += n
            else:
                self._rejected += n

    def on_accept(self, n: int = 1) -> None:
        """``n`` running rollouts finished and were kept for training: ``running -= n; accepted += n``."""
        self._finish(n, "accept")

    def on_reject(self, n: int = 1) -> None:
        """``n`` running rollouts were discarded (filtered, failed, aborted for good); their slots are freed."""
        self._finish(n, "reject")

    def on_discard(self, n: int = 1) -> None:
        """``n`` rollouts that were ACCEPTED were discarded afterwards (found stale when the batch was taken, or
        lost before training): ``accepted -= n; rejected += n``, which frees their slots.

        Without this, a rollout dropped at consumption stays counted in ``accepted`` although it will never be
        trained: every such drop permanently uses one of the ``(eta + 1) * B`` slots ahead of training, and once
        ``(eta + 1) * B`` have accumulated, capacity stays 0 forever (the loop stalls waiting for samples nobody
        may generate). Giving the slot back by submitting outside ``capacity()`` has the same flaw, because the
        replacement is accepted in turn.
        """
        n = check_int("n", n, minimum=1)
        with self._lock:
            if n > self._accepted:
                raise ArgumentError(f"n: cannot discard {n} accepted rollout(s), only {self._accepted} accepted")
            self._accepted -= n
            self._rejected += n

    def stats(self) -> dict[str, int]:
        """Counters snapshot (plain ints): ``submitted``, ``running``, ``accepted``, ``rejected`` (cumulative, this
        rank) and the per-rank ``batch_size`` / ``max_concurrent`` the admission formula uses, ``max_staleness``
        and ``dp_size``. Invariant: ``submitted == accepted + rejected + running``."""
        with self._lock:
            return {
                "submitted": self._accepted + self._rejected + self._running,
                "running": self._running,
                "accepted": self._accepted,
                "rejected": self._rejected,
                "batch_size": self.batch_size,
                "max_concurrent": self.max_concurrent,
                "max_staleness": self.max_staleness,
                "dp_size": self.dp_size,
            }

    # ------------------------------------------------------------------ checkpointing
    def on_version_recovered(self, version: int) -> None:
        """After restarting from a checkpoint taken at policy ``version``: ``accepted = version * B``.

        ``version`` train steps consumed exactly ``version * B`` samples on this rank; setting ``accepted`` from it
        prevents the inflated capacity that a fresh controller (``accepted = 0``) would report. Rollouts that were in
        flight died with the old process, so ``running`` is set to 0; ``rejected`` is kept. ``submitted`` is derived
        (``accepted + rejected + running``) so the invariant holds.
        """
        version = check_int("version", version, minimum=0)
        with self._lock:
            self._accepted = version * self.batch_size
            self._running = 0

    def state_dict(self) -> dict[str, Any]:
        """Counters and the configuration they refer to (plain ints; picklable)."""
        with self._lock:
            return {
                "batch_size": self.global_batch_size,
                "max_concurrent": self.global_max_concurrent,
                "max_staleness": self.max_staleness,
                "dp_size": self.dp_size,
                "submitted": self._accepted + self._rejected + self._running,
                "running": self._running,
                "accepted": self._accepted,
                "rejected": self._rejected,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters exactly (``running`` included).

        The counters are per-rank sample counts, so ``batch_size`` and ``dp_size`` must match this controller's;
        ``max_staleness`` and ``max_concurrent`` may differ (they only change future admission). If the rollouts that
        were running at save time did not survive the restart, call :meth:`on_version_recovered` afterwards.
        """
        where = "StalenessController.load_state_dict: state"
        check_state_keys(where, state, ("batch_size", "dp_size", "running", "accepted", "rejected", "submitted"),
                         ("max_concurrent", "max_staleness"))
        for key, mine in (("batch_size", self.global_batch_size), ("dp_size", self.dp_size)):
            if check_int(f"{where}[{key!r}]", state[key], minimum=1) != mine:
                raise ArgumentError(f"{where}[{key!r}]: expected {mine} (this controller's), got {state[key]!r}")
        running = check_int(f"{where}['running']", state["running"], minimum=0)
        accepted = check_int(f"{where}['accepted']", state["accepted"], minimum=0)
        rejected = check_int(f"{where}['rejected']", state["rejected"], minimum=0)
        if check_int(f"{where}['submitted']", state["submitted"], minimum=0) != running + accepted + rejected:
            raise ArgumentError(
                f"{where}['submitted']: expected accepted + rejected + running = {running + accepted + rejected}, "
                f"got {state['submitted']!r}"
            )
        with self._lock:
            self._running, self._accepted, self._rejected = running, accepted, rejected

    def __repr__(self) -> str:
        s = self.state_dict()
        return (
            f"StalenessController(B={self.batch_size}/rank, C={self.max_concurrent}/rank, eta={self.max_staleness}, "
            f"dp={self.dp_size}, submitted={s['submitted']}, running={s['running']}, accepted={s['accepted']}, "
            f"rejected={s['rejected']})"
        )
