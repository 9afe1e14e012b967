"""Prompts and verifiable rewards for the cookbook loops: the toy addition task or a JSONL file of your own.

A loop asks for a :class:`Task` (its training prompts and its held-out prompts, already tokenised) and a
:class:`Verifier` (a score per response), and evaluates with :func:`greedy_accuracy`::

    task = data.load_task(tokenizer, prompts=cfg.prompts)           # "" -> the toy task of cookbook/toy.py
    verifier = data.make_verifier(cfg.reward, tokenizer)            # "verifier": exact match, "math": math_reward
    item = rng.choice(task.train)                                   # a Prompt: .ids, .text, .answer
    rewards = await verifier.scores([item] * K, [g.output_ids for g in gens])

JSONL format (``--prompts PATH``): one object per line with ``"prompt"`` (str) and ``"answer"`` (str or number);
blank lines are skipped, any other line that is not such an object is refused with its line number. The answer is
what ``math_reward`` compares against: a number, a LaTeX expression, a GSM8K answer field (the rationale then
``#### 72``) or a MATH solution with a ``\\boxed{}``. Other keys are kept in ``Prompt.metadata``. A GSM8K or MATH
file becomes this format with one line of ``jq``: ``jq -c '{prompt: .question, answer: .answer}'`` (GSM8K) or
``jq -c '{prompt: .problem, answer: .solution}'`` (MATH).

Prompt tokens: with ``chat=True`` and a tokenizer that has a chat template, the prompt is the user turn of
``apply_chat_template(..., add_generation_prompt=True)``; otherwise BOS (when the tokenizer has one) followed by
the prompt's tokens, which is exactly the toy task's ``toy.encode_prompt``.

Scores:

- ``"verifier"``: 1.0 iff the response ends with EOS (was not cut by the length budget) and its text (special
  tokens removed, spaces removed, stripped) equals the answer's text; else 0.0. On the toy task this is
  ``toy.reward``.
- ``"math"``: ``rlblocks.reward.math_reward`` (final answer: the last ``\\boxed{}``, else the last number; checked
  with math-verify in killable worker processes) through a :class:`~rlblocks.reward.RewardPool` (bounded
  concurrency, input order, a timeout that never stalls the loop, one retry on a fresh worker). A check that still
  fails (timeout, crash, a reference math-verify cannot parse) is ``None``, never a 0.0, counted in
  :attr:`Verifier.failures`; :meth:`Verifier.group_scores` fails its whole group (a group baseline without it
  would be biased), counted in ``groups_failed``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import toy

from rlblocks.errors import ArgumentError

REWARDS = ("verifier", "math")
HELDOUT_MAX = 500  # a JSONL file without --eval-prompts: this many prompts (or a tenth of the file) are held out
SPLIT_SEED = 1234


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, its reference answer, its token ids (as the engine gets them), and whatever else the
    JSONL line held (``metadata``; the toy task stores its ``(a, b)`` there)."""

    text: str
    answer: str
    ids: tuple[int, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class Task:
    """Training prompts (``train``) and held-out prompts (``heldout``: evaluation only), and where they came from."""

    train: list[Prompt]
    heldout: list[Prompt]
    source: str


def encode(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Prompt token ids: the chat template's user turn (``chat=True`` and the tokenizer has a template), else BOS
    (when the tokenizer has one) followed by the text's tokens (``toy.encode_prompt`` for a toy prompt)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    body = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(body)


def read_jsonl(path: str | os.PathLike, *, flag: str = "--prompts") -> list[dict[str, Any]]:
    """The objects of a JSONL prompt file, each with a str ``prompt`` and a str-or-number ``answer`` (the answer is
    returned as a str). Raises :class:`ArgumentError` naming ``flag``, the line and what it held."""
    p = Path(path)
    if not p.is_file():
        raise ArgumentError(f"{flag}: expected a JSONL file, got {str(path)!r} (no such file)")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ArgumentError(f"{flag}: {p}:{n}: expected a JSON object, got {line[:80]!r} ({e.msg})") from None
        ok = (isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]
              and isinstance(obj.get("answer"), (str, int, float)) and not isinstance(obj.get("answer"), bool))
        if not ok:
            raise ArgumentError(f"{flag}: {p}:{n}: expected an object with a non-empty str 'prompt' and a str or "
                                f"number 'answer', got {line[:120]!r}")
        rows.append({**obj, "answer": str(obj["answer"])})
    if not rows:
        raise ArgumentError(f"{flag}: expected at least one prompt in {p}, got an empty file")
    return rows


def _prompts(tokenizer, rows: list[dict[str, Any]], chat: bool) -> list[Prompt]:
    return [Prompt(r["prompt"], r["answer"], tuple(encode(tokenizer, r["prompt"], chat=chat)),
                   {k: v for k, v in r.items() if k not in ("prompt", "answer")}) for r in rows]


def toy_prompts(tokenizer, pairs: Sequence[tuple[int, int]]) -> list[Prompt]:
    """The toy task's ``(a, b)`` pairs as prompts ``"a+b="`` with answer ``str(a + b)``."""
    return [Prompt(toy.prompt_text(a, b), toy.answer_text(a, b), tuple(toy.encode_prompt(tokenizer, a, b)),
                   {"pair": (a, b)}) for a, b in pairs]


def load_task(tokenizer, *, prompts: str = "", eval_prompts: str = "", chat: bool = True) -> Task:
    """The toy task (``prompts=""``: RL pairs to train, the 500 held-out pairs to evaluate, as in ``toy``), or
    the prompts of a JSONL file. Held-out prompts of a file: ``eval_prompts`` (a second JSONL file) when given,
    else ``min(500, n // 10)`` prompts taken out of ``prompts`` by a fixed-seed shuffle (at least one, and at
    least one left to train on)."""
    if not prompts:
        if eval_prompts:
            raise ArgumentError("--eval-prompts: held-out prompts of a --prompts file; the toy task has its own")
        split = toy.split_pairs()
        return Task(toy_prompts(tokenizer, split["rl"]), toy_prompts(tokenizer, split["heldout"]), "toy")
    rows = read_jsonl(prompts)
    if eval_prompts:
        held = read_jsonl(eval_prompts, flag="--eval-prompts")
    else:
        if len(rows) < 2:
            raise ArgumentError(f"--prompts: expected at least 2 prompts (one to train, one held out) without "
                                f"--eval-prompts, got {len(rows)} in {prompts}")
        order = list(range(len(rows)))
        random.Random(SPLIT_SEED).shuffle(order)
        k = max(1, min(HELDOUT_MAX, len(rows) // 10))
        held, rows = [rows[i] for i in order[:k]], [rows[i] for i in sorted(order[k:])]
    return Task(_prompts(tokenizer, rows, chat), _prompts(tokenizer, held, chat), str(prompts))


def check_fits(task: Task, max_model_len: int, flag: str = "--prompts") -> None:
    """Refuse a prompt that leaves no room for a response token in the engine (``len(ids) >= max_model_len``)."""
    for name, items in (("train", task.train), ("heldout", task.heldout)):
        for i, p in enumerate(items):
            if len(p.ids) >= max_model_len:
                raise ArgumentError(f"{flag}: {name} prompt {i} has {len(p.ids)} tokens, expected fewer than the "
                                    f"engine's {max_model_len} positions (raise --max-model-len or shorten it): "
                                    f"{p.text[:80]!r}")


# ------------------------------------------------------------------------------------------------ verifiers
class Verifier:
    """A score per response: ``await verifier.scores(prompts, output_ids)`` (one float per response, in order, or
    ``None`` for a check that failed), ``await verifier.group_scores(prompts, output_ids, group_size)`` (groups of
    ``group_size`` consecutive responses, a group with a failed check failed whole).

    ``kind="verifier"``: exact match of the text (see the module docstring). ``kind="math"``: ``math_reward``
    through a :class:`~rlblocks.reward.RewardPool` of ``max_concurrency`` calls, each bounded by ``timeout``
    seconds and retried once (a crashed or hung worker is replaced); a check that still fails is an error, never a
    score of 0, and adds to ``failures``. ``close()`` stops the pool and the verifier's worker processes
    (idempotent)."""

    def __init__(self, kind: str, tokenizer, *, max_concurrency: int = 64, timeout: float = 30.0) -> None:
        if kind not in REWARDS:
            raise ArgumentError(f"--reward: expected one of {REWARDS} for a verifier, got {kind!r}")
        self.kind = kind
        self.tok = tokenizer
        self.failures = 0
        self.groups_failed = 0
        self.pool = None
        if kind == "math":
            from rlblocks.reward import RewardPool, math_reward

            self._math = math_reward
            self.pool = RewardPool(math_reward, max_concurrency=max_concurrency, timeout=timeout, retries=1)

    def text(self, output_ids: Sequence[int]) -> str:
        return self.tok.decode(list(output_ids), skip_special_tokens=True)

    async def scores(self, prompts: Sequence[Prompt], output_ids: Sequence[Sequence[int]]) -> list[float]:
        if len(prompts) != len(output_ids):
            raise ArgumentError(f"output_ids: expected one response per prompt ({len(prompts)}), "
                                f"got {len(output_ids)}")
        eos = self.tok.eos_token_id
        if self.kind == "verifier":
            out = []
            for p, ids in zip(prompts, output_ids):
                ends = bool(ids) and ids[-1] == eos
                out.append(float(ends and self.text(ids).replace(" ", "").strip() == p.answer.replace(" ", "")))
            return out
        from rlblocks.reward import Sample

        samples = [Sample(self.text(ids), reference=p.answer, prompt=p.text, response_len=len(ids))
                   for p, ids in zip(prompts, output_ids)]
        results = await self.pool.ascore(samples)
        self.failures += sum(1 for r in results if not r.ok)
        return [r.score if r.ok else None for r in results]

    async def group_scores(self, prompts: Sequence[Prompt], output_ids: Sequence[Sequence[int]],
                           group_size: int) -> tuple[list[float], list[bool]]:
        """``(scores, keep)`` for responses in groups of ``group_size`` consecutive ones (the samples of one
        prompt): a group with a failed check is failed whole (``keep`` False for each of its responses, their
        scores 0.0 as placeholders that must not be trained on; counted in ``groups_failed``), so that no group's
        baseline is computed without one of its samples or with a failed one read as 0."""
        if group_size < 1 or len(output_ids) % group_size:
            raise ArgumentError(f"group_size: expected a divisor of the {len(output_ids)} responses, got "
                                f"{group_size}")
        raw = await self.scores(prompts, output_ids)
        keep = []
        for g in range(0, len(raw), group_size):
            ok = all(v is not None for v in raw[g:g + group_size])
            keep += [ok] * group_size
            self.groups_failed += not ok
        return [v if k else 0.0 for v, k in zip(raw, keep)], keep

    def stats(self) -> dict[str, Any]:
        """``failures`` (checks that returned an error), ``groups_failed`` (groups failed whole for them) and, for
        ``math``, the pool's counters."""
        return {"failures": self.failures, "groups_failed": self.groups_failed,
                **({"pool": self.pool.stats()} if self.pool is not None else {})}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self._math.close()


def make_verifier(kind: str, tokenizer, **kwargs: Any) -> Verifier:
    """A :class:`Verifier` for ``--reward verifier|math``."""
    return Verifier(kind, tokenizer, **kwargs)


# ------------------------------------------------------------------------------------------------ evaluation
async def greedy_outputs(engine, prompts: Sequence[Prompt], *, max_new_tokens: int, eos: int,
                         tag: str = "eval") -> list[list[int]]:
    """Greedy completions (temperature 0, stop at EOS) of ``prompts`` from a rollout engine, in order."""
    import asyncio

    from rlblocks.rollout import GenerationRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(eos,))
    gens = await asyncio.gather(*[engine.generate(GenerationRequest(f"{tag}-{i}", list(p.ids), sp))
                                  for i, p in enumerate(prompts)])
    return [list(g.output_ids) for g in gens]


async def greedy_accuracy(engine, prompts: Sequence[Prompt], verifier: Verifier, *, max_new_tokens: int,
                          tag: str = "eval") -> float:
    """Mean verifier score of the engine's greedy completions of ``prompts`` (held-out accuracy), over the
    completions whose check did not fail (the failures are counted in ``verifier.failures``)."""
    outs = await greedy_outputs(engine, prompts, max_new_tokens=max_new_tokens, eos=verifier.tok.eos_token_id,
                                tag=tag)
    scores = [s for s in await verifier.scores(prompts, outs) if s is not None]
    return sum(scores) / max(len(scores), 1)
