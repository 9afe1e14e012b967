"""Token and sequence masks used by recent recipes: OPSM, high-entropy tokens, overlong penalty, zero-variance groups.

All are detached, sync-free and compile with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rlblocks._validate import as_bool_mask, check_floating, check_ndim
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import (
    broadcast_advantages,
    check_group_inputs,
    check_number,
    check_token_pair,
    compute_dtype,
    masked_sum,
    safe,
)
from rlblocks.losses._groups import dense_group_index, group_reduce

__all__ = ["off_policy_sequence_mask", "overlong_penalty", "top_entropy_mask", "zero_variance_groups"]


def off_policy_sequence_mask(
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    delta: float,
) -> Bool[Tensor, "B T"]:
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2). Returns the keep mask ``[B, T]``.

    A token is dropped when its advantage is negative and its sequence has drifted:
    ``A_{i,t} < 0`` and ``mean_t (old_logp − logp) > delta`` (the per-sequence mean over valid tokens, a k1
    estimate of KL(π_old‖π_θ)); ``old_logp`` is the sampling (rollout) policy. Everything else valid is kept.
    """
    m = check_token_pair("logp", logp, "old_logp", old_logp, mask)
    d = check_number("delta", delta)
    dt = compute_dtype(logp)
    adv = broadcast_advantages(advantages, logp, m).detach()
    diff = (safe(old_logp, m, dt) - safe(logp, m, dt)).detach()
    seq_kl = masked_sum(diff, m, -1) / m.sum(-1).clamp(min=1).to(dt)
    drop = (adv < 0) & (seq_kl > d)[:, None]
    return m & ~drop


def top_entropy_mask(
    entropy: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], *, quantile: float
) -> Bool[Tensor, "B T"]:
    """Keep the high-entropy "forking" tokens (Wang et al. 2025, "Beyond the 80/20 rule").

    ``keep = mask & (entropy ≥ q)`` with ``q`` the ``quantile``-quantile (linear interpolation, as
    ``torch.quantile``) of the entropies of the valid tokens of this call: ``quantile=0.8`` keeps the top 20%.
    Sync-free: invalid positions are sorted to the end as +inf and the quantile is gathered at a tensor index.
    The quantile is local to the call (per micro-batch); pass the whole batch for a batch-level threshold.
    """
    check_floating("entropy", entropy)
    check_ndim("entropy", entropy, 2, "[B, T]")
    m = as_bool_mask(mask, entropy, like_name="entropy")
    q = check_number("quantile", quantile, ge=0.0, le=1.0)
    dt = compute_dtype(entropy)
    e = entropy.detach().to(dt)
    flat = torch.where(m, e, torch.full_like(e, float("inf"))).reshape(-1)
    srt, _ = torch.sort(flat)
    n = m.sum()
    pos = q * (n - 1).clamp(min=0).to(dt)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    v_lo = srt.gather(0, lo.reshape(1)).reshape(())
    v_hi = srt.gather(0, hi.reshape(1)).reshape(())
    frac = pos - lo.to(dt)
    thr = torch.where(hi == lo, v_lo, v_lo + frac * (v_hi - v_lo))
    return m & (e >= thr)


def overlong_penalty(
    lengths: Shaped[Tensor, " n"], *, max_len: int, buffer: int, penalty: float = 1.0
) -> Float[Tensor, " n"]:
    """DAPO soft overlong punishment, to be added to the rewards. Returns ``[n]`` values in ``[−penalty, 0]``.

    ``0`` if ``|y| ≤ max_len − buffer``; ``−penalty·(|y| − (max_len − buffer)) / buffer`` inside the buffer;
    ``−penalty`` if ``|y| ≥ max_len``. Float32 (float64 for float64 lengths).
    """
    if not isinstance(lengths, Tensor) or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ArgumentError(f"lengths: expected a real tensor of shape [n], got {getattr(lengths, 'dtype', lengths)!r}")
    check_ndim("lengths", lengths, 1, "[n]")
    ml = check_number("max_len", max_len, gt=0)
    buf = check_number("buffer", buffer, gt=0, le=ml)
    pen = check_number("penalty", penalty, ge=0.0)
    dt = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    excess = (lengths.to(dt) - (ml - buf)) / buf
    return -pen * excess.clamp(0.0, 1.0)


def zero_variance_groups(rewards: Shaped[Tensor, " n"], group_ids: Int[Tensor, " n"]) -> Bool[Tensor, " n"]:
    """``True`` for every sample whose group's rewards are all equal (including singleton groups).

    Such groups give zero GRPO advantage everywhere; DAPO's dynamic sampling drops them. Exact comparison of the
    group max and min (no variance threshold).
    """
    check_group_inputs(rewards, group_ids)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    return group_reduce(r, idx, "amax") == group_reduce(r, idx, "amin")

