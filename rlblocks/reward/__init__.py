"""Rewards as bounded async services: verifiers, a sandboxed code reward, a learned reward model, a pool, combinators.

- :class:`Sample`, :class:`RewardResult`, :class:`RewardFn` — one async call per sample; a failure is a result with
  ``error`` set and ``score=None``, never an exception that loses the sample.
- :data:`math_reward` / :class:`MathReward` — final answer (last ``\\boxed{}``, else last number) checked with
  ``math-verify`` in killable worker processes under a timeout; :func:`check_math`, :func:`extract_answer`.
- :data:`code_reward` / :class:`CodeReward` / :class:`CodeTest` — the program against test cases in
  :mod:`rlblocks.sandbox`; score = fraction passed, per-test outcomes.
- :class:`RewardModel` — an HF sequence-classification model (or a causal LM + scalar head), batched,
  padding-aware, on any device (imported on first use: it needs torch).
- :class:`RewardPool` — concurrency bound, input order, timeouts, retries, ``stats()``; asyncio for async rewards,
  killable worker processes for synchronous CPU-bound ones (:class:`~rlblocks.reward.workers.ProcessWorkers`).
- :class:`WeightedReward`, :class:`FormatReward`, :class:`OverlongPenalty` — combinators.

``import rlblocks.reward`` imports only the standard library and rlblocks' small modules: no torch, transformers
or math-verify (those load inside the file that needs them, when it is used), so a verifier worker process starts
fast. ``math-verify`` is the optional extra ``pip install rlblocks[reward]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks.reward.code import CodeReward, CodeTest, code_reward, extract_code, outputs_match
from rlblocks.reward.combine import FormatReward, OverlongPenalty, WeightedReward
from rlblocks.reward.math import MathReward, check_math, extract_answer, math_reward
from rlblocks.reward.pool import RewardPool
from rlblocks.reward.types import RewardFn, RewardResult, Sample
from rlblocks.reward.workers import ProcessWorkers, RewardTimeout, WorkerCrashed, WorkerError

if TYPE_CHECKING:
    from rlblocks.reward.model import RewardModel

__all__ = [
    "CodeReward",
    "CodeTest",
    "FormatReward",
    "MathReward",
    "OverlongPenalty",
    "ProcessWorkers",
    "RewardFn",
    "RewardModel",
    "RewardPool",
    "RewardResult",
    "RewardTimeout",
    "Sample",
    "WeightedReward",
    "WorkerCrashed",
    "WorkerError",
    "check_math",
    "code_reward",
    "extract_answer",
    "extract_code",
    "math_reward",
    "outputs_match",
]


def __getattr__(name: str):
    # RewardModel needs torch; load it on first use so the package itself stays light.
    if name == "RewardModel":
        from rlblocks.reward.model import RewardModel

        return RewardModel
    raise AttributeError(f"module 'rlblocks.reward' has no attribute {name!r}")
