"""Pieces both cookbook loops share: flags from a dataclass, the policy's log-prob module, batch tensors, the GRPO
loss step (advantages, policy loss, mismatch correction, KL, globally normalised aggregation) and run files.

Everything here composes rlblocks blocks; nothing re-implements one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Float, Int
from torch import Tensor, nn

from rlblocks.kernels import linear_token_logprobs
from rlblocks.losses import (
    aggregate,
    cispo_loss,
    decoupled_ppo_loss,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    mismatch_metrics,
    ppo_clip_loss,
    rollout_correction,
)


# ------------------------------------------------------------------------------------------------ flags
def parse_flags(cls: type, argv: list[str] | None = None) -> Any:
    """Build an ``argparse`` parser from the fields of dataclass ``cls`` (``--field-name``; bools get
    ``--x/--no-x``; ``Literal``-like choices come from ``field.metadata["choices"]``) and return an instance."""
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        helptext = f.metadata.get("help", "")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helptext)
        else:
            parser.add_argument(
                flag, type=type(default), default=default, choices=f.metadata.get("choices"), help=helptext
            )
    ns = parser.parse_args(argv)
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def opt(default: Any, help: str = "", choices: tuple | None = None) -> Any:
    """A dataclass field with help text (and optional choices) for :func:`parse_flags`."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


# ------------------------------------------------------------------------------------------------ policy
class PolicyLogprobs(nn.Module):
    """Per-token log-probs of an HF causal LM through the fused ``linear_token_logprobs`` (no ``[N, V]`` logits).

    ``forward(input_ids [B, L], attention_mask [B, L], labels [B, L-1]) -> logp [B, L-1]`` where ``labels[:, t]``
    is the token at position ``t + 1`` or -100 (ignored: logp 0, no gradient). The LM head lives in this module, so
    under FSDP2 (``fully_shard`` on the decoder layers, then on this module) it is unsharded during ``forward``.
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = float(temperature)

    def forward(
        self, input_ids: Int[Tensor, "B L"], attention_mask: Int[Tensor, "B L"], labels: Int[Tensor, "B Lm1"]
    ) -> Float[Tensor, "B Lm1"]:
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        weight = self.lm.get_output_embeddings().weight
        return linear_token_logprobs(hidden, weight, labels, temperature=self.temperature)


def load_hf(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Tokenizer and causal LM from an HF checkpoint directory (local files only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return tok, model


# ------------------------------------------------------------------------------------------------ batches
def group_record(uid: str, pair: tuple[int, int], prompt_ids: list[int], gens: list, rewards: list[float],
                 rank: int) -> dict:
    """A finished prompt group as a plain, picklable dict (what travels from rollout to trainer and into the
    queue's checkpoint). ``version`` is the OLDEST token version of the group (the staleness key)."""
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
    """Right-padded tensors for a list of group records.

    Returns ``input_ids``/``attention_mask`` ``[B, L]``, and over the ``L-1`` next-token positions: ``labels``
    (response tokens, else -100), ``mask`` (bool), ``rollout_logp`` (engine logprobs, 0 elsewhere),
    ``versions`` (token versions, -1 elsewhere); per sequence: ``rewards``, ``group_ids`` (index of the group).
    """
    rows, resp = [], []
    for gi, g in enumerate(groups):
        for s in g["samples"]:
            rows.append((gi, g["prompt_ids"], s))
            resp.append(len(s["output_ids"]))
    width = max(len(p) + n for (_, p, _), n in zip(rows, resp))
    width = max(width, 2)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    labels = torch.full((b, width - 1), -100, dtype=torch.long)
    rlp = torch.zeros((b, width - 1), dtype=torch.float32)
    ver = torch.full((b, width - 1), -1, dtype=torch.long)
    for i, (_, p, s) in enumerate(rows):
        out = s["output_ids"]
        n_p, n_o = len(p), len(out)
        ids[i, : n_p + n_o] = torch.tensor(p + out)
        att[i, : n_p + n_o] = 1
        if n_o:
            labels[i, n_p - 1 : n_p - 1 + n_o] = torch.tensor(out)
            rlp[i, n_p - 1 : n_p - 1 + n_o] = torch.tensor(s["output_logprobs"], dtype=torch.float32)
            ver[i, n_p - 1 : n_p - 1 + n_o] = torch.tensor(s["output_versions"])
    out = {
        "input_ids": ids,
        "attention_mask": att,
        "labels": labels,
        "mask": labels != -100,
        "rollout_logp": rlp,
        "versions": ver,
        "rewards": torch.tensor([s["reward"] for _, _, s in rows], dtype=torch.float32),
        "group_ids": torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
    }
    return {k: v.to(device) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------ loss step
def all_reduce(x: Tensor, op=None, group=None) -> Tensor:
    """All-reduce (SUM by default) over ``group`` when torch.distributed is up with more than one member."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


def grpo_loss(
    cfg: Any,
    policy: nn.Module,
    batch: dict[str, Tensor],
    *,
    global_counts: dict[str, Tensor],
    prox_logp: Tensor | None = None,
    ref_policy: nn.Module | None = None,
    grad_scale: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    """One GRPO loss over this rank's share of the batch; returns ``(loss, metrics)`` with ``loss`` ready for
    ``backward`` (already scaled by ``grad_scale``, e.g. the FSDP world size that its mean-reduction divides by).

    - advantages: ``grpo_advantages(rewards, group_ids)`` (group σ, eps 1e-6); groups never straddle ranks.
    - ``prox_logp``: the trainer's log-probs before this update (π_prox). ``None`` means this is the only update on
      the batch, so π_prox = π_θ numerically and ``logp.detach()`` is used (no second forward).
    - policy loss ``cfg.loss``: ppo/gspo/cispo take ``old_logp = π_prox``; decoupled takes π_prox and the engine's
      behaviour log-probs.
    - ``cfg.correction``: tis (truncate ρ = π_prox/π_rollout at ``cfg.correction_cap``) or mis (mask tokens whose
      ρ leaves [1/cap, cap]) via ``rollout_correction``; weights multiply the per-token loss, the keep-mask masks it.
    - ``cfg.kl_coef > 0`` adds ``kl_coef · k3(π_θ ‖ π_ref)`` per token (``kl_estimate``).
    - aggregation: ``aggregate(mode=cfg.agg)`` with GLOBAL normalisers (token and sequence counts summed over the
      trainer ranks, max length maxed), so summing the ranks' losses gives the loss of the whole batch.
    """
    mask = batch["mask"]
    logp = policy(batch["input_ids"], batch["attention_mask"], batch["labels"])
    prox = logp.detach() if prox_logp is None else prox_logp
    adv = grpo_advantages(batch["rewards"], batch["group_ids"])
    behav = batch["rollout_logp"]
    if cfg.loss == "ppo":
        per_tok, m = ppo_clip_loss(logp, prox, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    elif cfg.loss == "gspo":
        per_tok, m = gspo_loss(logp, prox, adv, mask)
    elif cfg.loss == "cispo":
        per_tok, m = cispo_loss(logp, prox, adv, mask, eps_high=cfg.eps_high)
    elif cfg.loss == "decoupled":
        per_tok, m = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            behav_weight_cap=cfg.correction_cap,
        )
    else:
        raise ValueError(f"loss: expected ppo|gspo|cispo|decoupled, got {cfg.loss!r}")
    keep = mask
    metrics = {k: float(v) for k, v in m.items()}
    if cfg.correction != "none":
        mode = "truncate" if cfg.correction == "tis" else "mask"
        lower = None if mode == "truncate" else 1.0 / cfg.correction_cap
        w, keep, cm = rollout_correction(prox, behav, mask, level="token", mode=mode, upper=cfg.correction_cap,
                                         lower=lower)
        per_tok = per_tok * w
        metrics.update({f"correction_{k}": float(v) for k, v in cm.items()})
    if cfg.kl_coef > 0 and ref_policy is not None:
        with torch.no_grad():
            ref_logp = ref_policy(batch["input_ids"], batch["attention_mask"], batch["labels"])
        kl = kl_estimate(logp, ref_logp, kind="k3")
        per_tok = per_tok + cfg.kl_coef * torch.where(mask, kl, torch.zeros_like(kl))
        metrics["kl_ref_k3"] = float(torch.where(mask, kl, 0).sum() / mask.sum().clamp(min=1))
    loss = aggregate(
        per_tok,
        keep,
        mode=cfg.agg,
        num_tokens=global_counts["tokens"],
        num_seqs=global_counts["seqs"],
        max_len=global_counts["max_len"],
    )
    mm = mismatch_metrics(prox, behav, mask)
    metrics.update({f"mismatch_{k}": float(v) for k, v in mm.items()})
    metrics["loss"] = float(loss.detach())
    return loss * grad_scale, metrics


def global_counts(batch: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """Token count, sequence count and longest response over all trainer ranks (the aggregation normalisers)."""
    mask = batch["mask"]
    sums = torch.tensor([float(mask.sum()), float(mask.shape[0])], dtype=torch.float64)
    mx = torch.tensor([float(mask.sum(-1).max()) if mask.numel() else 0.0], dtype=torch.float64)
    all_reduce(sums, group=group)
    all_reduce(mx, op=dist.ReduceOp.MAX if dist.is_available() else None, group=group)
    dev = mask.device
    return {"tokens": sums[0].to(dev), "seqs": sums[1].to(dev), "max_len": mx[0].to(dev)}


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
