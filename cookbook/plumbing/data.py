"""Your prompts for every loop: ``--prompts FILE`` (JSONL, Parquet or an HF ``datasets`` directory), the fields
named by flags, the chat template from the tokenizer, held-out prompts.

Every loop's ``Config`` inherits :class:`TaskFlags` (:class:`DataFlags`, :class:`~.rewards.RewardFlags` and
:class:`~.tracking.LogFlags`), so the same flags mean the same thing everywhere::

    --prompts gsm8k.jsonl --prompt-field question --answer-field answer --reward math
    --prompts data/train.parquet --prompt-field prompt --answer-field reward_model.ground_truth   # verl's layout
    --prompts ./gsm8k_saved --split train --eval-split test                                      # save_to_disk

Formats (``--prompts``, ``--eval-prompts``): JSONL (one object per line; blank lines skipped; any other line
refused with its number), Parquet, or a ``save_to_disk`` directory (a ``Dataset``, or a ``DatasetDict``'s
``--split`` / ``--eval-split``).

Fields: ``--prompt-field`` holds the prompt, a non-empty string or a list of chat messages (``{"role",
"content"}``, verl's layout); ``--answer-field`` holds the reference the reward checks (``math``: a number, a LaTeX
expression, GSM8K's rationale ending in ``#### 72``, a MATH solution with a ``\\boxed{}``; ``code``: a list of
tests, or ``{"inputs": [...], "outputs": [...]}``, or either as a JSON string); a dotted name reads a nested field
(``reward_model.ground_truth``). Every other field is kept in ``Prompt.metadata``. A row without the fields is
refused, naming the flag and the row.

Prompt tokens: with ``--chat`` (the default) and a tokenizer that has a chat template, the messages (a string
prompt is one user message) through ``apply_chat_template(..., add_generation_prompt=True)``; otherwise BOS (when
the tokenizer has one) followed by the text's tokens, which is exactly ``toy.encode_prompt`` for a toy prompt. A
prompt whose tokens contain the tokenizer's unknown token is refused (the tiny demo tokenizers know a few
characters only: give ``--model`` a checkpoint whose tokenizer covers your text).

reasoning-gym (``--prompts 'rg:NAME?key=value&...'``, ``cookbook/rgym.py``): generated items with their own
verifier (``--reward rg``), asked for in ``--answer-format``; held-out items never share a question with training.

Held-out prompts: ``--eval-prompts`` when given; else the ``--eval-split`` of a ``DatasetDict`` given to
``--prompts`` when it has one; else ``min(500, n // 10)`` rows taken out of ``--prompts`` by a fixed-seed shuffle
(at least one, and at least one left to train on). Without ``--prompts`` a loop trains its own toy task.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rgym

from rlblocks.errors import ArgumentError

from .export import ExportFlags, check_export_flags
from .flags import opt
from .rewards import RewardFlags, check_reward_flags
from .tracking import LogFlags, parse_log_flag

HELDOUT_MAX = 500
SPLIT_SEED = 1234


@dataclass
class DataFlags:
    """The data flags every loop shares (a loop's ``Config`` inherits them)."""

    prompts: str = opt("", "training prompts: a JSONL file, a Parquet file, an HF datasets directory "
                           "(save_to_disk), or a reasoning-gym dataset 'rg:NAME?key=value&...' (cookbook/rgym.py); "
                           "empty: the loop's toy task")
    eval_prompts: str = opt("", "held-out prompts (same formats); empty with --prompts: the --eval-split of a "
                                "DatasetDict, the held-out items of an rg: spec, else a tenth of --prompts (at most "
                                "500)")
    prompt_field: str = opt("prompt", "field holding the prompt (a str or a list of chat messages); a dotted name "
                                      "reads a nested field")
    answer_field: str = opt("answer", "field holding the reference the reward checks (a number, LaTeX, GSM8K's "
                                      "'#### 72', code tests); a dotted name reads a nested field")
    split: str = opt("train", "split of a DatasetDict directory given to --prompts")
    eval_split: str = opt("test", "split of a DatasetDict directory given to --eval-prompts (or to --prompts)")
    chat: bool = opt(True, "render prompts with the tokenizer's chat template when it has one (else BOS + text)")
    answer_format: str = opt("answer", "rg: prompts: the answer format asked for, which --reward rg extracts: "
                                       "reasoning-gym's <answer>...</answer> tags, or \\boxed{}", rgym.FORMATS)
    rg_system: str = opt("direct", "rg: prompts with --answer-format answer: the system prompt, a key of "
                                   "reasoning_gym.utils.SYSTEM_PROMPTS (direct, simple, default, ...)")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (the last user message of a chat prompt), the reference its reward checks, its token
    ids as the engine gets them, its chat messages, and the row's other fields (``metadata``; a toy task stores
    its operands there)."""

    text: str
    reference: Any
    ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class Task:
    """Training prompts (``train``) and held-out prompts (``heldout``, evaluation only), where they came from
    (``source``; ``heldout_source``, the ``--eval-prompts`` file when given), and how a training prompt is drawn
    (``sampler(rng)``; default ``rng.choice(train)``)."""

    train: list[Prompt]
    heldout: list[Prompt]
    source: str
    sampler: Callable[[random.Random], Prompt] | None = None
    heldout_source: str = ""  # where the held-out prompts came from (--eval-prompts when given); empty: source

    def __post_init__(self) -> None:
        self.heldout_source = self.heldout_source or self.source

    def draw(self, rng: random.Random) -> Prompt:
        return self.sampler(rng) if self.sampler is not None else rng.choice(self.train)


def check_data_flags(cfg: Any) -> None:
    """Flag combinations refused before anything is loaded."""
    if cfg.eval_prompts and not cfg.prompts:
        raise ArgumentError("--eval-prompts: held-out prompts of a --prompts file; the toy task has its own")
    if cfg.eval_prompts and rgym.is_spec(cfg.eval_prompts) != rgym.is_spec(cfg.prompts):
        raise ArgumentError(f"--eval-prompts: an rg: spec goes with --prompts rg:... (its training items are "
                            f"deduplicated against the held-out ones), and a file with a file; got --prompts "
                            f"{cfg.prompts!r} and --eval-prompts {cfg.eval_prompts!r}")
    for name in ("prompts", "eval_prompts"):
        path = getattr(cfg, name)
        if rgym.is_spec(path):
            rgym.parse_spec(path, "--" + name.replace("_", "-"))
            if name == "prompts":
                rgym.instruction(cfg.answer_format, cfg.rg_system)
        elif path and not Path(path).exists():
            raise ArgumentError(f"--{name.replace('_', '-')}: expected a JSONL or Parquet file or a datasets "
                                f"directory, got {path!r} (no such file or directory)")
    for name in ("prompt_field", "answer_field"):
        if not getattr(cfg, name).strip():
            raise ArgumentError(f"--{name.replace('_', '-')}: expected a field name, got an empty string")


# ------------------------------------------------------------------------------------------------ reading
def encode_prompt(tokenizer, prompt: str | Sequence[dict[str, Any]], *, chat: bool = True) -> list[int]:
    """Prompt token ids (see the module docstring): the chat template's rendering of the messages with the
    generation prompt, or BOS + the text's tokens."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if not isinstance(prompt, str):
        raise ArgumentError("--chat: a prompt of chat messages needs a tokenizer with a chat template (--model), "
                            "got " + ("--no-chat" if not chat else "a tokenizer without one"))
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(tokenizer.encode(prompt, add_special_tokens=False))


def read_rows(path: str, *, flag: str = "--prompts", split: str = "train",
              split_flag: str = "--split") -> list[tuple[str, dict[str, Any]]]:
    """The rows of a prompts file or directory as ``(where, row)`` pairs (``where``: ``file:line`` or
    ``source[row i]``, for error messages). Raises :class:`ArgumentError` naming ``flag``."""
    p = Path(path)
    if p.is_dir():
        return _read_datasets_dir(p, flag=flag, split=split, split_flag=split_flag)
    if not p.is_file():
        raise ArgumentError(f"{flag}: expected a JSONL or Parquet file or a datasets directory, got {path!r} "
                            f"(no such file or directory)")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{p}[row {i}]", r) for i, r in enumerate(pq.read_table(p).to_pylist())]
    else:
        rows = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ArgumentError(f"{flag}: {p}:{n}: expected a JSON object, got {line[:80]!r} ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ArgumentError(f"{flag}: {p}:{n}: expected a JSON object, got {line[:80]!r}")
            rows.append((f"{p}:{n}", obj))
    if not rows:
        raise ArgumentError(f"{flag}: expected at least one prompt in {p}, got none")
    return rows


def _is_dataset_dict(p: Path) -> bool:
    return (p / "dataset_dict.json").exists()


def _read_datasets_dir(p: Path, *, flag: str, split: str, split_flag: str) -> list[tuple[str, dict[str, Any]]]:
    if not (_is_dataset_dict(p) or (p / "dataset_info.json").exists()):
        raise ArgumentError(f"{flag}: expected a directory written by datasets' save_to_disk (dataset_info.json or "
                            f"dataset_dict.json inside), got {str(p)!r}")
    import datasets

    ds = datasets.load_from_disk(str(p))
    where = str(p)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ArgumentError(f"{split_flag}: expected one of the splits of {p} ({', '.join(ds)}), got {split!r}")
        ds, where = ds[split], f"{p}:{split}"
    rows = [(f"{where}[row {i}]", dict(r)) for i, r in enumerate(ds)]
    if not rows:
        raise ArgumentError(f"{flag}: expected at least one prompt in {where}, got none")
    return rows


def get_field(row: dict[str, Any], name: str) -> tuple[bool, Any]:
    """``(found, value)`` of field ``name`` of ``row``; a dotted name walks nested objects
    (``reward_model.ground_truth``). A key that itself contains the dots wins."""
    if name in row:
        return True, row[name]
    cur: Any = row
    for part in name.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _prompt_of(value: Any) -> tuple[str, tuple[dict[str, Any], ...]] | None:
    """``(text, messages)`` of a prompt field value, or None when it is not a prompt."""
    if isinstance(value, str):
        return (value, ({"role": "user", "content": value},)) if value.strip() else None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        users = [m["content"] for m in value if m["role"] == "user"]
        return (users[-1] if users else value[-1]["content"]), tuple(dict(m) for m in value)
    return None


def make_prompts(tokenizer, rows: list[tuple[str, dict[str, Any]]], *, prompt_field: str, answer_field: str,
                 chat: bool, needs_reference: bool, flag: str = "--prompts", encode_ids: bool = True) -> list[Prompt]:
    """:class:`Prompt` s from rows (see the module docstring); refused rows name ``flag``, the row and the field
    flag. ``encode_ids=False`` leaves ``ids`` empty (multi-turn loops render each turn themselves)."""
    out = []
    unk = getattr(tokenizer, "unk_token_id", None)
    for where, row in rows:
        found, value = get_field(row, prompt_field)
        prompt = _prompt_of(value) if found else None
        if prompt is None:
            got = f"{value!r:.80}" if found else f"no such field (fields: {', '.join(sorted(row))[:200]})"
            raise ArgumentError(f"--prompt-field: {flag} {where}: expected field {prompt_field!r} to hold a "
                                f"non-empty str or a list of {{'role', 'content'}} messages, got {got}")
        has_ref, ref = get_field(row, answer_field)
        if needs_reference and (not has_ref or ref is None):
            raise ArgumentError(f"--answer-field: {flag} {where}: expected field {answer_field!r} with the reference "
                                f"the reward checks, got {'null' if has_ref else 'no such field'} (fields: "
                                f"{', '.join(sorted(row))[:200]})")
        text, messages = prompt
        ids: tuple[int, ...] = ()
        if encode_ids:
            ids = tuple(encode_prompt(tokenizer, text if isinstance(value, str) else messages, chat=chat))
            if unk is not None and unk in ids:
                raise ArgumentError(f"{flag}: {where}: the prompt has characters the tokenizer does not know (its "
                                    f"unknown token {tokenizer.unk_token!r} appears); give --model a checkpoint "
                                    f"whose tokenizer covers the text: {text[:80]!r}")
        top = prompt_field.split(".")[0] if prompt_field not in row else prompt_field
        ref_top = answer_field.split(".")[0] if answer_field not in row else answer_field
        meta = {k: v for k, v in row.items() if k not in (top, ref_top)}
        out.append(Prompt(text, ref if has_ref else None, ids, messages, meta))
    return out


def load_task(tokenizer, cfg: Any, *, needs_reference: bool = True, encode_ids: bool = True) -> Task:
    """The task of a ``--prompts`` file (``cfg``: a loop's flags, :class:`DataFlags`), with its held-out prompts
    (see the module docstring)."""
    kw = {"prompt_field": cfg.prompt_field, "answer_field": cfg.answer_field, "chat": cfg.chat,
          "needs_reference": needs_reference, "encode_ids": encode_ids}
    if rgym.is_spec(cfg.prompts):
        return _rg_task(tokenizer, cfg, kw)
    rows = read_rows(cfg.prompts, split=cfg.split)
    if cfg.eval_prompts:
        held = read_rows(cfg.eval_prompts, flag="--eval-prompts", split=cfg.eval_split, split_flag="--eval-split")
    elif Path(cfg.prompts).is_dir() and _is_dataset_dict(Path(cfg.prompts)) and _has_split(cfg.prompts,
                                                                                             cfg.eval_split):
        held = read_rows(cfg.prompts, split=cfg.eval_split, split_flag="--eval-split")
    else:
        if len(rows) < 2:
            raise ArgumentError(f"--prompts: expected at least 2 prompts (one to train, one held out) without "
                                f"--eval-prompts, got {len(rows)} in {cfg.prompts}")
        order = list(range(len(rows)))
        random.Random(SPLIT_SEED).shuffle(order)
        k = max(1, min(HELDOUT_MAX, len(rows) // 10))
        held, rows = [rows[i] for i in order[:k]], [rows[i] for i in sorted(order[k:])]
    return Task(make_prompts(tokenizer, rows, **kw),
                make_prompts(tokenizer, held, flag="--eval-prompts" if cfg.eval_prompts else "--prompts", **kw),
                str(cfg.prompts), heldout_source=str(cfg.eval_prompts or cfg.prompts))


def _rg_task(tokenizer, cfg: Any, kw: dict[str, Any]) -> Task:
    """The task of ``--prompts rg:...`` (``cookbook/rgym.py``): disjoint training and held-out items."""
    train_spec = rgym.parse_spec(cfg.prompts)
    held_spec = rgym.parse_spec(cfg.eval_prompts, "--eval-prompts") if cfg.eval_prompts else None
    train, held, _dropped = rgym.split(train_spec, held_spec)
    chat = cfg.chat and bool(getattr(tokenizer, "chat_template", None))
    fmt = {"answer_format": cfg.answer_format, "system": cfg.rg_system, "chat": chat}
    kw = {**kw, "prompt_field": "prompt", "answer_field": "answer"}
    return Task(make_prompts(tokenizer, rgym.rows(train, where=cfg.prompts, **fmt), **kw),
                make_prompts(tokenizer, rgym.rows(held, where=cfg.eval_prompts or cfg.prompts, **fmt),
                             flag="--eval-prompts" if cfg.eval_prompts else "--prompts", **kw),
                str(cfg.prompts), heldout_source=str(cfg.eval_prompts or cfg.prompts))


def _has_split(path: str, split: str) -> bool:
    return split in json.loads((Path(path) / "dataset_dict.json").read_text()).get("splits", [])


def check_fits(task: Task, max_model_len: int, flag: str = "--prompts") -> None:
    """Refuse a prompt that leaves no room for a response token in the engine (``len(ids) >= max_model_len``)."""
    for name, items in (("train", task.train), ("heldout", task.heldout)):
        for i, p in enumerate(items):
            if len(p.ids) >= max_model_len:
                raise ArgumentError(f"{flag}: {name} prompt {i} has {len(p.ids)} tokens, expected fewer than the "
                                    f"engine's {max_model_len} positions (raise --max-model-len or shorten it): "
                                    f"{p.text[:80]!r}")


@dataclass
class TaskFlags(ExportFlags, LogFlags, RewardFlags, DataFlags):
    """What a loop trains and evaluates on, and where its metrics and trained policy go: :class:`DataFlags`,
    :class:`~.rewards.RewardFlags`, :class:`~.tracking.LogFlags`, :class:`~.export.ExportFlags` (a loop's
    ``Config`` inherits this)."""


def check_task_flags(cfg: Any, *, rm_built_here: bool = False) -> None:
    """:class:`TaskFlags`' values and combinations, refused before anything is loaded (``rm_built_here``: see
    :func:`~.rewards.check_reward_flags`)."""
    check_reward_flags(cfg, rm_built_here=rm_built_here)
    check_data_flags(cfg)
    parse_log_flag(cfg.log_to)
    check_export_flags(cfg)
