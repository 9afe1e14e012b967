"""The held-out evaluation every loop runs: ``rlblocks.reward.evaluate`` on the held-out prompts, ``--eval-k``
samples each at ``--eval-temperature`` (greedy, one sample: the usual held-out accuracy), scored by the
``--eval-reward``.

Logged every ``--eval-every`` steps and before and after RL: ``heldout_acc`` (mean@k: with binary rewards the
fraction of samples that are right; greedy k = 1: the accuracy), ``heldout_pass_at_k`` (the unbiased pass@k) and
``heldout_failures`` (samples the reward could not score), and beside them ``heldout_last_number``: the fraction
of samples whose last number equals a numeric reference (:func:`last_number_accuracy`; what a lenient grader that
ignores the requested answer format would report; ``None`` when no reference is a number). The per-prompt results
of each evaluation go to ``runs/<name>/eval/step_<N>.jsonl`` (:meth:`RunFiles.write_eval`).

A loop whose trainer holds no engine (``grpo_async.py``'s trainer ranks) evaluates through :func:`on_model`: a
fresh ``TorchEngine`` over its HF model.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def eval_sampling(cfg: Any, max_new_tokens: int, eos: int):
    """The held-out sampling parameters: ``--eval-temperature``, ``max_new_tokens``, stop at ``eos``."""
    from rlblocks.rollout import SamplingParams

    return SamplingParams(temperature=cfg.eval_temperature, max_new_tokens=max_new_tokens, stop_token_ids=(eos,))


async def heldout(engine: Any, prompts: Sequence[Any], reward: Any, tok: Any, cfg: Any, *, max_new_tokens: int,
                  tag: str = "eval"):
    """The held-out evaluation of ``prompts`` (``Prompt`` s) on ``engine`` with ``reward`` (a :class:`Reward`):
    an ``rlblocks.reward.EvalResult``."""
    from rlblocks.reward import evaluate

    return await evaluate(engine, [list(p.ids) for p in prompts], [p.reference for p in prompts], reward, tok,
                          k=cfg.eval_k, sampling=eval_sampling(cfg, max_new_tokens, tok.eos_token_id),
                          prompts=[p.text for p in prompts], metadata=[p.metadata for p in prompts],
                          seed=cfg.seed, tag=tag)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (an optional minus, digits, an optional decimal part), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


def last_number_accuracy(result: Any) -> float | None:
    """Mean over the prompts whose reference is a number (``float(reference)`` parses) of the fraction of their
    samples whose :func:`last_number` equals it (to 1e-9); ``None`` when no reference is a number."""
    per_prompt = []
    for p in result.prompts:
        try:
            want = float(str(p.reference).strip())
        except ValueError:
            continue
        if not math.isfinite(want) or not p.responses:
            continue
        hits = [(got := last_number(r)) is not None and abs(got - want) <= 1e-9 for r in p.responses]
        per_prompt.append(sum(hits) / len(hits))
    return sum(per_prompt) / len(per_prompt) if per_prompt else None


def heldout_figures(result: Any) -> dict[str, Any]:
    """An evaluation's figures for ``summary.json`` (``heldout_before`` / ``heldout_after``): ``pass@k``,
    ``mean@k``, ``failures`` and ``last_number`` (:func:`last_number_accuracy`)."""
    return {**result.metrics(), "last_number": last_number_accuracy(result)}


def eval_metrics(result: Any) -> dict[str, Any]:
    """The logged keys of an evaluation (``None`` for each when there was none this step)."""
    if result is None:
        return {"heldout_acc": None, "heldout_pass_at_k": None, "heldout_failures": None,
                "heldout_last_number": None}
    return {"heldout_acc": result.mean_at_k, "heldout_pass_at_k": result.pass_at_k,
            "heldout_failures": result.failures, "heldout_last_number": last_number_accuracy(result)}


def on_model(model: Any, run: Callable[[Any], Awaitable[T]]) -> T:
    """``await run(engine)`` on a fresh ``TorchEngine`` over the HF model ``model`` (no prefix cache: the weights
    change between evaluations), from a thread without a running event loop; the model's train/eval mode is
    restored afterwards."""
    from rlblocks.rollout.engines import TorchEngine

    training = model.training

    async def main() -> T:
        # REAL MODEL: a trainer-side TorchEngine is the simple way to evaluate a model the rollout engines hold too;
        # a large model would evaluate on a rollout rank's engine instead (it has the weights already).
        # inline steps: this thread runs the trainer's torch ops too (one OpenMP team on a CPU)
        engine = TorchEngine(model, max_batch_size=1024, prefix_cache_size=0, inline_steps=True)
        try:
            return await run(engine)
        finally:
            await engine.aclose()

    try:
        return asyncio.run(main())
    finally:
        model.train(training)
