"""How a :class:`~rlblocks.reward.RewardPool` retries a failed attempt: a bounded number of retries, with a delay
that grows, for the kinds of failure that a second try can fix.

A failed attempt has one of four kinds (``RewardPool.stats()`` counts each): ``timeouts`` (no result in time; a
synchronous reward's worker process was killed and is replaced), ``crashes`` (the worker process died: a segfault,
``os._exit``, the OOM killer; replaced), ``exceptions`` (the reward raised) and ``invalid`` (it returned neither a
result nor a number). A failure the reward *returned* (a result with ``error`` set) is its verdict and is never
retried. When the retries run out the sample gets an error result (``score=None``) that says why, never a 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlblocks._checks import check_int, check_real, check_seconds
from rlblocks.errors import ArgumentError

__all__ = ["FAILURE_KINDS", "RetryPolicy"]

FAILURE_KINDS = ("timeouts", "crashes", "exceptions", "invalid")


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``max_retries`` retries of an attempt whose failure kind is in ``retry_on``; retry ``k`` (1-based)
    waits ``min(delay · backoff^(k−1), max_delay)`` seconds first.

    ``RewardPool(fn, retries=n)`` is ``RetryPolicy(max_retries=n)``: every kind retried at once.
    """

    max_retries: int = 0
    delay: float = 0.0
    backoff: float = 2.0
    max_delay: float = 30.0
    retry_on: tuple[str, ...] = FAILURE_KINDS

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_retries", check_int("max_retries", self.max_retries, minimum=0))
        object.__setattr__(self, "delay", check_seconds("delay", self.delay, allow_zero=True))
        object.__setattr__(self, "max_delay", check_seconds("max_delay", self.max_delay, allow_zero=True))
        backoff = check_real("backoff", self.backoff, finite=True)
        if backoff < 1.0:
            raise ArgumentError(f"backoff: expected a factor >= 1 (delays never shrink), got {self.backoff!r}")
        object.__setattr__(self, "backoff", backoff)
        if isinstance(self.retry_on, str) or not all(k in FAILURE_KINDS for k in self.retry_on):
            raise ArgumentError(f"retry_on: expected a tuple of {FAILURE_KINDS}, got {self.retry_on!r}")
        object.__setattr__(self, "retry_on", tuple(self.retry_on))

    def retries(self, kind: str) -> bool:
        """Whether a failure of ``kind`` is retried at all."""
        return kind in self.retry_on

    def wait_before(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first)."""
        return min(self.delay * self.backoff ** (retry - 1), self.max_delay)
