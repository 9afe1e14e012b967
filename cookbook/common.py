"""Plumbing both cookbook loops share: flags from a dataclass, the policy's log-prob module, batch tensors, the
policy-loss flags, engines, collectives and run files. The RL math itself (advantages, π_old, PPO epochs ×
mini-batches, loss, correction, KL, aggregation) is written out in each loop file's ``grpo_step``.

Everything here composes rlblocks blocks; nothing re-implements one. Lines a user changes for a real model or task
are marked ``REAL MODEL:`` in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from rlblocks._deprecate import warn_renamed
from rlblocks.errors import ArgumentError
from rlblocks.kernels import causal_lm_logprobs
from rlblocks.losses import cispo_loss, decoupled_ppo_loss, gspo_loss, ppo_clip_loss
from rlblocks.rollout import Generation, build_batch


# ------------------------------------------------------------------------------------------------ flags
def parse_flags(cls: type, argv: list[str] | None = None, check: Callable[[Any], None] | None = None) -> Any:
    """Build an ``argparse`` parser from the fields of dataclass ``cls`` and return an instance.

    Each field becomes ``--field-name`` (bools get ``--x/--no-x``; choices come from ``field.metadata["choices"]``;
    a field whose default is ``None`` takes its type from ``field.metadata["type"]``). Help texts are literal
    (a ``%`` is shown as is) and end with the default. A field's ``field.metadata["old_flags"]`` are its earlier
    spellings: hidden from ``--help``, they still set the field, with a DeprecationWarning (giving both an old and
    the new spelling is refused). ``check(cfg)`` may raise :class:`ArgumentError` for flag combinations; the parser
    then exits with status 2 and the message, like any other bad flag.
    """
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().splitlines()[0],
                                     formatter_class=_DefaultsHelp)
    old_flags: dict[str, tuple[str, str]] = {}  # argparse dest of an old spelling -> (old flag, field name)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        # argparse %-formats help strings (for %(default)s): escape the text's own percent signs
        helptext = f.metadata.get("help", "").replace("%", "%%")
        if isinstance(default, bool):
            kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            kw = {"type": f.metadata.get("type") or type(default), "choices": f.metadata.get("choices")}
        parser.add_argument(flag, default=default, help=helptext, **kw)
        for i, old in enumerate(f.metadata.get("old_flags") or ()):
            dest = f"_old_{i}_{f.name}"
            old_flags[dest] = (old, f.name)
            parser.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
    ns = parser.parse_args(argv)
    for dest, (old, name) in old_flags.items():
        if hasattr(ns, dest):
            new = "--" + name.replace("_", "-")
            if getattr(ns, name) != getattr(cls, name, None):
                parser.error(f"{old}: the deprecated spelling of {new}; give only {new}")
            warn_renamed(f"`{old}`", f"`{new}`")
            setattr(ns, name, getattr(ns, dest))
    cfg = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    if check is not None:
        try:
            check(cfg)
        except ArgumentError as e:
            parser.error(str(e))
    return cfg


class _DefaultsHelp(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the default is ``None`` (the help then says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is not None and action.default is not argparse.SUPPRESS and action.option_strings:
            text += " (default: %(default)s)"
        return text


def opt(default: Any, help: str = "", choices: tuple | None = None, type: type | None = None,
        old_flags: tuple[str, ...] = ()) -> Any:
    """A dataclass field with help text (and optional choices; ``type`` for a ``None`` default; ``old_flags``: its
    deprecated spellings, hidden) for :func:`parse_flags`."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "type": type,
                                                        "old_flags": old_flags})


# ------------------------------------------------------------------------------------------------ policy
class PolicyLogprobs(nn.Module):
    """Per-token log-probs of an HF causal LM through the library's ``causal_lm_logprobs`` (the fused
    ``linear_token_logprobs``: no ``[N, V]`` logits).

    ``forward(input_ids [B, L], attention_mask [B, L], labels [B, L-1]) -> logp [B, L-1]`` where ``labels[:, t]``
    is the token at position ``t + 1`` (``input_ids[:, t + 1]``, as :func:`batch_tensors` writes it) or -100
    (ignored: logp 0, no gradient). In ``causal_lm_logprobs``' terms every row's "prompt" is its first token and the
    scored positions are the labelled ones. The LM head lives in this module, so under FSDP2 (``fully_shard`` on the
    decoder layers, then on this module) it is unsharded during ``forward``.
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = float(temperature)

    def forward(
        self, input_ids: Int[Tensor, "B L"], attention_mask: Int[Tensor, "B L"], labels: Int[Tensor, "B Lm1"]
    ) -> Float[Tensor, "B Lm1"]:
        scored = labels != -100
        # the labels only say which positions to score: the tokens scored are input_ids' own (one host sync)
        if not torch.equal(torch.where(scored, labels, 0), torch.where(scored, input_ids[:, 1:], 0)):
            raise ArgumentError("labels: expected input_ids[:, t + 1] or -100 at every position t (the next-token "
                                "layout of batch_tensors), got other tokens")
        first = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        # REAL MODEL: causal_lm_logprobs finds the decoder body through get_decoder() (Llama/Qwen/Mistral-style HF
        # models, PEFT-wrapped or not); a vision-language or encoder-decoder model needs its own hidden states.
        return causal_lm_logprobs(self.lm, input_ids, first, scored, attention_mask=attention_mask,
                                  temperature=self.temperature)


def load_hf(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Tokenizer and causal LM from an HF checkpoint directory (local files only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # REAL MODEL: fp32 suits the tiny CPU demo. On GPUs load bf16 (``dtype=torch.bfloat16``) or keep fp32 master
    # weights and give ``fully_shard`` a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``.
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return tok, model


# ------------------------------------------------------------------------------------------------ batches
def group_record(uid: str, pair: tuple[int, int], prompt_ids: list[int], gens: list, rewards: list[float],
                 rank: int) -> dict:
    """A finished prompt group as a plain, picklable dict (what travels from rollout to trainer and into the
    queue's checkpoint). ``version`` is the OLDEST token version of the group (the staleness key)."""
    # REAL MODEL: ``pair`` is the toy task's (a, b), kept for inspection only; store your prompt's reference answer
    # or dataset index here (nothing in the trainer reads it).
    samples = [
        {
            "output_ids": list(g.output_ids),
            "output_logprobs": list(g.output_logprobs),
            "output_versions": list(g.output_versions),
            "finish_reason": g.finish_reason,
            "reward": float(r),
        }
        for g, r in zip(gens, rewards)
    ]
    versions = [v for s in samples for v in s["output_versions"]]
    return {
        "uid": uid,
        "pair": tuple(pair),
        "prompt_ids": list(prompt_ids),
        "samples": samples,
        "version": min(versions) if versions else 0,
        "rank": rank,
    }


def batch_tensors(groups: list[dict], pad_id: int, device: torch.device) -> dict[str, Tensor]:
    """Right-padded tensors for a list of group records, built by ``rlblocks.rollout.build_batch`` (one row per
    sample, every output token trained, group ``i`` of the list is group id ``i``), in the next-token layout the
    loops' log-prob module uses.

    Returns ``input_ids``/``attention_mask`` ``[B, L]`` (``L >= 2``), and over the ``L-1`` next-token positions:
    ``labels`` (response tokens, else -100), ``mask`` (bool), ``rollout_logp`` (engine logprobs, 0 elsewhere),
    ``versions`` (token versions, -1 elsewhere); per sequence: ``rewards``, ``group_ids`` (index of the group).
    Response token ``t`` of row ``b`` (``RolloutBatch``' ``[B, T]`` layout) sits at next-token position
    ``prompt_lens[b] − 1 + t``.
    """
    gens, gids, rewards = [], [], []
    for gi, g in enumerate(groups):
        for k, s in enumerate(g["samples"]):
            gens.append(Generation(f"{g['uid']}/{k}", list(g["prompt_ids"]), list(s["output_ids"]),
                                   list(s["output_logprobs"]), list(s["output_versions"]), s["finish_reason"]))
            gids.append(gi)
            rewards.append(s["reward"])
    rb = build_batch(gens, pad_id=pad_id, group_ids=gids, rewards=rewards)
    b, width = rb.input_ids.shape
    extra = max(0, 2 - width)  # at least one next-token position, even for one-token prompts with no output
    input_ids = torch.nn.functional.pad(rb.input_ids, (0, extra), value=pad_id)
    attention = torch.nn.functional.pad(rb.attention_mask, (0, extra)).long()
    width += extra
    # next-token position of each response token; padding slots go to a sink column (index width − 1), dropped
    t = torch.arange(rb.response_ids.shape[1])
    pos = torch.where(rb.response_mask, rb.prompt_lens[:, None] - 1 + t, width - 1)

    def to_positions(x: Tensor, fill) -> Tensor:
        out = torch.full((b, width), fill, dtype=x.dtype)
        return out.scatter_(1, pos, torch.where(rb.response_mask, x, fill))[:, :-1]

    labels = to_positions(rb.response_ids, -100)
    out = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "labels": labels,
        "mask": labels != -100,
        "rollout_logp": to_positions(rb.rollout_logp, 0.0),
        "versions": to_positions(rb.versions, -1),
        "rewards": rb.rewards,
        "group_ids": rb.group_ids,
    }
    return {k: v.to(device) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ loss flags
POLICY_LOSSES: dict[str, Callable] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "decoupled": decoupled_ppo_loss,
}
CORRECTION_CAP = 2.0  # --correction tis|mis without --correction-cap: ρ = π_old/π_rollout bounded by 2 (and 1/2)


def loss_defaults(arg: str) -> str:
    """``"ppo 0.2, gspo 0.0003, ..."``: the library's own default of ``arg`` for each policy loss (read from the
    signatures, so the flags' help texts cannot drift from the code)."""
    return ", ".join(f"{name} {inspect.signature(fn).parameters[arg].default:g}" for name, fn in POLICY_LOSSES.items())


def check_loss_flags(cfg: Any) -> None:
    """Refuse loss flags that would be ignored: ``rollout_weight_cap`` belongs to ``--loss decoupled`` only and
    ``correction_cap`` to ``--correction tis|mis`` only. Raises :class:`ArgumentError` naming the flag."""
    if cfg.loss not in POLICY_LOSSES:
        raise ArgumentError(f"--loss: expected one of {sorted(POLICY_LOSSES)}, got {cfg.loss!r}")
    if cfg.rollout_weight_cap is not None and cfg.loss != "decoupled":
        raise ArgumentError(f"--rollout-weight-cap: only --loss decoupled weights tokens by π_old/π_rollout, got "
                            f"--loss {cfg.loss}; use --correction tis|mis --correction-cap for the other losses")
    if cfg.correction_cap is not None and cfg.correction == "none":
        raise ArgumentError("--correction-cap: bounds --correction tis|mis, got --correction none")
    if cfg.correction_cap is not None and not cfg.correction_cap > 1.0:
        raise ArgumentError(f"--correction-cap: expected a float > 1 (the upper bound of π_old/π_rollout), "
                            f"got {cfg.correction_cap}")
    for name in ("ppo_epochs", "mini_batches"):
        if getattr(cfg, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}: expected an int >= 1, got {getattr(cfg, name)}")


def policy_loss(
    cfg: Any,
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Bool[Tensor, "B T"],
    *,
    rollout_logp: Float[Tensor, "B T"],
) -> tuple[Float[Tensor, "B T"], dict[str, Tensor]]:
    """Per-token loss of ``cfg.loss`` with the clip offsets ``cfg.eps_low``/``cfg.eps_high`` (when given; else the
    loss's own defaults), ratios ``exp(logp − old_logp)``. ``decoupled`` also takes the engine's log-probs
    (AReaL's behaviour policy) and ``cfg.rollout_weight_cap``. Returns ``(per_token_loss [B, T], metrics)``."""
    eps = {k: v for k in ("eps_low", "eps_high") if (v := getattr(cfg, k)) is not None}
    fn = POLICY_LOSSES[cfg.loss]
    if cfg.loss == "decoupled":
        return fn(logp, old_logp, advantages, mask, rollout_logp=rollout_logp, **eps,
                  rollout_weight_cap=cfg.rollout_weight_cap)
    return fn(logp, old_logp, advantages, mask, **eps)


# ------------------------------------------------------------------------------------------------ collectives
def all_reduce(x: Tensor, op=None, group=None) -> Tensor:
    """All-reduce (SUM by default) over ``group`` when torch.distributed is up with more than one member."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


def global_counts(mask: Bool[Tensor, "B T"], group=None) -> dict[str, Tensor]:
    """Token count, sequence count and longest response over all trainer ranks (the aggregation normalisers), so
    the ranks' losses add up to the loss of the whole (mini-)batch."""
    sums = torch.tensor([float(mask.sum()), float(mask.shape[0])], dtype=torch.float64)
    mx = torch.tensor([float(mask.sum(-1).max()) if mask.numel() else 0.0], dtype=torch.float64)
    all_reduce(sums, group=group)
    all_reduce(mx, op=dist.ReduceOp.MAX if dist.is_available() else None, group=group)
    dev = mask.device
    return {"tokens": sums[0].to(dev), "seqs": sums[1].to(dev), "max_len": mx[0].to(dev)}


def mean_metrics(records: list[dict[str, Tensor]]) -> dict[str, float]:
    """Mean of each metric over the optimizer updates of one step (one host sync per metric, after the step)."""
    keys = {k for r in records for k in r}
    return {k: float(torch.stack([torch.as_tensor(r[k], dtype=torch.float64) for r in records if k in r]).mean())
            for k in sorted(keys)}


# ------------------------------------------------------------------------------------------------ engines
def seed_rank(seed: int, rank: int) -> None:
    """Seed torch and Python's global ``random`` for this rank. The engines draw the sampling seed of every request
    that has none from the global ``random``, so without this a run of one seed does not repeat."""
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)


def prompts_per_rank(cfg: Any, world: int) -> int:
    """``--prompts-per-step`` split over ``world`` ranks, refused when it does not divide or leaves fewer samples
    per rank than ``--mini-batches``."""
    if cfg.prompts_per_step % world:
        raise ArgumentError(f"--prompts-per-step: expected a multiple of the world size {world}, "
                            f"got {cfg.prompts_per_step}")
    n_local = cfg.prompts_per_step // world
    if cfg.mini_batches > n_local * cfg.group_size:
        raise ArgumentError(f"--mini-batches: expected at most the samples per rank ({n_local * cfg.group_size}), "
                            f"got {cfg.mini_batches}")
    return n_local


def model_max_len(path: str) -> int:
    """The positions of the checkpoint at ``path`` (``max_position_embeddings`` of its HF config)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).max_position_embeddings)


def make_engine(kind: str, path: str, device: torch.device, *, max_model_len: int, max_staleness: int = 1,
                sglang_url: str = ""):
    """A rollout engine for ``--engine torch|vllm|sglang`` (create it inside the event loop that drives it).

    ``max_model_len`` (prompt + response) sizes the engines' KV cache; it must not exceed the model's positions.
    """
    if kind == "torch":
        from rlblocks.rollout import TorchEngine

        return TorchEngine.from_pretrained(path, device=device, max_batch_size=1024, max_model_len=max_model_len)
    if kind == "vllm":
        from rlblocks.rollout import VLLMEngine

        args: dict[str, Any] = {"max_model_len": max_model_len}
        if not torch.cuda.is_available():
            # REAL MODEL: 64 MiB of KV cache holds the tiny demo model's sequences; on CPU give a real model its
            # share of memory (GPU vLLM sizes the cache from gpu_memory_utilization instead).
            args.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20)
        return VLLMEngine.from_pretrained(path, max_staleness=max_staleness, **args)
    if kind == "sglang":
        from rlblocks.rollout import SGLangEngine

        return SGLangEngine(sglang_url)
    raise ArgumentError(f"--engine: expected torch|vllm|sglang, got {kind!r}")


def resolve_max_model_len(requested: int, path: str) -> int:
    """``--max-model-len``: 0 means the model's own positions; a larger value than those is refused."""
    positions = model_max_len(path)
    if requested < 0 or requested > positions:
        raise ArgumentError(f"--max-model-len: expected 0 (the model's {positions} positions) or 1..{positions} "
                            f"for {path}, got {requested}")
    return requested or positions


def length_budget(max_new_tokens: int, length_tail: float, room: int, rng: random.Random) -> int:
    """Response budget of one prompt group: ``max_new_tokens``, or (benchmark) a lognormal length with median
    ``length_tail`` and σ = ln(10)/2.326 = 0.99 (p99/p50 = 10); never more than ``room`` (= max_model_len − the
    prompt's length), so a sample always fits the engine."""
    n = max_new_tokens
    if length_tail > 0:
        n = max(max_new_tokens, round(rng.lognormvariate(math.log(length_tail), 0.99)))
    return max(1, min(n, room))


def until_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` up to and including the first ``eos`` (the engines may only stop there, but a benchmark without
    stop tokens keeps generating)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


# ------------------------------------------------------------------------------------------------ run files
class RunFiles:
    """``runs/<name>/``: ``metrics.jsonl`` (one JSON object per step, appended), ``summary.json``, ``ckpt.pt``."""

    def __init__(self, root: str, name: str) -> None:
        self.dir = Path(root) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self.dir / "metrics.jsonl"
        self.summary = self.dir / "summary.json"
        self.ckpt = self.dir / "ckpt.pt"

    def fresh(self) -> None:
        for p in (self.metrics, self.summary, self.ckpt):
            if p.exists():
                p.unlink()

    def log(self, record: dict) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")

    def write_summary(self, summary: dict) -> None:
        tmp = self.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
        os.replace(tmp, self.summary)

    def save(self, state: dict) -> None:
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Progress:
    """tqdm progress bar when installed, else a one-line text bar on stderr."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total, self.n, self.t0 = total, initial, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="grpo")
            except ImportError:
                self.bar = None

    def update(self, postfix: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
            self.bar.update(1)
        else:
            import sys

            done = int(30 * self.n / max(self.total, 1))
            tail = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} {tail}", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=__import__("sys").stderr)
