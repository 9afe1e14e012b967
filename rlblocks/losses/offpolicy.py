"""Off-policy masks for the trainer/engine mismatch: geometric-mean sequence mask, ICEPOP token band, outlier
sequence mask, and the DPPO probability band with its log² mismatch term.

Ratios: ``ρ = π_old/π_rollout`` per token, ``log ρ = old_logp − rollout_logp`` (``old_logp``: the trainer's
log-probs before this update; ``rollout_logp``: the engine's processed log-probs), clamped to ±20 before
``exp``. Bounds of the ratio masks are absolute ratios (as ``rollout_correction``'s ``lower``/``upper``), not
offsets from 1. Segment-level (per-turn) truncated IS is ``rollout_correction(..., level="segment")``.

Every mask returns a ``keep`` mask that is a subset of ``mask`` plus 0-dim metrics, is detached, runs in float32
(float64 for float64 inputs) and does no host sync. A token is dropped only when its statistic is *provably*
outside the band: a NaN ratio (NaN in valid data) keeps its token, so the NaN reaches the loss instead of
vanishing with a dropped token. Padding may hold NaN/inf and is never read.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from rlblocks._checks import check_real, check_token_pair
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import (
    LOG_RATIO_CLAMP,
    Metrics,
    broadcast_advantages,
    compute_dtype,
    detached_log_ratio,
    masked_mean,
    masked_sum,
    safe,
)

__all__ = ["dppo_loss", "dppo_mask", "geometric_sequence_mask", "icepop_correction", "outlier_sequence_mask"]


def _bounds(lower: float | None, upper: float | None) -> tuple[float, float]:
    lo = 0.0 if lower is None else check_real("lower", lower, ge=0.0)
    hi = float("inf") if upper is None else check_real("upper", upper, gt=0.0)
    if lo > hi:
        raise ArgumentError(f"lower: expected a value <= upper = {hi}, got {lo}")
    return lo, hi


def _seq_metrics(m: Tensor, keep: Tensor, low: Tensor, high: Tensor, dt: torch.dtype) -> Metrics:
    """Token and sequence fractions dropped (low/high per sequence for the sequence masks)."""
    has = m.any(-1)
    dropped_seq = has & ~keep.any(-1)
    return Metrics(
        masked_frac=masked_mean((m & ~keep).to(dt), m),
        seq_masked_frac=masked_mean(dropped_seq.to(dt), has),
        seq_masked_low_frac=masked_mean(low.to(dt), has),
        seq_masked_high_frac=masked_mean(high.to(dt), has),
    )


def geometric_sequence_mask(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    lower: float = 0.99,
    upper: float = 1.01,
) -> tuple[Bool[Tensor, "B T"], Metrics]:
    """Geometric-mean sequence mask: drop every token of a sequence whose geometric-mean ratio leaves the band.

    ``g_i = exp(clamp(mean_{t valid} log ρ_{i,t}, ±20))``; ``keep = mask & ¬(g_i < lower ∨ g_i > upper)``.
    As SkyRL's ``sequence_mask_metric="geometric"`` (defaults ``geo_mask_low=0.99``, ``geo_mask_high=1.01``,
    its recommended first correction); the mean over tokens makes the band independent of the length, unlike a
    product. Returns ``(keep, metrics)``; metrics: ``masked_frac`` (valid tokens dropped), ``seq_masked_frac``,
    ``seq_masked_low_frac``, ``seq_masked_high_frac`` (over non-empty sequences).
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    lo, hi = _bounds(lower, upper)
    lr = detached_log_ratio(old_logp, rollout_logp, m)
    dt = lr.dtype
    g = torch.exp((masked_sum(lr, m, -1) / m.sum(-1).clamp(min=1).to(dt)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    has = m.any(-1)
    low, high = has & (g < lo), has & (g > hi)
    keep = m & ~(low | high)[:, None]
    return keep, _seq_metrics(m, keep, low, high, dt)


def outlier_sequence_mask(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    lower: float | None = 1e-4,
    upper: float | None = 100.0,
) -> tuple[Bool[Tensor, "B T"], Metrics]:
    """Outlier masking: drop a whole sequence when *any* of its valid tokens has ``ρ < lower`` or ``ρ > upper``.

    ``ρ_t = exp(clamp(log ρ_t, ±20))``; ``keep = mask & ¬∃t valid: (ρ_t < lower ∨ ρ_t > upper)``. SkyRL's
    ``outlier_token_is_threshold_low/high`` (suggested 1e-4 / 100; ``None`` disables a side), applied before
    its other masks; it catches the single wildly mismatched token that a sequence mean hides. Returns
    ``(keep, metrics)``; metrics as ``geometric_sequence_mask`` (low/high: a sequence with a token below/above).
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    lo, hi = _bounds(lower, upper)
    lr = detached_log_ratio(old_logp, rollout_logp, m)
    dt = lr.dtype
    rho = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    low = (m & (rho < lo)).any(-1)
    high = (m & (rho > hi)).any(-1)
    keep = m & ~(low | high)[:, None]
    return keep, _seq_metrics(m, keep, low, high, dt)


def icepop_correction(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    lower: float = 0.5,
    upper: float = 5.0,
) -> tuple[Float[Tensor, "B T"], Bool[Tensor, "B T"], Metrics]:
    """ICEPOP (Ring-1T / IcePop): tokens whose ratio leaves ``[lower, upper]`` get zero gradient.

    ``M(ρ_t) = ρ_t if lower ≤ ρ_t ≤ upper else 0``, multiplied into the per-token policy loss (the PPO clip
    stays around π_old). Returns ``(weights, keep, metrics)`` with ``keep = mask & ¬(ρ < lower ∨ ρ > upper)``
    and ``weights = ρ`` on kept tokens, 0 elsewhere: ``loss = ppo(...)[0] * weights`` under ``keep`` is IcePop
    (``α = 0.5, β = 5`` in the Ring-1T report); using only ``keep`` is SkyRL's "token masking (icepop)"
    (its suggested band 0.5 / 2.0). Both sides are inclusive. A NaN ρ keeps its token with weight NaN.
    Metrics: ``masked_frac``, ``masked_low_frac``, ``masked_high_frac`` (valid tokens), ``weight_mean`` (kept).
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    lo, hi = _bounds(lower, upper)
    lr = detached_log_ratio(old_logp, rollout_logp, m)
    dt = lr.dtype
    rho = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    low, high = m & (rho < lo), m & (rho > hi)
    keep = m & ~(low | high)
    w = safe(rho, keep, dt)
    metrics = Metrics(
        masked_frac=masked_mean((low | high).to(dt), m),
        masked_low_frac=masked_mean(low.to(dt), m),
        masked_high_frac=masked_mean(high.to(dt), m),
        weight_mean=masked_mean(w, keep),
    )
    return w, keep, metrics


def dppo_mask(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> tuple[Bool[Tensor, "B T"], Metrics]:
    """DPPO band mask (prime-rl's default loss; DPPO-Binary-TV, arXiv 2602.04879): a trust region on the
    *probability* difference, one-sided by the sign of the advantage.

    ``Δ_t = e^{logp_t} − e^{old_logp_t}`` (detached). Dropped: ``A > 0`` and ``Δ > delta_high`` (the token's
    probability already rose too far), or ``A ≤ 0`` and ``Δ < −delta_low`` (it already fell too far); prime-rl's
    ``dppo_mask_high``/``dppo_mask_low``, default 0.2 each. Unlike a ratio band, a rare token (p = 0.01) can
    move by a large ratio and stay in, while a likely token's step is bounded in absolute terms. prime-rl
    compares the trainer with the engine (its ``old_logp`` slot holds the inference log-probs, one update per
    batch); pass ``rollout_logp`` as ``old_logp`` for that. ``A = 0`` follows the ``A ≤ 0`` rule, as in
    prime-rl (such a token carries no policy gradient anyway). Returns ``(keep, metrics)``; metrics (valid
    tokens): ``masked_frac`` (all dropped), ``masked_low_frac`` (dropped with ``A < 0``), ``masked_high_frac``
    (dropped with ``A > 0``).
    """
    m = check_token_pair("logp", logp, "old_logp", old_logp, mask)
    dl = check_real("delta_low", delta_low, ge=0.0)
    dh = check_real("delta_high", delta_high, ge=0.0)
    dt = compute_dtype(logp)
    adv = broadcast_advantages(advantages, logp, m).detach()
    delta = torch.exp(safe(logp, m, dt).detach()) - torch.exp(safe(old_logp, m, dt).detach())
    pos = adv > 0
    high = m & pos & (delta > dh)
    low = m & ~pos & (delta < -dl)
    keep = m & ~(low | high)
    metrics = Metrics(
        masked_frac=masked_mean((low | high).to(dt), m),
        masked_low_frac=masked_mean((low & (adv < 0)).to(dt), m),
        masked_high_frac=masked_mean(high.to(dt), m),
    )
    return keep, metrics


def dppo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    kl_coef: float = 1e-3,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """DPPO + log² loss (prime-rl's default RL loss): ``ℓ_t = −keep_t·r_t·A_t + kl_coef·(log r_t)²``.

    ``log r = clamp(logp − old_logp, ±20)`` (no gradient beyond the clamp), ``r = e^{log r}`` with gradient
    ``r·∇logp`` (no ratio clip: the
    trust region is ``dppo_mask``'s probability band, ``keep``). The mismatch term ``(log r)²`` (Kimi-K2.5's
    squared log-ratio, prime-rl's ``kl_tau``, default 1e-3) acts on *every* valid token, kept or not, with
    gradient ``2·kl_coef·log r·∇logp``: it pulls the trainer back toward π_old where the band stopped the
    policy-gradient term. Reduce with ``aggregate`` (prime-rl normalises by the total token count, i.e.
    ``token-mean``). Metrics: ``clipfrac`` (tokens dropped by the band, the trust region's analogue of PPO's
    clip fraction), ``clipfrac_low``, ``clipfrac_high``, ``approx_kl`` (k3 of KL(π_old‖π_θ)), ``log_ratio_sq``
    (mean ``(log r)²`` over valid tokens).
    """
    keep, mm = dppo_mask(logp, old_logp, advantages, mask, delta_low=delta_low, delta_high=delta_high)
    c = check_real("kl_coef", kl_coef, ge=0.0)
    m = check_token_pair("logp", logp, "old_logp", old_logp, mask)
    dt = compute_dtype(logp)
    lp = safe(logp, m, dt)
    olp = safe(old_logp, m, dt).detach()
    adv = broadcast_advantages(advantages, logp, m).detach()
    log_r = (lp - olp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_r)
    zero = torch.zeros((), dtype=dt, device=lp.device)
    loss = torch.where(keep, -r * adv, zero) + c * torch.where(m, log_r * log_r, zero)
    lrd = log_r.detach()
    metrics = Metrics(
        clipfrac=mm["masked_frac"],
        clipfrac_low=mm["masked_low_frac"],
        clipfrac_high=mm["masked_high_frac"],
        approx_kl=masked_mean(torch.expm1(lrd) - lrd, m),
        log_ratio_sq=masked_mean(lrd * lrd, m),
    )
    return safe(loss, m, dt), metrics
