"""Held-out evaluation: ``n`` samples per prompt from a rollout engine, scored by a reward, summarised as pass@k and
mean@k with the per-prompt results.

pass@k is the probability that at least one of ``k`` samples drawn (without replacement) from a prompt's ``n``
samples is correct, the unbiased estimator of Chen et al. (2021, the Codex paper)::

    pass@k = 1 − C(n − c, k) / C(n, k)        (c correct of n, n ≥ k)

computed as ``1 − ∏_{i = n−c+1}^{n} (1 − k / i)`` in float64 (no binomial coefficient is ever formed, so
``n = 10 000`` is as accurate as ``n = 5``); exactly 1 when ``n − c < k``, exactly 0 when ``c = 0``. mean@k is the
mean score of a prompt's samples (``n = k``: of its ``k`` samples; ``n > k``: the unbiased estimate of the mean of
``k``). Both are averaged over prompts, each prompt weighing the same. A sample is correct when its score is at
least ``threshold`` (default 1.0: an exact answer, every test passed).

A reward that FAILS on a sample (an error result: a timeout, a crash, a reference that does not parse) scores 0 and
is not correct, and it is counted (:attr:`PromptResult.failures`, :attr:`EvalResult.failures`): an evaluation
never drops a sample, and never hides one it could not score.

- :func:`pass_at_k` — the estimator for one prompt.
- :func:`summarize` — per-prompt score lists (from any rollout: single-turn samples, multi-turn episodes) →
  :class:`EvalResult`.
- :func:`evaluate` — the whole thing on an engine: generate, decode, score, summarise (greedy with ``k = 1`` and
  ``temperature = 0`` is the usual held-out accuracy).

This module imports only the standard library and rlblocks' reward types; :func:`evaluate` imports the rollout
types (and so torch) when it is called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlblocks._checks import check_int, check_real
from rlblocks.errors import ArgumentError
from rlblocks.reward.types import RewardResult, Sample

__all__ = ["EvalResult", "PromptResult", "evaluate", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``c`` correct samples out of ``n``: ``1 − C(n−c, k)/C(n, k)``.

    Computed as ``1 − ∏_{i=n−c+1}^{n} (1 − k/i)`` in float64 (stable for any ``n``); 1.0 when ``n − c < k``
    (every draw of ``k`` holds a correct sample), 0.0 when ``c = 0``. Requires ``1 ≤ k ≤ n`` and ``0 ≤ c ≤ n``.
    """
    n = check_int("n", n, minimum=1)
    k = check_int("k", k, minimum=1)
    c = check_int("c", c, minimum=0)
    if k > n:
        raise ArgumentError(f"k: expected at most n = {n} (pass@k needs n >= k samples per prompt), got {k}")
    if c > n:
        raise ArgumentError(f"c: expected at most n = {n} correct samples, got {c}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass(frozen=True)
class PromptResult:
    """One prompt's evaluation.

    ``scores``: one per sample, in sample order (a failed sample scores 0.0); ``failures``: how many of them the
    reward could not score (``errors`` holds their texts); ``correct``: samples with ``score >= threshold``;
    ``pass_at_k`` and ``mean`` (mean@k) as in the module docstring. ``prompt``, ``reference`` and ``responses``
    (the decoded samples; empty when the caller gave none) are carried for inspection.
    """

    index: int
    scores: tuple[float, ...]
    correct: int
    pass_at_k: float
    mean: float
    failures: int = 0
    errors: tuple[str, ...] = ()
    prompt: str = ""
    reference: Any = None
    responses: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """A JSON-friendly dict of this result (one line of a per-prompt results file)."""
        out = dataclasses.asdict(self)
        for key in ("scores", "errors", "responses"):
            out[key] = list(out[key])
        return out


@dataclass(frozen=True)
class EvalResult:
    """An evaluation: ``k``, ``n`` samples per prompt, ``pass_at_k`` and ``mean_at_k`` (means over prompts),
    ``failures`` (samples the reward could not score, over all prompts) and the per-prompt ``prompts``."""

    k: int
    n: int
    pass_at_k: float
    mean_at_k: float
    failures: int
    prompts: tuple[PromptResult, ...]

    def metrics(self) -> dict[str, float | int]:
        """``{"pass@k": .., "mean@k": .., "failures": ..}`` with ``k`` written out (``"pass@4"``)."""
        return {f"pass@{self.k}": self.pass_at_k, f"mean@{self.k}": self.mean_at_k, "failures": self.failures}


def summarize(scores: Sequence[Sequence[float | RewardResult]], k: int, *, threshold: float = 1.0,
              prompts: Sequence[str] | None = None, references: Sequence[Any] | None = None,
              responses: Sequence[Sequence[str]] | None = None) -> EvalResult:
    """pass@k and mean@k of per-prompt sample scores.

    ``scores[i]``: the ``n`` scores of prompt ``i`` (every prompt the same ``n >= k``), each a real number or a
    :class:`~rlblocks.reward.RewardResult` (an error result counts as a failure that scores 0). ``prompts``,
    ``references``, ``responses`` (optional, one per prompt) are copied into the :class:`PromptResult` s.
    NaN or infinite scores are refused (a reward that produced one is broken, and the mean would hide it).
    """
    k = check_int("k", k, minimum=1)
    threshold = check_real("threshold", threshold, finite=True)
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or not scores:
        raise ArgumentError(f"scores: expected a non-empty list of per-prompt score lists, got {scores!r:.80}")
    for name, extra in (("prompts", prompts), ("references", references), ("responses", responses)):
        if extra is not None and len(extra) != len(scores):
            raise ArgumentError(f"{name}: expected one per prompt ({len(scores)}), got {len(extra)}")
    n = None
    out = []
    for i, row in enumerate(scores):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ArgumentError(f"scores[{i}]: expected a list of sample scores, got {type(row).__name__}")
        if n is None:
            n = len(row)
            if n < k:
                raise ArgumentError(f"scores[{i}]: expected at least k = {k} samples per prompt, got {n}")
        elif len(row) != n:
            raise ArgumentError(f"scores[{i}]: expected {n} samples (as for prompt 0), got {len(row)}")
        vals, errors = [], []
        for j, s in enumerate(row):
            if isinstance(s, RewardResult):
                if not s.ok:
                    errors.append(s.error)
                    vals.append(0.0)
                    continue
                s = s.score
            vals.append(check_real(f"scores[{i}][{j}]", s, finite=True))
        correct = sum(v >= threshold for v in vals)
        out.append(PromptResult(
            index=i, scores=tuple(vals), correct=correct, pass_at_k=pass_at_k(n, correct, k),
            mean=math.fsum(vals) / n, failures=len(errors), errors=tuple(errors),
            prompt=prompts[i] if prompts is not None else "",
            reference=references[i] if references is not None else None,
            responses=tuple(responses[i]) if responses is not None else ()))
    return EvalResult(k=k, n=n, pass_at_k=math.fsum(p.pass_at_k for p in out) / len(out),
                      mean_at_k=math.fsum(p.mean for p in out) / len(out),
                      failures=sum(p.failures for p in out), prompts=tuple(out))


async def evaluate(engine: Any, prompt_ids: Sequence[Sequence[int]], references: Sequence[Any], reward: Any,
                   tokenizer: Any, *, k: int = 1, n: int | None = None, sampling: Any = None,
                   prompts: Sequence[str] | None = None, metadata: Sequence[Mapping[str, Any]] | None = None,
                   threshold: float = 1.0, seed: int = 0,
                   max_concurrency: int = 1024, tag: str = "eval",
                   decode: Callable[[list[int]], str] | None = None) -> EvalResult:
    """Sample ``n`` (default ``k``) completions of each prompt from ``engine``, score them, summarise.

    Args:
        engine: a rollout engine (``await engine.generate(GenerationRequest)``: TorchEngine, VLLMEngine, ...).
        prompt_ids: the prompts' token ids, as the engine gets them.
        references: one per prompt: what the reward checks against (``Sample.reference``).
        reward: an object with ``await reward.ascore(samples) -> list[RewardResult]`` (a
            :class:`~rlblocks.reward.RewardPool`), or anything a ``RewardPool`` takes (an async
            :class:`~rlblocks.reward.RewardFn`; a synchronous function runs in worker processes), which is then
            wrapped in a pool for this call.
        tokenizer: decodes each completion (``decode(ids, skip_special_tokens=True)``) unless ``decode`` is given.
        k: pass@k / mean@k.
        n: samples per prompt (``>= k``; default ``k``).
        sampling: :class:`~rlblocks.rollout.SamplingParams` (default: greedy, 64 new tokens). Sample ``j`` of
            prompt ``i`` is requested with seed ``seed + i·n + j`` (or ``sampling.seed + i·n + j`` when that is
            set), so an evaluation repeats exactly and draws nothing from the engine's own random source.
        prompts: the prompts' texts (``Sample.prompt``: a reward model scores prompt + response).
        metadata: one mapping per prompt, passed to the reward in ``Sample.metadata`` (with ``finish_reason``).
        threshold: a sample is correct when its score is at least this.
        max_concurrency: requests in flight at once.
        tag: prefix of the request ids (``f"{tag}-{i}-{j}"``).

    Each :class:`~rlblocks.reward.Sample` carries ``response_len`` (tokens) and ``metadata["finish_reason"]``
    (``"stop"``, ``"length"``, ...), so a reward can refuse a response the length budget cut.
    """
    from rlblocks.reward.pool import RewardPool
    from rlblocks.rollout import GenerationRequest, SamplingParams

    k = check_int("k", k, minimum=1)
    n = k if n is None else check_int("n", n, minimum=1)
    if n < k:
        raise ArgumentError(f"n: expected at least k = {k} samples per prompt, got {n}")
    seed = check_int("seed", seed)
    max_concurrency = check_int("max_concurrency", max_concurrency, minimum=1)
    if len(references) != len(prompt_ids) or not prompt_ids:
        raise ArgumentError(f"references: expected one per prompt ({len(prompt_ids)} prompts, at least one), "
                            f"got {len(references)}")
    for name, extra in (("prompts", prompts), ("metadata", metadata)):
        if extra is not None and len(extra) != len(prompt_ids):
            raise ArgumentError(f"{name}: expected one per prompt ({len(prompt_ids)}), got {len(extra)}")
    sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ArgumentError(f"sampling: expected a rlblocks.rollout.SamplingParams, got {type(sampling).__name__}")
    if decode is None:
        if tokenizer is None:
            raise ArgumentError("tokenizer: expected a tokenizer (or decode=) to turn completions into text")
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    base = sampling.seed if sampling.seed is not None else seed
    gate = asyncio.Semaphore(max_concurrency)

    async def one(i: int, j: int):
        req = GenerationRequest(f"{tag}-{i}-{j}", list(prompt_ids[i]),
                                dataclasses.replace(sampling, seed=base + i * n + j))
        async with gate:
            return await engine.generate(req)

    gens = await asyncio.gather(*[one(i, j) for i in range(len(prompt_ids)) for j in range(n)])
    texts = [decode(list(g.output_ids)) for g in gens]
    samples = [Sample(texts[i * n + j], reference=references[i], prompt=prompts[i] if prompts is not None else "",
                      response_len=len(gens[i * n + j].output_ids),
                      metadata={**(metadata[i] if metadata is not None else {}),
                                "finish_reason": gens[i * n + j].finish_reason})
               for i in range(len(prompt_ids)) for j in range(n)]
    if hasattr(reward, "ascore"):
        results = await reward.ascore(samples)
    else:
        pool = RewardPool(reward, max_concurrency=min(max_concurrency, 256))
        try:
            results = await pool.ascore(samples)
        finally:
            await pool.aclose()
    if len(results) != len(samples):
        raise ArgumentError(f"reward: expected one result per sample ({len(samples)}), got {len(results)}")
    rows = [list(results[i * n:(i + 1) * n]) for i in range(len(prompt_ids))]
    return summarize(rows, k, threshold=threshold, prompts=prompts, references=references,
                     responses=[texts[i * n:(i + 1) * n] for i in range(len(prompt_ids))])
