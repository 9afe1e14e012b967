"""Reward combinators, each in one place: a weighted sum of named rewards, a format reward, the overlong penalty.

All three are async :class:`~rlblocks.reward.RewardFn` objects, so they nest (a weighted sum of a verifier, a
format check and the overlong penalty is one reward) and run in a :class:`~rlblocks.reward.RewardPool`.

- :class:`WeightedReward` — ``score = Σ_k w_k · score_k`` over named rewards run concurrently (DeepSeek-R1's
  accuracy + format rewards; GDPO-style multi-reward sums). ``components`` keeps each term's own score under its
  name and the term's components as ``"name/component"``, so nothing is summed away unseen.
- :class:`FormatReward` — ``score`` if the response matches a regular expression, else ``otherwise``.
- :class:`OverlongPenalty` — DAPO's soft overlong punishment on ``sample.response_len`` (tokens). The formula is
  :func:`rlblocks.losses.masks.overlong_penalty` itself (the one implementation, shared with the tensor form
  used on a batch), evaluated in float64 on a one-element tensor.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from rlblocks._checks import check_real
from rlblocks.errors import ArgumentError
from rlblocks.reward.pool import as_result, is_async_reward
from rlblocks.reward.types import RewardResult, Sample

__all__ = ["FormatReward", "OverlongPenalty", "WeightedReward"]


def _check_sample(sample: object) -> None:
    if not isinstance(sample, Sample):
        raise ArgumentError(f"sample: expected a rlblocks.reward.Sample, got {type(sample).__name__}")


class WeightedReward:
    """``score = Σ_k weights[k] · rewards[k](sample).score`` (a missing weight is 1.0).

    Args:
        rewards: name → async reward (:class:`~rlblocks.reward.RewardFn`, or an async function returning a
            :class:`~rlblocks.reward.RewardResult` or a number). Names are non-empty and contain no ``"/"``.
        weights: name → finite weight; a name that is not in ``rewards`` is refused (never silently ignored).

    The terms run concurrently (``asyncio.gather``). If any term fails (error result or exception), the sum is a
    failure: ``error`` lists each failed term as ``"name: error"``, and ``components`` still holds the terms that
    succeeded. ``details[name]`` is each term's ``details``. The sum is ``math.fsum`` (exactly rounded).
    """

    def __init__(self, rewards: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> None:
        if not isinstance(rewards, Mapping) or not rewards:
            raise ArgumentError(f"rewards: expected a non-empty mapping of name -> async reward, got {rewards!r}")
        for name, fn in rewards.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ArgumentError(f"rewards: expected names that are non-empty str without '/', got {name!r}")
            if not is_async_reward(fn):
                raise ArgumentError(
                    f"rewards[{name!r}]: expected an async reward (a synchronous function has no timeout here; "
                    f"run it through a RewardPool, which is itself an async reward), got {fn!r}"
                )
        weights = {} if weights is None else weights
        if not isinstance(weights, Mapping):
            raise ArgumentError(f"weights: expected a mapping of name -> float, got {type(weights).__name__}")
        unknown = sorted(set(weights) - set(rewards))
        if unknown:
            raise ArgumentError(f"weights: expected names among {sorted(rewards)}, got unknown {unknown}")
        self.rewards = dict(rewards)
        self.weights = {k: check_real(f"weights[{k!r}]", weights.get(k, 1.0), finite=True) for k in self.rewards}

    async def __call__(self, sample: Sample) -> RewardResult:
        _check_sample(sample)
        t0 = time.perf_counter()
        names = list(self.rewards)
        raw = await asyncio.gather(*(self.rewards[k](sample) for k in names), return_exceptions=True)
        components: dict[str, float] = {}
        details: dict[str, Any] = {}
        terms: list[float] = []
        errors: list[str] = []
        for name, value in zip(names, raw):
            if isinstance(value, asyncio.CancelledError):
                raise value
            if isinstance(value, BaseException):
                errors.append(f"{name}: {type(value).__name__}: {value}")
                continue
            try:
                r = as_result(value)
            except ArgumentError as e:
                errors.append(f"{name}: ArgumentError: {e}")
                continue
            details[name] = r.details
            if not r.ok:
                errors.append(f"{name}: {r.error}")
                continue
            components[name] = r.score
            components.update({f"{name}/{k}": v for k, v in r.components.items()})
            terms.append(self.weights[name] * r.score)
        seconds = time.perf_counter() - t0
        if errors:
            return RewardResult.failure("; ".join(errors), components=components, seconds=seconds, details=details)
        return RewardResult(math.fsum(terms), components, seconds=seconds, details=details)


class FormatReward:
    """``score`` if ``sample.response`` matches ``pattern``, else ``otherwise``.

    ``match="fullmatch"`` (default) requires the whole response to match, ``"search"`` anywhere. ``flags``
    default to ``re.DOTALL`` so ``.`` spans lines, as in DeepSeek-R1's format reward
    ``r"<think>.*?</think>\\s*<answer>.*?</answer>"``. ``components``: ``{"format": 1.0 or 0.0}``.
    """

    def __init__(
        self, pattern: str | re.Pattern, *, match: str = "fullmatch", flags: int = re.DOTALL, score: float = 1.0,
        otherwise: float = 0.0,
    ) -> None:
        if match not in ("fullmatch", "search"):
            raise ArgumentError(f"match: expected 'fullmatch' or 'search', got {match!r}")
        try:
            self.pattern = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, flags)
        except (re.error, TypeError) as e:
            raise ArgumentError(f"pattern: expected a valid regular expression, got {pattern!r}: {e}") from e
        self.match = match
        self.score = check_real("score", score, finite=True)
        self.otherwise = check_real("otherwise", otherwise, finite=True)

    async def __call__(self, sample: Sample) -> RewardResult:
        _check_sample(sample)
        t0 = time.perf_counter()
        fn = self.pattern.fullmatch if self.match == "fullmatch" else self.pattern.search
        ok = fn(sample.response) is not None
        return RewardResult(self.score if ok else self.otherwise, {"format": float(ok)},
                            seconds=time.perf_counter() - t0)


class OverlongPenalty:
    """DAPO soft overlong punishment of ``sample.response_len`` (tokens), in ``[−penalty, 0]``.

    ``0`` if ``L ≤ max_len − buffer``; ``−penalty · (L − (max_len − buffer)) / buffer`` inside the buffer;
    ``−penalty`` if ``L ≥ max_len`` — computed by :func:`rlblocks.losses.masks.overlong_penalty` (float64), the
    same function a trainer applies to a batch of lengths, so the two can never disagree. A sample without
    ``response_len`` is an error result (a missing length is not silently a zero penalty).
    ``components``: ``{"overlong": value}``.
    """

    def __init__(self, *, max_len: int, buffer: int, penalty: float = 1.0) -> None:
        # torch is imported here, not at module level: worker processes import rlblocks.reward and should not
        # pay for torch when they only verify math.
        from rlblocks.losses.masks import overlong_penalty

        self._fn = overlong_penalty
        self.max_len, self.buffer, self.penalty = max_len, buffer, penalty
        self._value(0)  # validates max_len, buffer and penalty now, with the formula's own checks

    def _value(self, length: int) -> float:
        import torch

        t = torch.tensor([length], dtype=torch.float64)
        return float(self._fn(t, max_len=self.max_len, buffer=self.buffer, penalty=self.penalty)[0]) + 0.0

    async def __call__(self, sample: Sample) -> RewardResult:
        _check_sample(sample)
        t0 = time.perf_counter()
        if sample.response_len is None:
            return RewardResult.failure("response_len: expected the response length in tokens, got None")
        v = self._value(sample.response_len)
        return RewardResult(v, {"overlong": v}, seconds=time.perf_counter() - t0)
