"""Rewards as bounded async services: verifiers, a sandboxed code reward, a learned reward model, a pool, combinators.

- :class:`Sample`, :class:`RewardResult`, :class:`RewardFn` — one async call per sample; a failure is a result with
  ``error`` set and ``score=None``, never an exception that loses the sample.
- :data:`math_reward` / :class:`MathReward` — final answer (last ``\\boxed{}``, else last number) checked with
  ``math-verify`` in killable worker processes under a timeout; :func:`check_math`, :func:`extract_answer`.
- :data:`code_reward` / :class:`CodeReward` / :class:`CodeTest` — the program against test cases in
  :mod:`rlblocks.sandbox`; score = fraction passed, per-test outcomes.
- :class:`RewardModel` — an HF sequence-classification model (or a causal LM + scalar head), batched,
  padding-aware, on any device (imported on first use: it needs torch).
- :class:`RewardPool` — concurrency bound, input order, timeouts, bounded retries (:class:`RetryPolicy`),
  ``stats()``; asyncio for async rewards, killable worker processes for synchronous CPU-bound ones
  (:class:`ProcessWorkers`: a crashed or hung worker is replaced); groups failed whole (:class:`GroupResult`).
- :class:`WeightedReward`, :class:`FormatReward`, :class:`OverlongPenalty` — combinators.
- :func:`evaluate` (an engine, prompts, a reward → :class:`EvalResult`), :func:`summarize`, :func:`pass_at_k` —
  held-out pass@k (the unbiased estimator) and mean@k with per-prompt results.

``import rlblocks.reward`` imports only the standard library and rlblocks' small modules: no torch, transformers
or math-verify (those load inside the file that needs them, when it is used), so a verifier worker process starts
fast. ``math-verify`` is the optional extra ``pip install rlblocks[reward]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

from .code import CodeReward, CodeTest, code_reward, extract_code, outputs_match
from .combine import FormatReward, OverlongPenalty, WeightedReward
from .evaluate import EvalResult, PromptResult, evaluate, pass_at_k, summarize
from .math import MathReward, check_math, extract_answer, math_reward
from .pool import RewardPool
from .retry import RetryPolicy
from .types import GroupResult, RewardFn, RewardResult, Sample
from .workers import ProcessWorkers

if TYPE_CHECKING:
    from .model import RewardModel

# heavy (torch; transformers when a checkpoint is loaded): name -> module, imported on first access, so that a
# verifier worker process that imports rlblocks.reward starts without torch
_LAZY = {
    "RewardModel": ".model",
}

__all__ = [
    "CodeReward",
    "CodeTest",
    "EvalResult",
    "FormatReward",
    "GroupResult",
    "MathReward",
    "OverlongPenalty",
    "ProcessWorkers",
    "PromptResult",
    "RetryPolicy",
    "RewardFn",
    "RewardModel",
    "RewardPool",
    "RewardResult",
    "Sample",
    "WeightedReward",
    "check_math",
    "code_reward",
    "evaluate",
    "extract_answer",
    "extract_code",
    "math_reward",
    "outputs_match",
    "pass_at_k",
    "summarize",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
