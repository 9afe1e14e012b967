"""What a reward takes and gives back: :class:`Sample`, :class:`RewardResult` and the :class:`RewardFn` protocol.

A reward function is an ``async`` call on ONE sample::

    async def __call__(self, sample: Sample) -> RewardResult

Conventions every reward in :mod:`rlblocks.reward` keeps:

- A failure is a result, not an exception: ``error`` holds the text (``"TimeoutError: ..."``), ``score`` is
  ``None``, so a failed sample can never be mistaken for a real 0 and is never lost. A wrong answer is not a
  failure: it has ``score = 0.0`` and ``error = None``.
- ``score`` is a finite Python float; ``components`` are the named finite floats that went into it (for a
  weighted sum, each term's own score, nested ones as ``"term/name"``); ``details`` holds anything else worth
  logging (the extracted answer, per-test outcomes), JSON-friendly where possible.
- ``seconds`` is the wall time the call took, measured by whoever ran it (the pool measures it across retries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlblocks._checks import check_int, check_real
from rlblocks.errors import ArgumentError

__all__ = ["GroupResult", "RewardFn", "RewardResult", "Sample"]


@dataclass(frozen=True)
class Sample:
    """One response to score.

    ``response``: the model's text. ``reference``: what it is checked against — the answer for a math verifier
    (a string such as ``"\\frac{1}{2}"`` or a number), the test cases for a code reward; ``None`` for a learned
    reward model. ``prompt``: the text the response answers (a reward model scores ``prompt + response``).
    ``response_len``: the response length in tokens, needed by the overlong penalty (tokens, not characters, since
    the generation budget is in tokens). ``metadata``: passed through untouched (a data source, an id).
    """

    response: str
    reference: Any = None
    prompt: str = ""
    response_len: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.response, str):
            raise ArgumentError(f"response: expected a str, got {type(self.response).__name__}")
        if not isinstance(self.prompt, str):
            raise ArgumentError(f"prompt: expected a str, got {type(self.prompt).__name__}")
        if self.response_len is not None:  # numpy / torch integers (a length read from a tensor) become ints
            n = check_int("response_len", self.response_len, minimum=0, what="None or an int >= 0 (tokens)")
            object.__setattr__(self, "response_len", n)
        if not isinstance(self.metadata, Mapping):
            raise ArgumentError(f"metadata: expected a mapping, got {type(self.metadata).__name__}")


@dataclass
class RewardResult:
    """The outcome of one reward call.

    Invariant (checked): ``error is None`` exactly when ``score`` is a number. ``score`` and every component are
    finite floats (NaN or inf raise :class:`~rlblocks.errors.ArgumentError`: a non-finite reward would poison the
    advantages of its whole group). ``seconds >= 0``.
    """

    score: float | None
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.error is not None:
            if not isinstance(self.error, str) or not self.error:
                raise ArgumentError(f"error: expected None or a non-empty str, got {self.error!r}")
            if self.score is not None:
                raise ArgumentError(
                    f"score: expected None when error is set (error={self.error!r}), got {self.score!r}"
                )
        elif self.score is None:
            raise ArgumentError("score: expected a number, got None without an error text (say why it failed)")
        else:
            self.score = check_real("score", self.score, finite=True)
        if not isinstance(self.components, dict):
            raise ArgumentError(f"components: expected a dict of str -> float, got {type(self.components).__name__}")
        self.components = {str(k): check_real(f"components[{k!r}]", v, finite=True) for k, v in self.components.items()}
        s = check_real("seconds", self.seconds, finite=True)
        if s < 0:
            raise ArgumentError(f"seconds: expected >= 0, got {s}")
        self.seconds = s
        if not isinstance(self.details, dict):
            raise ArgumentError(f"details: expected a dict, got {type(self.details).__name__}")

    @property
    def ok(self) -> bool:
        """The reward was computed (``error is None``); the score may still be 0."""
        return self.error is None

    @classmethod
    def failure(cls, error: str, *, seconds: float = 0.0, **kwargs: Any) -> RewardResult:
        """A failed result: ``score=None`` and the error text."""
        return cls(score=None, error=error, seconds=seconds, **kwargs)


@dataclass
class GroupResult:
    """The results of one group of samples (the responses to one prompt), scored or failed as a whole.

    A group-relative advantage (GRPO's mean and std over the group) computed without one of its samples is biased,
    and a failed sample scored 0 is a lie, so a group with any failed sample is failed whole: ``error`` names the
    first failed sample and why, ``ok`` is False and ``scores`` is ``None``; ``results`` still holds every
    sample's own result (the ones that scored included). Otherwise ``scores`` lists every sample's score."""

    results: list[RewardResult]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def scores(self) -> list[float] | None:
        return [r.score for r in self.results] if self.error is None else None

    @classmethod
    def of(cls, results: list[RewardResult]) -> GroupResult:
        """The group of ``results``: failed whole when any of them failed."""
        bad = next((i for i, r in enumerate(results) if not r.ok), None)
        if bad is None:
            return cls(list(results))
        n_bad = sum(not r.ok for r in results)
        return cls(list(results), error=f"sample {bad} of {len(results)} failed ({n_bad} in all): "
                                        f"{results[bad].error}")


@runtime_checkable
class RewardFn(Protocol):
    """An async reward on one sample: ``await fn(sample) -> RewardResult``.

    Per-sample failures come back as results with ``error`` set; a reward may still raise (a bug, a lost
    connection): :class:`~rlblocks.reward.RewardPool` turns that into an error result too, counted in ``stats()``.
    """

    async def __call__(self, sample: Sample) -> RewardResult: ...
