"""The GRPO update every GRPO loop runs, read top to bottom: ``grpo_sync.py`` and ``grpo_async.py`` on the batches
of ``batch_tensors``, the agent loops on agent trajectories (``trajectory_tensors``, through
``agent_task.grpo_backward``). Its epochs × mini-batches loop (:func:`run_updates`) is distillation's too
(``distill.py``'s ``distill_step``, which differs only in the per-token loss).

One call of :func:`grpo_step` is one policy version: the whole update on this rank's share of a batch.

1. **Advantages**, one per row: the batch's own ``advantages`` when it carries them (agent trajectories: one per
   trajectory, broadcast to the rows of its segments), else ``A_i = (r_i − mean_g r) / (std_g r + 1e-6)`` within
   each prompt group (``grpo_advantages``); a group never straddles trainer ranks, so these are the whole batch's
   advantages.
2. **π_old**, fixed for every epoch: the batch's own ``old_logp`` when it carries it (agent trajectories: the
   engine's log-probs, the behaviour policy), else the trainer's log-probs before the first update, computed once
   (no grad): the ratio ``exp(logp − old_logp)`` moves away from 1 over the updates and the clip acts. With a single
   update (``ppo_epochs = mini_batches = 1``) π_old = π_θ numerically, so ``logp.detach()`` serves (no extra
   forward). π_ref (``--kl-coef > 0``) is computed once too.
3. **Epochs × mini-batches** (:func:`run_updates`): ``ppo_epochs`` passes, each over ``mini_batches`` random splits
   of the rows (:func:`minibatches`); a mini-batch is forwarded whole, or with ``max_tokens`` in micro-batches of at
   most that many padded tokens (:func:`microbatches`). Per micro-batch:

   a. **loss**: ``policy_loss`` of ``--loss`` (clip offsets from 1), on the ``mask`` tokens (agent trajectories:
      the model's own tokens only; tool results and chat markers are masked);
   b. **correction** of the train/rollout mismatch on ρ = π_old/π_rollout (tis: weights ``min(ρ, cap)``; mis:
      tokens with ρ outside [1/cap, cap] masked);
   c. **KL**: ``+ kl_coef · k3(π_θ ‖ π_ref)`` per token;
   d. **aggregation**: ``aggregate`` with the mini-batch's GLOBAL normalisers (token and sequence counts summed
      over the trainer ranks, so the ranks' and micro-batches' losses add up to the mini-batch's loss);
   e. **backward**, scaled by ``grad_scale`` (FSDP averages gradients over the ranks).

   Then the **optimizer update** of the mini-batch (:func:`optimizer_update`): grad-norm clip, optimizer step.
   With ``optim=None`` (a single update) the gradients stay in ``.grad`` for the caller to clip and step.
4. **Metrics**: each one averaged over the updates (over a mini-batch's micro-batches, weighted by their tokens),
   plus the train/rollout mismatch of π_old (with ``max_staleness`` also per token age ``step − version``: age 0
   isolates what the rollout engine adds, e.g. FP8 weights, from what staleness adds), and the groups whose rewards
   are all equal (:func:`zero_variance_groups`, over every trainer rank): their advantages are 0, and when every
   group of a step is such a group the policy-gradient term of the step is exactly 0 (only ``--kl-coef`` acts). Such
   a step is announced on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from plumbing import CORRECTION_CAP, all_reduce, global_counts, mean_metrics, policy_loss
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.losses import aggregate, grpo_advantages, kl_estimate, mismatch_metrics, rollout_correction
from rlblocks.sched import token_budget_microbatches

# the per-token loss of one micro-batch: its rows of the batch dict -> (per-token loss, tokens kept, metrics)
TokenLoss = Callable[[dict[str, Tensor]], tuple[Tensor, Tensor, dict[str, Tensor]]]


def grpo_step(cfg: Any, policy: torch.nn.Module, optim: torch.optim.Optimizer | None, bt: dict[str, Tensor], *,
              ref_policy: torch.nn.Module | None = None, group=None, grad_scale: float = 1.0,
              step: int | None = None, max_staleness: int | None = None,
              max_tokens: int | None = None) -> dict[str, float]:
    """One GRPO update (the module docstring's steps) on this rank's share of a batch (``batch_tensors`` or
    ``trajectory_tensors``; the optional ``advantages`` ``[B]`` and ``old_logp`` ``[B, L-1]`` are used as given);
    ``policy``/``ref_policy`` map ``(input_ids, attention_mask, labels)`` to per-token log-probs (``PolicyLogprobs``).
    ``step``: the trained policy version (``None``: unknown, taken as 0 for the mini-batch shuffle; the
    zero-variance announcement then names no step). ``max_staleness`` (η): the mismatch metrics also per token age
    ``0..η`` (``mismatch_staleness{s}_kl_k3``, ``..._ratio_in_band_frac``, ``..._token_frac``). ``max_tokens``: the
    micro-batch budget in padded tokens (``None``: each mini-batch in one forward). ``optim=None``: backward only
    (one update; ``cfg.grad_clip`` is not applied). Returns the metrics, averaged over the optimizer updates."""
    mask, rollout_logp = bt["mask"], bt["rollout_logp"]
    if cfg.correction not in ("tis", "mis", "none"):
        raise ArgumentError(f"cfg.correction: expected 'tis', 'mis' or 'none' (resolve 'auto' with plumbing's "
                            f"check_engine_flags), got {cfg.correction!r}")
    zero, n_groups = zero_variance_groups(bt["rewards"], bt["group_ids"], bt.get("trained"), group)

    def logprobs(module: torch.nn.Module, mb: dict[str, Tensor]) -> Tensor:
        return module(mb["input_ids"], mb["attention_mask"], mb["labels"])

    # 1. advantages, one per row
    adv = bt["advantages"] if "advantages" in bt else grpo_advantages(bt["rewards"], bt["group_ids"])
    # 2. π_old (given, or computed when there is more than one update) and π_ref, fixed for the whole step
    n_updates = cfg.ppo_epochs * cfg.mini_batches
    work = {**bt, "adv": adv, "row": torch.arange(mask.shape[0], device=mask.device)}
    with torch.no_grad():
        if "old_logp" not in bt and n_updates > 1:
            work["old_logp"] = logprobs(policy, bt)
        if ref_policy is not None and cfg.kl_coef > 0:
            work["ref_logp"] = logprobs(ref_policy, bt)
    seen: dict[str, Tensor] = {}  # π_old as the updates used it, for step 4's mismatch metrics

    # 3. epochs × mini-batches × micro-batches, each micro-batch's per-token loss:
    def token_loss(mb: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        mb_mask, mb_rollout = mb["mask"], mb["rollout_logp"]
        logp = logprobs(policy, mb)
        old = logp.detach() if "old_logp" not in mb else mb["old_logp"]
        if "old" not in seen:
            seen["old"] = torch.zeros_like(rollout_logp, dtype=old.dtype)
        seen["old"][mb["row"], : old.shape[1]] = old
        # 3a. loss
        per_tok, m = policy_loss(cfg, logp, old, mb["adv"], mb_mask, rollout_logp=mb_rollout)
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
        if "ref_logp" in mb:
            kl = torch.where(mb_mask, kl_estimate(logp, mb["ref_logp"], kind="k3"), 0.0)
            per_tok = per_tok + cfg.kl_coef * kl
            m["kl_ref_k3"] = kl.sum() / mb_mask.sum().clamp(min=1)
        return per_tok, keep, m

    # 3d. aggregation with the global normalisers, 3e. backward, and the optimizer updates
    version = 0 if step is None else step
    per_update = run_updates(cfg, policy, optim, work, token_loss, group=group, grad_scale=grad_scale, step=version,
                             max_tokens=max_tokens)
    # 4. metrics; the train/rollout mismatch of π_old (the weights that should have produced the samples)
    metrics = mean_metrics(per_update)
    by_age = {} if max_staleness is None else {"versions": bt["versions"], "current_version": version,
                                                "max_staleness": max_staleness}
    mm = mismatch_metrics(work.get("old_logp", seen["old"]), rollout_logp, mask, **by_age)
    metrics.update({f"mismatch_{k}": float(v) for k, v in mm.items()})
    metrics["ppo_updates"] = n_updates
    metrics["zero_variance_groups"] = zero
    metrics["zero_variance_step"] = int(n_groups > 0 and zero == n_groups)
    if metrics["zero_variance_step"] and _is_rank0():  # the counts are global: one line per job
        # the loops log this update as step + 1 (the version it produces)
        at = "" if step is None else f"step {step + 1}: "
        print(f"{at}all {n_groups} groups have zero reward variance (every sample of a prompt scored the "
              "same), so the policy-gradient term is exactly 0; likely cause: the task is too hard or too easy for "
              "the policy at this --temperature, or the reward is constant (check --reward)",
              file=sys.stderr, flush=True)
    return metrics


def run_updates(cfg: Any, policy: torch.nn.Module, optim: torch.optim.Optimizer | None, work: dict[str, Tensor],
                token_loss: TokenLoss, *, group=None, grad_scale: float = 1.0, step: int = 0,
                max_tokens: int | None = None) -> list[dict[str, Tensor]]:
    """Step 3 of :func:`grpo_step` (and of ``distill_step``) around a per-token loss: for each mini-batch of
    :func:`minibatches`, for each of its :func:`microbatches`, ``token_loss(rows of work) -> (per_tok, keep,
    metrics)``, ``aggregate(per_tok, keep, mode=cfg.agg)`` with the mini-batch's global token/sequence counts
    (``global_counts`` over ``group``; ``work["trained"]`` says which rows count as sequences), backward of
    ``loss · grad_scale``; then :func:`optimizer_update` (``cfg.grad_clip``), or nothing with ``optim=None`` (one
    update only: the caller steps). Every ``[B, …]`` tensor of ``work`` reaches ``token_loss`` cut to the
    micro-batch's rows (and, with ``max_tokens``, to its longest row). Returns one metrics dict per update: the
    micro-batches' metrics weighted by their share of the mini-batch's tokens, ``loss`` (their sum) and
    ``grad_norm`` (before clipping)."""
    mask = work["mask"]
    if optim is None and cfg.ppo_epochs * cfg.mini_batches != 1:
        raise ArgumentError(f"optim: None (backward only) needs a single update, got ppo_epochs {cfg.ppo_epochs} × "
                            f"mini_batches {cfg.mini_batches}")
    per_update: list[dict[str, Tensor]] = []
    for rows in minibatches(cfg, mask.shape[0], step):
        n = global_counts(mask[rows], group, rows=work["trained"][rows] if "trained" in work else None)
        if optim is not None:
            optim.zero_grad(set_to_none=True)
        parts = list(microbatches(work, rows, max_tokens))
        local = mask[rows].sum().clamp(min=1)
        losses, m = [], {}
        for mb in parts:
            per_tok, keep, mm = token_loss(mb)
            loss = aggregate(per_tok, keep, mode=cfg.agg, num_tokens=n["tokens"], num_seqs=n["seqs"],
                             max_len=n["max_len"])
            (loss * grad_scale).backward()
            losses.append(loss.detach())
            share = mb["mask"].sum() / local if len(parts) > 1 else None
            for k, v in mm.items():
                m[k] = v.detach() if share is None else m.get(k, 0.0) + share * v.detach()
        if optim is not None:
            m["grad_norm"] = optimizer_update(policy, optim, grad_clip=cfg.grad_clip)
        m["loss"] = torch.stack(losses).sum() if len(losses) > 1 else losses[0]
        per_update.append(m)
    return per_update


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


def microbatches(work: dict[str, Tensor], rows: Tensor | slice, max_tokens: int | None) -> Iterator[dict[str, Tensor]]:
    """The micro-batches of one mini-batch's ``rows``, each as ``work`` cut to its rows. ``max_tokens=None``: the
    whole mini-batch, uncut. Else its rows sorted by length (``attention_mask`` sum, longest first) and split in
    order into groups of at most ``max_tokens`` padded tokens (``token_budget_microbatches(padded=True)``), each cut
    to its longest row: ``[B, L]`` tensors to its ``W`` columns, ``[B, L-1]`` ones (the next-token positions) to
    ``W − 1`` (right padding: nothing scored lies beyond)."""
    if max_tokens is None:
        yield {k: v[rows] for k, v in work.items()}
        return
    ids = torch.arange(work["mask"].shape[0], device=work["mask"].device)[rows]
    lengths = work["attention_mask"][ids].sum(-1)
    order = ids[torch.argsort(lengths, descending=True, stable=True)]
    width = work["input_ids"].shape[1]
    for part in token_budget_microbatches(work["attention_mask"][order].sum(-1).tolist(), max_tokens=max_tokens,
                                          padded=True):
        sel = order[part]
        w = max(int(work["attention_mask"][sel].sum(-1).max()), 2)
        yield {k: v[sel] if v.dim() < 2 else v[sel, : w if v.shape[1] == width else w - 1] for k, v in work.items()}


def optimizer_update(model: torch.nn.Module, optim: torch.optim.Optimizer, *, grad_clip: float) -> Tensor:
    """Grad-norm clip of ``model``'s accumulated gradients to ``grad_clip``, then the optimizer step. Returns the
    gradient norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optim.step()
    return grad_norm
