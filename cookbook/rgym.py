"""reasoning-gym tasks for every loop: ``--prompts 'rg:NAME?key=value&...'`` and ``--reward rg``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates seeded procedural problems, each with
its own verifier (``score_answer``). A spec names a dataset and its settings::

    --prompts 'rg:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&seed=1' --reward rg

Keys: every key but the two below goes to ``reasoning_gym.create_dataset(NAME, ...)`` (a value is read as JSON
when it parses, ``true``, ``2``, ``0.5``, else as a string; ``seed`` defaults to 0); ``size`` is the number of
training items (default 1000) and ``eval_size`` the number of held-out ones (default 200).

Split: one dataset of ``eval_size + size`` items is generated; items ``[0, eval_size)`` are held out, the rest are
for training, minus every item whose question text is also a held-out question (procedural generators repeat
small problems; different seeds alone would share items). With ``--eval-prompts rg:...`` the held-out items are the
first ``eval_size`` of that spec's dataset instead, and the training items are deduplicated against them the same
way. The two sets never share a question (:func:`split` checks it).

Prompts: with a chat template (``--chat``), a system message asking for the answer format and the question as the
user message; ``--answer-format answer`` asks with reasoning-gym's own system prompt ``--rg-system`` (a key of
``reasoning_gym.utils.SYSTEM_PROMPTS``: ``direct``, ``simple``, ``default``, ...), whose format is
``<answer>...</answer>``; ``--answer-format boxed`` asks for ``\\boxed{...}``. Without a chat template the two are
one text, instruction first.

Reward (``--reward rg``, :func:`score`): the answer extracted in the requested format (the last
``<answer>...</answer>``, reasoning-gym's ``extract_answer``; or the last ``\\boxed{}``), scored by the dataset's own
``score_answer(answer, entry)`` (reasoning-gym's scores are in [0, 1]; some give partial credit, e.g.
``basic_arithmetic`` scores an answer that contains the right one by the length ratio); 0.0 when the format is
missing. The held-out accuracy counts a sample correct at score 1 (``heldout_pass_at_k``); ``heldout_acc`` is the
mean score. ``--reward rg-exact`` (:func:`score_exact`): 1.0 only when that score is 1 (partial credit can be gamed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from rlblocks.errors import ArgumentError

PREFIX = "rg:"
FORMATS = ("answer", "boxed")
BOXED_SYSTEM = ("Answer the question. Give only the final answer, in the format \\boxed{answer}, with no "
                "explanation.")
DEFAULT_SIZE, DEFAULT_EVAL_SIZE = 1000, 200


def is_spec(value: str) -> bool:
    """Whether a ``--prompts`` / ``--eval-prompts`` value names a reasoning-gym dataset."""
    return isinstance(value, str) and value.startswith(PREFIX)


@dataclass(frozen=True)
class Spec:
    """A parsed ``rg:NAME?key=value&...``: the dataset name, its ``create_dataset`` settings (``seed`` included),
    the training ``size`` and the held-out ``eval_size``."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    size: int = DEFAULT_SIZE
    eval_size: int = DEFAULT_EVAL_SIZE


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(spec: str, flag: str = "--prompts") -> Spec:
    """Parse ``rg:NAME?key=value&...`` (see the module docstring); an unknown dataset or a bad count is refused
    naming ``flag``."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if not is_spec(spec):
        raise ArgumentError(f"{flag}: expected rg:NAME?key=value&..., got {spec!r}")
    name, _, query = spec[len(PREFIX):].partition("?")
    if name not in DATASETS:
        raise ArgumentError(f"{flag}: expected a reasoning-gym dataset name (e.g. basic_arithmetic, leg_counting), "
                            f"got {name!r}")
    settings = {k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))}
    counts = {}
    for key, default in (("size", DEFAULT_SIZE), ("eval_size", DEFAULT_EVAL_SIZE)):
        n = settings.pop(key, default)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ArgumentError(f"{flag}: {spec}: expected {key} to be an int >= 1, got {n!r}")
        counts[key] = n
    settings.setdefault("seed", 0)
    try:  # the settings are the dataset config's: a typo or a bad value is refused now, not mid-run
        reasoning_gym.create_dataset(name, size=1, **settings)
    except (TypeError, ValueError, AssertionError) as e:
        raise ArgumentError(f"{flag}: {spec}: reasoning-gym refused the settings {settings} ({e})") from None
    return Spec(name, settings, **counts)


def generate(spec: Spec, n: int) -> list[dict[str, Any]]:
    """The first ``n`` items of the spec's dataset (``question``, ``answer``, ``metadata``)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(spec.name, size=n, **spec.settings)
    return [ds[i] for i in range(n)]


def split(train: Spec, heldout: Spec | None = None) -> tuple[list[dict], list[dict], int]:
    """``(train items, held-out items, training items dropped as duplicates of held-out questions)`` (see the
    module docstring). The two lists share no question text (checked)."""
    if heldout is None:
        items = generate(train, train.eval_size + train.size)
        held, rest = items[:train.eval_size], items[train.eval_size:]
    else:
        held, rest = generate(heldout, heldout.eval_size), generate(train, train.size)
    questions = {e["question"] for e in held}
    kept = [e for e in rest if e["question"] not in questions]
    if not kept:
        raise ArgumentError(f"--prompts: every training item of rg:{train.name} is also held out (the dataset "
                            f"repeats its problems): widen its settings or lower eval_size")
    assert questions.isdisjoint(e["question"] for e in kept)
    return kept, held, len(rest) - len(kept)


def instruction(answer_format: str, system: str) -> str:
    """The system message asking for ``answer_format`` (``system``: a reasoning-gym system-prompt key, used with
    the ``answer`` format)."""
    if answer_format == "boxed":
        return BOXED_SYSTEM
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system not in SYSTEM_PROMPTS:
        raise ArgumentError(f"--rg-system: expected one of {', '.join(SYSTEM_PROMPTS)}, got {system!r}")
    return SYSTEM_PROMPTS[system]


def rows(items: list[dict], *, answer_format: str, system: str, chat: bool, where: str) -> list[tuple[str, dict]]:
    """Prompt rows (as ``data.read_rows`` returns them) of reasoning-gym items: ``prompt`` (chat messages, or one
    text without ``chat``), ``answer`` (the dataset's answer), ``rg_entry`` (the item, which :func:`score`
    reads) and ``answer_format``."""
    text = instruction(answer_format, system)
    out = []
    for i, e in enumerate(items):
        prompt: Any = ([{"role": "system", "content": text}, {"role": "user", "content": e["question"]}] if chat
                       else f"{text}\n\n{e['question']}")
        out.append((f"{where}[item {i}]", {"prompt": prompt, "answer": e["answer"], "rg_entry": e,
                                           "answer_format": answer_format}))
    return out


def extract(response: str, answer_format: str) -> str | None:
    """The answer in ``response`` in the requested format: the last ``<answer>...</answer>`` (reasoning-gym's
    ``extract_answer``) or the last ``\\boxed{}``; None when it is missing."""
    if answer_format == "boxed":
        from rlblocks.reward.math import extract_answer

        answer, source = extract_answer(response)
        return answer if source == "boxed" else None
    from reasoning_gym.utils import extract_answer

    return extract_answer(response, tag_name="answer")


def score(sample) -> Any:
    """``--reward rg``: ``score_answer`` of the item's own dataset on the extracted answer, 0.0 when the answer
    format is missing (``sample.metadata``: ``rg_entry``, ``answer_format``). Runs in the reward's worker
    processes."""
    from reasoning_gym import get_score_answer_fn

    from rlblocks.reward import RewardResult

    entry = sample.metadata.get("rg_entry")
    if not isinstance(entry, dict):
        return RewardResult(None, error="--reward rg: expected a prompt from --prompts rg:... (metadata rg_entry), "
                                        "got none")
    fmt = sample.metadata.get("answer_format", "answer")
    answer = extract(sample.response, fmt)
    if answer is None:
        return RewardResult(0.0, details={"reason": f"no answer in the {fmt} format"})
    value = float(get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry))
    return RewardResult(value, details={"answer": answer})


def score_exact(sample) -> Any:
    """``--reward rg-exact``: 1.0 when :func:`score` is 1.0 (the dataset's verifier accepts the answer in the
    requested format in full), else 0.0; a failed call stays failed. Partial credit can be gamed: under
    ``basic_arithmetic``'s length ratio ``<answer>560</answer>`` for 56 earns 2/3 where a wrong two-digit guess
    earns 0, and a policy trained on it learns to pad its answers with digits."""
    result = score(sample)
    if result.score is None:
        return result
    return type(result)(float(result.score == 1.0), details={**result.details, "score_answer": result.score})
