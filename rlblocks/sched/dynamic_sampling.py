"""Dynamic sampling (DAPO / SLIME over-sampling): submit extra prompt groups, keep only informative ones.

A GRPO group whose rewards are all equal has zero advantage everywhere and teaches nothing. The sampler keeps
submitting groups until ``target_groups`` groups passed the filter, then signals :attr:`DynamicSampler.done` so the
caller aborts the groups still in flight (into a :class:`rlblocks.sched.PartialRolloutBuffer`) and trains.

Typical step::

    sampler.reset()
    while not sampler.done:
        for _ in range(sampler.num_to_submit()):
            submit_next_group(); sampler.on_submit()
        group, rewards = wait_for_a_finished_group()
        sampler.add_group(group, rewards)
    n = abort_in_flight_into_partial_buffer(); sampler.on_abort(n)
    batch = sampler.finish()
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from rlblocks.errors import ArgumentError, InsufficientGroupsError


def nonzero_reward_variance(group: Any, rewards: Sequence[float]) -> bool:
    """Default filter: keep a group iff its rewards are not all equal (exact comparison, no tolerance).

    A group of one sample has zero variance and is rejected.
    """
    first = rewards[0]
    return any(r != first for r in rewards)


def _as_rewards(rewards: Sequence[float] | Tensor) -> list[float]:
    if isinstance(rewards, Tensor):
        if rewards.dim() != 1:
            raise ArgumentError(f"rewards: expected a 1-D tensor [group_size], got shape {list(rewards.shape)}")
        values = [float(r) for r in rewards.detach().cpu().tolist()]
    else:
        values = [float(r) for r in rewards]
    if not values:
        raise ArgumentError("rewards: expected at least one reward per group, got none")
    for i, r in enumerate(values):
        if not math.isfinite(r):
            raise ArgumentError(f"rewards[{i}]: expected a finite reward, got {r}")
    return values


class DynamicSampler:
    """Over-sampling controller for one training step.

    Args:
        target_groups: accepted groups wanted for the step.
        over_sampling: factor ``>= 1``. While not done, the sampler wants
            ``ceil((target_groups - accepted) * over_sampling)`` groups in flight; :meth:`num_to_submit` returns the
            shortfall. With a filter pass rate ``p``, ``over_sampling ~ 1 / p`` finishes in about one round.
        filter_fn: ``filter_fn(group, rewards) -> bool`` (True keeps the group). Default
            :func:`nonzero_reward_variance`.
        keep_when_insufficient: what :meth:`finish` does when fewer than ``target_groups`` were accepted (the
            caller stopped submitting, e.g. the prompt source ran dry or a round limit was hit). True: return the
            smaller batch. False: raise :class:`InsufficientGroupsError` (DAPO's behaviour after its retry limit).

    Counters (reset by :meth:`reset`): ``submitted``, ``accepted``, ``filtered``, ``surplus`` (passed the filter
    after the target was reached), ``aborted`` (reported by :meth:`on_abort`) and ``in_flight``, with
    ``submitted == accepted + filtered + surplus + aborted + in_flight``. Nothing is dropped silently: filtered and
    surplus groups are kept and handed back by :meth:`reset` (or read via :attr:`filtered_groups`,
    :attr:`surplus_groups`). Thread-safe (one lock).
    """

    def __init__(
        self,
        *,
        target_groups: int,
        over_sampling: float = 1.0,
        filter_fn: Callable[[Any, list[float]], bool] | None = None,
        keep_when_insufficient: bool = True,
    ) -> None:
        if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups < 1:
            raise ArgumentError(f"target_groups: expected an int >= 1, got {target_groups!r}")
        if not (isinstance(over_sampling, (int, float)) and math.isfinite(over_sampling) and over_sampling >= 1.0):
            raise ArgumentError(f"over_sampling: expected a finite number >= 1.0, got {over_sampling!r}")
        if filter_fn is not None and not callable(filter_fn):
            raise ArgumentError(f"filter_fn: expected a callable(group, rewards) -> bool or None, got {filter_fn!r}")
        self.target_groups = target_groups
        self.over_sampling = float(over_sampling)
        self.filter_fn = filter_fn if filter_fn is not None else nonzero_reward_variance
        self.keep_when_insufficient = bool(keep_when_insufficient)
        self._lock = threading.Lock()
        self.steps = 0
        self._clear()

    def _clear(self) -> None:
        self._submitted = 0
        self._aborted = 0
        self._accepted: list[Any] = []
        self._filtered: list[Any] = []
        self._surplus: list[Any] = []

    # ------------------------------------------------------------------ signals
    @property
    def done(self) -> bool:
        """True once ``target_groups`` groups were accepted: stop submitting, abort what is in flight."""
        with self._lock:
            return len(self._accepted) >= self.target_groups

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight_locked()

    def _in_flight_locked(self) -> int:
        return self._submitted - len(self._accepted) - len(self._filtered) - len(self._surplus) - self._aborted

    def num_to_submit(self) -> int:
        """How many more groups to submit now (0 once done)."""
        with self._lock:
            missing = self.target_groups - len(self._accepted)
            if missing <= 0:
                return 0
            want = math.ceil(round(missing * self.over_sampling, 9))
            return max(0, want - self._in_flight_locked())

    # ------------------------------------------------------------------ events
    def on_submit(self, n: int = 1) -> None:
        """``n`` groups were submitted."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ArgumentError(f"n: expected an int >= 1, got {n!r}")
        with self._lock:
            self._submitted += n

    def add_group(self, group: Any, rewards: Sequence[float] | Tensor) -> bool:
        """A submitted group finished with per-sample ``rewards``. Returns True iff it joins the training batch.

        Filtered groups are kept in :attr:`filtered_groups`; groups passing the filter after the target was reached
        go to :attr:`surplus_groups`. Raises ``ValueError`` if no group is in flight.
        """
        values = _as_rewards(rewards)
        keep = bool(self.filter_fn(group, values))
        with self._lock:
            if self._in_flight_locked() <= 0:
                raise ArgumentError("group: add_group() with no group in flight (call on_submit() when submitting)")
            if not keep:
                self._filtered.append(group)
                return False
            if len(self._accepted) >= self.target_groups:
                self._surplus.append(group)
                return False
            self._accepted.append(group)
            return True

    def on_abort(self, n: int = 1) -> None:
        """``n`` in-flight groups were aborted (typically into the partial-rollout buffer once :attr:`done`)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ArgumentError(f"n: expected an int >= 1, got {n!r}")
        with self._lock:
            if n > self._in_flight_locked():
                raise ArgumentError(f"n: cannot abort {n} group(s), only {self._in_flight_locked()} in flight")
            self._aborted += n

    # ------------------------------------------------------------------ results
    def finish(self) -> list[Any]:
        """The accepted groups (at most ``target_groups``, in arrival order), applying ``keep_when_insufficient``."""
        with self._lock:
            got = len(self._accepted)
            if got < self.target_groups and not self.keep_when_insufficient:
                raise InsufficientGroupsError(
                    f"only {got} of target_groups={self.target_groups} groups passed the filter "
                    f"({len(self._filtered)} filtered, {self._in_flight_locked()} still in flight); "
                    "submit more or set keep_when_insufficient=True"
                )
            return list(self._accepted)

    @property
    def filtered_groups(self) -> list[Any]:
        with self._lock:
            return list(self._filtered)

    @property
    def surplus_groups(self) -> list[Any]:
        with self._lock:
            return list(self._surplus)

    def counts(self) -> dict[str, int]:
        """Per-step counters (see the class docstring for the invariant)."""
        with self._lock:
            return {
                "submitted": self._submitted,
                "accepted": len(self._accepted),
                "filtered": len(self._filtered),
                "surplus": len(self._surplus),
                "aborted": self._aborted,
                "in_flight": self._in_flight_locked(),
                "target_groups": self.target_groups,
            }

    def reset(self) -> dict[str, Any]:
        """Start the next step. Returns what the ending step left over, so nothing is lost:
        ``{"counts": ..., "surplus": [...], "filtered": [...]}`` (surplus groups passed the filter and may seed the
        next batch). Groups still in flight are carried over: they count as submitted in the new step (their
        results arrive there), which suits fully asynchronous loops; ``counts["carried_in_flight"]`` says how many.
        """
        with self._lock:
            carried = self._in_flight_locked()
            out = {
                "counts": {
                    "submitted": self._submitted,
                    "accepted": len(self._accepted),
                    "filtered": len(self._filtered),
                    "surplus": len(self._surplus),
                    "aborted": self._aborted,
                    "carried_in_flight": carried,
                },
                "surplus": self._surplus,
                "filtered": self._filtered,
            }
            self._clear()
            self._submitted = carried
            self.steps += 1
            return out
