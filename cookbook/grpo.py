"""The GRPO update both GRPO loops run (``grpo_sync.py``, ``grpo_async.py``), read top to bottom.

One call of :func:`grpo_step` is one policy version: the whole update on this rank's share of a batch.

1. **Advantages** ``A_i = (r_i − mean_g r) / (std_g r + 1e-6)`` within each prompt group (``grpo_advantages``); a
   group never straddles trainer ranks, so these are the whole batch's advantages.
2. **π_old**, the trainer's log-probs before the first update, computed once (no grad) and fixed for every epoch:
   the ratio ``exp(logp − old_logp)`` moves away from 1 over the updates and the clip acts. With a single update
   (``ppo_epochs = mini_batches = 1``) π_old = π_θ numerically, so ``logp.detach()`` serves (no extra forward).
   π_ref (``--kl-coef > 0``) is computed once too.
3. **Epochs × mini-batches**: ``ppo_epochs`` passes, each over ``mini_batches`` random splits of the samples
   (:func:`minibatches`). Per mini-batch:

   a. **loss**: ``policy_loss`` of ``--loss`` (clip offsets from 1);
   b. **correction** of the train/rollout mismatch on ρ = π_old/π_rollout (tis: weights ``min(ρ, cap)``; mis:
      tokens with ρ outside [1/cap, cap] masked);
   c. **KL**: ``+ kl_coef · k3(π_θ ‖ π_ref)`` per token;
   d. **aggregation**: ``aggregate`` with the mini-batch's GLOBAL normalisers (token and sequence counts summed
      over the trainer ranks, so the ranks' losses add up to the mini-batch's loss);
   e. **optimizer update**: one backward, scaled by ``grad_scale`` (FSDP averages gradients over the ranks);
      grad-norm clip; optimizer step.
4. **Metrics**: each one averaged over the updates, plus the train/rollout mismatch of π_old (with
   ``max_staleness`` also per token age ``step − version``: age 0 isolates what the rollout engine adds, e.g. FP8
   weights, from what staleness adds), and the groups whose rewards are all equal (:func:`zero_variance_groups`,
   over every trainer rank): their advantages are 0, and when every group of a step is such a group the
   policy-gradient term of the step is exactly 0 (only ``--kl-coef`` acts). Such a step is announced on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from plumbing import CORRECTION_CAP, all_reduce, global_counts, mean_metrics, policy_loss
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.losses import aggregate, grpo_advantages, kl_estimate, mismatch_metrics, rollout_correction


def grpo_step(cfg: Any, policy: torch.nn.Module, optim: torch.optim.Optimizer, bt: dict[str, Tensor], *,
              ref_policy: torch.nn.Module | None = None, group=None, grad_scale: float = 1.0,
              step: int = 0, max_staleness: int | None = None) -> dict[str, float]:
    """One GRPO update (the module docstring's steps) on this rank's share of a batch (``batch_tensors``);
    ``policy``/``ref_policy`` map ``(input_ids, attention_mask, labels)`` to per-token log-probs (``PolicyLogprobs``).
    ``max_staleness`` (η, where ``step`` is the trained policy version): the mismatch metrics also per token age
    ``0..η`` (``mismatch_staleness{s}_kl_k3``, ``..._ratio_in_band_frac``, ``..._token_frac``).
    Returns the metrics, averaged over the optimizer updates."""
    mask, rollout_logp = bt["mask"], bt["rollout_logp"]
    if cfg.correction not in ("tis", "mis", "none"):
        raise ArgumentError(f"cfg.correction: expected 'tis', 'mis' or 'none' (resolve 'auto' with plumbing's "
                            f"check_engine_flags), got {cfg.correction!r}")
    zero, n_groups = zero_variance_groups(bt["rewards"], bt["group_ids"], bt.get("trained"), group)

    def logprobs(module: torch.nn.Module, rows: Any = slice(None)) -> Tensor:
        return module(bt["input_ids"][rows], bt["attention_mask"][rows], bt["labels"][rows])

    # 1. advantages, one per sample
    adv = grpo_advantages(bt["rewards"], bt["group_ids"])
    # 2. π_old (only when there is more than one update) and π_ref, fixed for the whole step
    n_updates = cfg.ppo_epochs * cfg.mini_batches
    with torch.no_grad():
        old_logp = logprobs(policy) if n_updates > 1 else None
        ref_logp = logprobs(ref_policy) if ref_policy is not None and cfg.kl_coef > 0 else None
    # 3. epochs × mini-batches
    per_update: list[dict[str, Tensor]] = []
    for rows in minibatches(cfg, mask.shape[0], step):
        mb_mask, mb_rollout = mask[rows], rollout_logp[rows]
        logp = logprobs(policy, rows)
        old = logp.detach() if old_logp is None else old_logp[rows]
        # 3a. loss
        per_tok, m = policy_loss(cfg, logp, old, adv[rows], mb_mask, rollout_logp=mb_rollout)
        # 3b. train/rollout correction
        keep = mb_mask
        if cfg.correction != "none":
            cap = cfg.correction_cap or CORRECTION_CAP
            mode = "truncate" if cfg.correction == "tis" else "mask"
            w, keep, cm = rollout_correction(old, mb_rollout, mb_mask, level="token", mode=mode, upper=cap,
                                             lower=None if mode == "truncate" else 1.0 / cap)
            per_tok = per_tok * w
            m.update({f"correction_{k}": v for k, v in cm.items()})
        # 3c. KL penalty to the reference
        if ref_logp is not None:
            kl = torch.where(mb_mask, kl_estimate(logp, ref_logp[rows], kind="k3"), 0.0)
            per_tok = per_tok + cfg.kl_coef * kl
            m["kl_ref_k3"] = kl.sum() / mb_mask.sum().clamp(min=1)
        # 3d. aggregation with the global normalisers
        n = global_counts(mb_mask, group, rows=bt["trained"][rows] if "trained" in bt else None)
        loss = aggregate(per_tok, keep, mode=cfg.agg, num_tokens=n["tokens"], num_seqs=n["seqs"],
                         max_len=n["max_len"])
        # 3e. optimizer update
        m["grad_norm"] = optimizer_update(policy, optim, loss, grad_scale=grad_scale, grad_clip=cfg.grad_clip)
        m["loss"] = loss.detach()
        per_update.append({k: v.detach() for k, v in m.items()})
    # 4. metrics; the train/rollout mismatch of π_old (the weights that should have produced the samples)
    metrics = mean_metrics(per_update)
    by_age = {} if max_staleness is None else {"versions": bt["versions"], "current_version": step,
                                                "max_staleness": max_staleness}
    mm = mismatch_metrics(old_logp if old_logp is not None else old, rollout_logp, mask, **by_age)
    metrics.update({f"mismatch_{k}": float(v) for k, v in mm.items()})
    metrics["ppo_updates"] = n_updates
    metrics["zero_variance_groups"] = zero
    metrics["zero_variance_step"] = int(n_groups > 0 and zero == n_groups)
    if metrics["zero_variance_step"] and _is_rank0():  # the counts are global: one line per job
        # the loops log this update as step + 1 (the version it produces)
        print(f"step {step + 1}: all {n_groups} groups have zero reward variance (every sample of a prompt scored the "
              "same), so the policy-gradient term is exactly 0; likely cause: the task is too hard or too easy for "
              "the policy at this --temperature, or the reward is constant (check --reward)",
              file=sys.stderr, flush=True)
    return metrics


def zero_variance_groups(rewards: Float[Tensor, " B"], group_ids: Int[Tensor, " B"],
                         trained: Bool[Tensor, " B"] | None = None, group=None) -> tuple[int, int]:
    """``(zero-variance groups, groups)`` of a batch, summed over the ranks of ``group`` (each rank holds whole
    groups): a group counts when it is trained (``trained``: False for the rows of a group failed for its reward)
    and all its rewards are equal (max = min; a NaN reward makes a group count as varied: it is not silently
    called flat). GRPO's advantage ``(r − mean) / (std + ε)`` is 0 for every sample of such a group."""
    keep = torch.ones_like(group_ids, dtype=torch.bool) if trained is None else trained.to(torch.bool)
    r = rewards[keep].to(torch.float64)
    _, inv = torch.unique(group_ids[keep], return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    hi = torch.full((n,), float("-inf"), dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((n,), float("inf"), dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
    counts = all_reduce(torch.tensor([float((hi == lo).sum()), float(n)], dtype=torch.float64), group=group)
    return int(counts[0]), int(counts[1])


def _is_rank0() -> bool:
    """Whether this process is global rank 0 (or the only process)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def minibatches(cfg: Any, n: int, step: int) -> Iterator[Tensor | slice]:
    """The rows of each optimizer update of a step: ``cfg.ppo_epochs`` passes over ``n`` samples, each a fresh
    random permutation cut into ``cfg.mini_batches`` parts (one pass over every row, ``slice(None)``, when
    ``mini_batches = 1``). The permutations come from a generator seeded with ``seed · 1000003 + step``, so a step
    splits its batch the same way on every run of a seed."""
    shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    for _epoch in range(cfg.ppo_epochs):
        if cfg.mini_batches == 1:
            yield slice(None)
            continue
        yield from torch.randperm(n, generator=shuffle).tensor_split(cfg.mini_batches)


def optimizer_update(model: torch.nn.Module, optim: torch.optim.Optimizer, loss: Tensor, *, grad_scale: float,
                     grad_clip: float) -> Tensor:
    """``zero_grad``, backward of ``loss · grad_scale``, grad-norm clip to ``grad_clip``, optimizer step. Returns
    the gradient norm before clipping."""
    optim.zero_grad(set_to_none=True)
    (loss * grad_scale).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optim.step()
    return grad_norm
