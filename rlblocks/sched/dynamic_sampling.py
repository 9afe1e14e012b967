"""Dynamic sampling (DAPO / SLIME over-sampling): submit extra prompt groups, keep only informative ones.

A GRPO group whose rewards are all equal has zero advantage everywhere and teaches nothing. The sampler keeps
submitting groups until ``target_groups`` groups passed the filter, then signals :attr:`DynamicSampler.done` so the
caller aborts the groups still in flight (into a :class:`rlblocks.sched.PartialRolloutBuffer`) and trains.

Bounded: when most groups fail the filter (an easy or hopeless prompt set) an unbounded sampler never fills its
batch and the step waits forever. With ``max_rounds=R``, once ``R * target_groups`` groups were filtered out while
filling the current batch, the groups that fail the filter from then on join the batch anyway (*filled*, counted in
``stats()["filled"]``, listed in :attr:`DynamicSampler.filled_groups`), so a batch needs at most
``(R + 1) * target_groups`` finished groups.

Typical step::

    sampler.reset()
    while not sampler.done:
        for _ in range(sampler.num_to_submit()):
            submit_next_group(); sampler.on_submit()
        group, rewards = wait_for_a_finished_group()
        sampler.add_group(group, rewards)
    n = abort_in_flight_into_partial_buffer(); sampler.on_abort(n)
    batch = sampler.finish()

Streaming (fully asynchronous) use: ship each group for which :meth:`DynamicSampler.add_group` returns True and,
once :attr:`DynamicSampler.done`, call :meth:`DynamicSampler.reset` to open the next batch window; groups still in
flight carry over into it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlblocks._checks import check_bool, check_int, check_optional_int, check_real
from rlblocks.errors import ArgumentError, InsufficientGroupsError
from rlblocks.losses.masks import zero_variance_groups


def nonzero_reward_variance(group: Any, rewards: Sequence[float]) -> bool:
    """Default filter: keep a group iff its rewards are not all equal (exact comparison, no tolerance).

    The rule is :func:`rlblocks.losses.zero_variance_groups` (its one home), applied to this one group: a group of
    one sample has zero variance and is rejected; a group holding a NaN or ±inf reward is kept, so the broken
    reward is never discarded with it (:meth:`DynamicSampler.add_group` refuses non-finite rewards before this).
    """
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if r.numel() == 0:
        raise ArgumentError("rewards: expected at least one reward per group, got none")
    return not bool(zero_variance_groups(r, torch.zeros(r.numel(), dtype=torch.long))[0])


def _as_rewards(rewards: Sequence[float] | Tensor) -> list[float]:
    if isinstance(rewards, Tensor):
        if rewards.dim() != 1:
            raise ArgumentError(f"rewards: expected a 1-D tensor [group_size], got shape {list(rewards.shape)}")
        values = [float(r) for r in rewards.detach().cpu().tolist()]
    else:
        if isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__iter__"):
            raise ArgumentError(
                f"rewards: expected a sequence of numbers or a 1-D tensor, got {type(rewards).__name__}"
            )
        values = []
        for i, r in enumerate(rewards):
            if isinstance(r, (str, bytes)):
                raise ArgumentError(f"rewards[{i}]: expected a number, got {r!r}")
            try:
                values.append(float(r))
            except (TypeError, ValueError):
                raise ArgumentError(f"rewards[{i}]: expected a number, got {r!r}") from None
    if not values:
        raise ArgumentError("rewards: expected at least one reward per group, got none")
    for i, r in enumerate(values):
        if not math.isfinite(r):
            raise ArgumentError(f"rewards[{i}]: expected a finite reward, got {r}")
    return values


class DynamicSampler:
    """Over-sampling controller for one training step (one batch window).

    Args:
        target_groups: groups wanted for the step's batch.
        over_sampling: factor ``>= 1``. While not done, the sampler wants
            ``ceil((target_groups - in_batch) * over_sampling)`` groups in flight; :meth:`num_to_submit` returns
            the shortfall. With a filter pass rate ``p``, ``over_sampling ~ 1 / p`` finishes in about one round.
        filter_fn: ``filter_fn(group, rewards) -> bool`` (True keeps the group). Default
            :func:`nonzero_reward_variance`.
        keep_when_insufficient: what :meth:`finish` does when fewer than ``target_groups`` are in the batch (the
            caller stopped submitting, e.g. the prompt source ran dry). True: return the smaller batch. False: raise
            :class:`InsufficientGroupsError` (DAPO's behaviour after its retry limit).
        max_rounds: ``R >= 0`` or ``None`` (unbounded). Once ``R * target_groups`` groups were filtered out in
            this window, a group that fails the filter joins the batch anyway (*filled*) instead of being
            discarded, so the window completes after at most ``(R + 1) * target_groups`` finished groups and a
            step never waits forever. ``R = 0`` never discards (the filter then only labels groups). verl's DAPO
            recipe bounds its retries too (``filter_groups.max_num_gen_batches``, then it raises), as does
            ms-swift's ``max_resample_times``; here the bound proceeds instead of failing.

    Counters (reset by :meth:`reset`): ``submitted``, ``accepted`` (passed the filter, in the batch), ``filled``
    (failed the filter, in the batch because of ``max_rounds``), ``filtered`` (failed, discarded), ``surplus``
    (passed after the batch was full), ``aborted`` (reported by :meth:`on_abort`) and ``in_flight``, with
    ``submitted == accepted + filled + filtered + surplus + aborted + in_flight``. Nothing is dropped silently:
    filtered and surplus groups are kept and handed back by :meth:`reset` (or read via :attr:`filtered_groups`,
    :attr:`surplus_groups`). Thread-safe (one lock).
    """

    def __init__(
        self,
        *,
        target_groups: int,
        over_sampling: float = 1.0,
        filter_fn: Callable[[Any, list[float]], bool] | None = None,
        keep_when_insufficient: bool = True,
        max_rounds: int | None = None,
    ) -> None:
        self.target_groups = check_int("target_groups", target_groups, minimum=1)
        if filter_fn is not None and not callable(filter_fn):
            raise ArgumentError(f"filter_fn: expected a callable(group, rewards) -> bool or None, got {filter_fn!r}")
        self.over_sampling = check_real("over_sampling", over_sampling, finite=True, ge=1.0)
        self.filter_fn = filter_fn if filter_fn is not None else nonzero_reward_variance
        self.keep_when_insufficient = check_bool("keep_when_insufficient", keep_when_insufficient)
        self.max_rounds = check_optional_int("max_rounds", max_rounds, minimum=0)
        self._lock = threading.Lock()
        self.steps = 0
        self._clear()

    def _clear(self) -> None:
        self._submitted = 0
        self._aborted = 0
        self._batch: list[Any] = []  # accepted and filled groups, in arrival order
        self._n_accepted = 0
        self._filled: list[Any] = []
        self._filtered: list[Any] = []
        self._surplus: list[Any] = []

    # ------------------------------------------------------------------ signals
    @property
    def done(self) -> bool:
        """True once the batch holds ``target_groups`` groups: stop submitting, abort what is in flight."""
        with self._lock:
            return len(self._batch) >= self.target_groups

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight_locked()

    def _in_flight_locked(self) -> int:
        return (self._submitted - len(self._batch) - len(self._filtered) - len(self._surplus) - self._aborted)

    def num_to_submit(self) -> int:
        """How many more groups to submit now (0 once done)."""
        with self._lock:
            missing = self.target_groups - len(self._batch)
            if missing <= 0:
                return 0
            want = math.ceil(round(missing * self.over_sampling, 9))
            return max(0, want - self._in_flight_locked())

    # ------------------------------------------------------------------ events
    def on_submit(self, n: int = 1) -> None:
        """``n`` groups were submitted."""
        n = check_int("n", n, minimum=1)
        with self._lock:
            self._submitted += n

    def add_group(self, group: Any, rewards: Sequence[float] | Tensor) -> bool:
        """A submitted group finished with per-sample ``rewards``. Returns True iff it joins the training batch.

        A group that passes the filter joins while the batch is not full (else it goes to
        :attr:`surplus_groups`). A group that fails is kept in :attr:`filtered_groups`, unless ``max_rounds``
        discards were already made in this window: then it joins the batch as *filled* (True is returned; see
        :attr:`filled_groups`). Raises ``ArgumentError`` if no group is in flight. Rewards may be numbers or bools
        (read as 1.0 / 0.0); NaN or infinite rewards are refused.
        """
        values = _as_rewards(rewards)
        verdict = self.filter_fn(group, values)
        try:
            keep = bool(verdict)  # numpy and 0-d torch bools are fine; a multi-element tensor is not a verdict
        except (RuntimeError, TypeError, ValueError):
            raise ArgumentError(f"filter_fn: expected it to return True or False, got {verdict!r:.80}") from None
        with self._lock:
            if self._in_flight_locked() <= 0:
                raise ArgumentError("group: add_group() with no group in flight (call on_submit() when submitting)")
            full = len(self._batch) >= self.target_groups
            if not keep:
                bound = None if self.max_rounds is None else self.max_rounds * self.target_groups
                if full or bound is None or len(self._filtered) < bound:
                    self._filtered.append(group)
                    return False
                self._filled.append(group)
                self._batch.append(group)
                return True
            if full:
                self._surplus.append(group)
                return False
            self._batch.append(group)
            self._n_accepted += 1
            return True

    def on_abort(self, n: int = 1) -> None:
        """``n`` in-flight groups were aborted (typically into the partial-rollout buffer once :attr:`done`)."""
        n = check_int("n", n, minimum=1)
        with self._lock:
            if n > self._in_flight_locked():
                raise ArgumentError(f"n: cannot abort {n} group(s), only {self._in_flight_locked()} in flight")
            self._aborted += n

    # ------------------------------------------------------------------ results
    def finish(self) -> list[Any]:
        """The batch (at most ``target_groups`` groups, accepted and filled, in arrival order), applying
        ``keep_when_insufficient``."""
        with self._lock:
            got = len(self._batch)
            if got < self.target_groups and not self.keep_when_insufficient:
                raise InsufficientGroupsError(
                    f"only {got} of target_groups={self.target_groups} groups passed the filter "
                    f"({len(self._filtered)} filtered, {self._in_flight_locked()} still in flight); "
                    "submit more, set max_rounds, or set keep_when_insufficient=True"
                )
            return list(self._batch)

    @property
    def filtered_groups(self) -> list[Any]:
        with self._lock:
            return list(self._filtered)

    @property
    def surplus_groups(self) -> list[Any]:
        with self._lock:
            return list(self._surplus)

    @property
    def filled_groups(self) -> list[Any]:
        """Groups in the batch that failed the filter (taken because of ``max_rounds``), in arrival order."""
        with self._lock:
            return list(self._filled)

    def _stats_locked(self) -> dict[str, int]:
        return {
            "submitted": self._submitted,
            "accepted": self._n_accepted,
            "filled": len(self._filled),
            "filtered": len(self._filtered),
            "surplus": len(self._surplus),
            "aborted": self._aborted,
            "in_flight": self._in_flight_locked(),
            "target_groups": self.target_groups,
            "steps": self.steps,
        }

    def stats(self) -> dict[str, int]:
        """Counters of the current window (see the class docstring for the invariant), plus ``target_groups`` and
        ``steps`` (windows closed by :meth:`reset`)."""
        with self._lock:
            return self._stats_locked()

    def reset(self) -> dict[str, Any]:
        """Start the next step. Returns what the ending step left over, so nothing is lost:
        ``{"stats": ..., "surplus": [...], "filtered": [...], "filled": [...]}`` (surplus groups passed the filter
        and may seed the next batch). Groups still in flight are carried over: they count as submitted in the new
        step (their results arrive there), which suits fully asynchronous loops; ``stats["carried_in_flight"]``
        says how many.
        """
        with self._lock:
            carried = self._in_flight_locked()
            snapshot = self._stats_locked()
            snapshot.pop("in_flight")
            snapshot["carried_in_flight"] = carried
            out = dict(stats=snapshot, surplus=self._surplus, filtered=self._filtered, filled=self._filled)
            self._clear()
            self._submitted = carried
            self.steps += 1
            return out

