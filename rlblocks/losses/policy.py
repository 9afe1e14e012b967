"""Per-token policy losses (PPO-clip, GSPO, CISPO, SAPO, GMPO, PG, decoupled PPO) and the clipped value loss.

Every loss takes ``(logp, old_logp, advantages, mask, *, ...)`` with ``logp``/``old_logp``/``mask`` of shape
``[B, T]`` and ``advantages`` of shape ``[B, T]`` or ``[B]`` (broadcast over the tokens), and returns
``(per_token_loss [B, T], metrics)``:

- ``log_ratio = logp − old_logp``; ``ratio = exp(clamp(log_ratio, −20, 20))``.
- Clip bounds are **offsets** from 1: the ratio is clipped to ``[1 − eps_low, 1 + eps_high]``.
- The loss is the quantity to *minimise* (sign: ``−ratio·A``); it is exactly 0 at masked positions.
- NaN/inf at masked positions of any input never reach the loss, the metrics or the gradient (inputs are
  sanitised with ``torch.where`` before any arithmetic).
- Computation in float32 (float64 for float64 inputs); bf16/fp16 inputs are upcast. The loss is returned in the
  compute dtype.
- Metrics are 0-dim tensors: masked means over this call's valid tokens (0 when there are none). No host sync.
  Every policy loss reports ``approx_kl``, the k3 estimate of KL(π_old‖π_θ) ``mean(r − 1 − log r)``; every
  clipping loss reports ``clipfrac`` (fraction of valid tokens where any clip is active), ``clipfrac_low`` (the
  lower bound ``1 − eps_low`` is active) and ``clipfrac_high`` (the upper bound ``1 + eps_high``).

Log-probs (one vocabulary across rlblocks): ``logp`` is the trainer's, with grad; ``old_logp`` the trainer's
before this update (π_old, AReaL's proximal policy); ``rollout_logp`` the engine's processed log-probs of the
sampled tokens (the behaviour policy), used by ``decoupled_ppo_loss`` and ``rlblocks.losses.rollout_correction``.

Reduce the per-token loss with ``rlblocks.losses.aggregate`` and an explicit normaliser.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks._checks import as_bool_mask, check_floating, check_ndim, check_real, check_same_shape, check_token_pair
from rlblocks.losses._common import (
    LOG_RATIO_CLAMP,
    Metrics,
    broadcast_advantages,
    compute_dtype,
    masked_mean,
    masked_sum,
    safe,
)

__all__ = [
    "cispo_loss",
    "decoupled_ppo_loss",
    "gmpo_loss",
    "gspo_loss",
    "pg_loss",
    "ppo_clip_loss",
    "sapo_loss",
    "value_loss",
]

def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, old_name: str = "old_logp"):
    m = check_token_pair("logp", logp, old_name, old_logp, mask)
    dt = compute_dtype(logp)
    lp = safe(logp, m, dt)
    olp = safe(old_logp, m, dt).detach()
    adv = broadcast_advantages(advantages, logp, m).detach()
    return m, dt, lp, olp, adv


def _check_eps(eps_low: float, eps_high: float, *, low_max: float = 1.0, low_inclusive: bool = False):
    if low_inclusive:
        el = check_real("eps_low", eps_low, ge=0.0, le=low_max)
    else:
        el = check_real("eps_low", eps_low, ge=0.0, lt=low_max)
    eh = check_real("eps_high", eps_high, ge=0.0)
    return el, eh


def _approx_kl(log_ratio: Tensor, m: Tensor) -> Tensor:
    """k3 estimate of KL(π_old ‖ π_θ) from samples of π_old: ``r − 1 − log r`` with ``log r = logp − old_logp``."""
    lr = log_ratio.detach()
    return masked_mean(torch.expm1(lr) - lr, m)


def _zero(dt: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros((), dtype=dt, device=device)


def _clipfracs(low: Tensor, high: Tensor, m: Tensor, dt: torch.dtype, clipped: Tensor | None = None) -> dict:
    """The clip metrics every clipping loss reports, as masked token means: ``clipfrac`` (``clipped``, default
    ``low | high``: the tokens a clip is active on), ``clipfrac_low`` and ``clipfrac_high``."""
    clipped = low | high if clipped is None else clipped
    return {"clipfrac": masked_mean(clipped.to(dt), m), "clipfrac_low": masked_mean(low.to(dt), m),
            "clipfrac_high": masked_mean(high.to(dt), m)}


def ppo_clip_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """Asymmetric PPO-clip: ``ℓ = max(−r·A, −clip(r, 1 − eps_low, 1 + eps_high)·A)``.

    Dual-clip (Ye et al. 2020), for ``A < 0`` only: ``ℓ = min(ℓ, −c·A)`` with ``c = dual_clip > 1``.
    The gradient is exactly 0 wherever the clipped branch is active.

    Metrics (masked token means): ``clipfrac_low`` (``r < 1 − eps_low`` and ``A < 0``: lower clip active),
    ``clipfrac_high`` (``r > 1 + eps_high`` and ``A > 0``), ``dual_clipfrac`` (dual clip active: ``A < 0`` and
    ``r > c``), ``clipfrac`` (any of the three, which are disjoint: the tokens whose gradient a clip zeroes),
    ``approx_kl`` (k3 estimate of KL(π_old‖π_θ): ``r − 1 − log r``).
    """
    m, dt, lp, olp, adv = _prepare(logp, old_logp, advantages, mask)
    el, eh = _check_eps(eps_low, eps_high)
    if dual_clip is not None:
        dual_clip = check_real("dual_clip", dual_clip, gt=1.0)
    log_ratio = (lp - olp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - el, 1.0 + eh)
    loss = torch.maximum(loss1, loss2)
    neg = adv < 0
    if dual_clip is not None:
        loss3 = -adv * dual_clip
        dual_active = neg & (loss3 < loss)
        loss = torch.where(neg, torch.minimum(loss, loss3), loss)
    else:
        dual_active = torch.zeros_like(m)
    loss = safe(loss, m, dt)
    r = ratio.detach()
    low = (r < 1.0 - el) & neg
    high = (r > 1.0 + eh) & (adv > 0)
    metrics = Metrics(
        **_clipfracs(low, high, m, dt, low | high | dual_active),
        dual_clipfrac=masked_mean(dual_active.to(dt), m),
        approx_kl=_approx_kl(log_ratio, m),
    )
    return loss, metrics


def _seq_token_form(seq_log: Tensor, token_log: Tensor) -> Tensor:
    """Token form of a sequence-level log-ratio: value ``seq_log`` (per row), gradient of ``token_log`` per token.

    ``sg(seq_log) + token_log − sg(token_log)``: the value of every token equals the sequence quantity, and the
    gradient w.r.t. token t's inputs is that of ``token_log[t]`` (scaled by the sequence value after ``exp``).
    """
    return seq_log.detach()[:, None] + token_log - token_log.detach()


def gspo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """GSPO (Zheng et al. 2025), token form.

    Sequence ratio ``s_i = exp(mean_t log r_{i,t})`` (geometric mean over the valid tokens, mean log-ratio
    clamped to ±20). Token form ``s_{i,t} = sg(s_i)·exp(logp_t − sg(logp_t))``: its value equals ``s_i`` and its
    gradient is ``s_i·∇logp_t``, so aggregating with ``seq-mean-token-mean`` reproduces the sequence-level
    GSPO gradient ``s_i/|y_i|·Σ_t ∇logp_t``. Loss ``max(−s·A, −clip(s, 1 − eps_low, 1 + eps_high)·A)``
    (paper defaults 3e-4 / 4e-4). ``[B, T]`` advantages are used per token (GSPO-token): the gradient is then
    ``−A_t·s_i·∇logp_t`` by definition, which is not the derivative of the per-token value when A varies within a
    sequence (the paper's GSPO-token objective). All of this holds for any ``aggregate`` mode, since each weights
    the tokens of one sequence equally.

    Metrics: ``clipfrac_low``, ``clipfrac_high`` (fraction of valid tokens whose sequence ratio is clipped in the
    active direction: ``s < 1 − eps_low`` with ``A < 0``, ``s > 1 + eps_high`` with ``A > 0``), ``clipfrac``
    (either), ``seq_ratio_mean`` (mean of ``s_i`` over non-empty sequences), ``approx_kl`` (per token).
    """
    m, dt, lp, olp, adv = _prepare(logp, old_logp, advantages, mask)
    el, eh = _check_eps(eps_low, eps_high)
    log_ratio = lp - olp
    n = m.sum(-1)
    seq_log = (masked_sum(log_ratio, m, -1) / n.clamp(min=1).to(dt)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(_seq_token_form(seq_log, lp))
    loss = torch.maximum(-adv * s, -adv * s.clamp(1.0 - el, 1.0 + eh))
    loss = safe(loss, m, dt)
    sd = s.detach()
    has = n > 0
    low = (sd < 1.0 - el) & (adv < 0)
    high = (sd > 1.0 + eh) & (adv > 0)
    metrics = Metrics(
        **_clipfracs(low, high, m, dt),
        seq_ratio_mean=masked_mean(torch.exp(seq_log.detach()), has),
        approx_kl=_approx_kl(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m),
    )
    return loss, metrics


def cispo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """CISPO (MiniMax-M1): ``ℓ = −sg(clip(r, 1 − eps_low, 1 + eps_high))·A·logp``.

    The clipped IS weight is detached, so the gradient flows only through ``logp`` (``−w·A·∇logp``) and no token
    is dropped. Bounds are offsets from 1, as in verl and SLIME; TRL and ms-swift instead take an *absolute* cap
    on the ratio (their ``epsilon_high=5`` means ``r ≤ 5``, i.e. ``eps_high=4`` here). The default
    ``eps_low=1.0`` puts the lower bound at 0 (no lower clip, as the paper); ``eps_high=0.28``.

    Metrics: ``clipfrac_low`` (``r < 1 − eps_low``), ``clipfrac_high`` (``r > 1 + eps_high``), ``clipfrac``
    (either: the fraction of valid tokens whose weight is clipped, whatever the sign of A, since CISPO clips the
    weight, not the objective), ``is_weight_mean`` (mean clipped weight), ``approx_kl``.
    """
    m, dt, lp, olp, adv = _prepare(logp, old_logp, advantages, mask)
    el, eh = _check_eps(eps_low, eps_high, low_inclusive=True)
    log_ratio = (lp - olp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    w = ratio.clamp(1.0 - el, 1.0 + eh)
    loss = safe(-w * adv * lp, m, dt)
    low = ratio < 1.0 - el
    high = ratio > 1.0 + eh
    metrics = Metrics(
        **_clipfracs(low, high, m, dt),
        is_weight_mean=masked_mean(w, m),
        approx_kl=_approx_kl(log_ratio, m),
    )
    return loss, metrics


def sapo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """SAPO soft-gated objective: ``ℓ = −(4/τ)·sigmoid(τ·(r − 1))·A`` with τ = tau_pos if A > 0 else tau_neg.

    A smooth replacement of the hard clip (so no ``clipfrac``): at r = 1 the gradient is ``−A·∇logp`` (as PPO),
    and it decays smoothly as r leaves 1, faster for negative advantages (tau_neg > tau_pos).

    Metrics: ``gate_mean`` (mean of ``4·σ'(τ(r−1))``·r, the effective gradient weight relative to PG),
    ``approx_kl``.
    """
    m, dt, lp, olp, adv = _prepare(logp, old_logp, advantages, mask)
    tp = check_real("tau_pos", tau_pos, gt=0.0)
    tn = check_real("tau_neg", tau_neg, gt=0.0)
    log_ratio = (lp - olp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tp), torch.full_like(adv, tn))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = safe(-(4.0 / tau) * gate * adv, m, dt)
    g = gate.detach()
    metrics = Metrics(
        gate_mean=masked_mean(4.0 * g * (1.0 - g) * ratio.detach(), m),
        approx_kl=_approx_kl(log_ratio, m),
    )
    return loss, metrics


_GMPO_EPS_LOW = 1.0 - math.exp(-0.4)
_GMPO_EPS_HIGH = math.exp(0.4) - 1.0


def gmpo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    eps_low: float = _GMPO_EPS_LOW,
    eps_high: float = _GMPO_EPS_HIGH,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """GMPO (Zhao et al. 2025): geometric mean of sign-aware clipped per-token ratios.

    Per token, clip the log-ratio to ``[log(1 − eps_low), log(1 + eps_high)]`` in the PPO (sign-aware)
    direction: ``ℓr_t = sign(A)·min(sign(A)·log r_t, sign(A)·clip(log r_t))`` (the pessimistic one, as
    ``min(rA, clip(r)A)``); the sequence ratio is ``g_i = exp(mean_t ℓr_t)`` over the valid tokens. Loss
    ``−A·g_i`` in token form ``−A·sg(g_i)·exp(ℓr_t − sg(ℓr_t))``: each token carries ``g_i``'s value and, with
    ``seq-mean-token-mean`` aggregation, the gradient ``−A·g_i/|y_i|·Σ_t ∇ℓr_t`` (0 for clipped tokens).
    The paper's clip range ``(e^{−0.4}, e^{0.4})`` is the default: eps_low = 1 − e^{−0.4}, eps_high = e^{0.4} − 1.
    With ``[B, T]`` advantages the sign is taken per token.

    Metrics: ``clipfrac`` (fraction of valid tokens whose log-ratio is clipped, either bound), ``clipfrac_low``
    (``log r < log(1 − eps_low)`` with ``A < 0``), ``clipfrac_high`` (``log r > log(1 + eps_high)`` with
    ``A ≥ 0``, the sign the formula gives A = 0), ``seq_ratio_mean``, ``approx_kl``.
    """
    m, dt, lp, olp, adv = _prepare(logp, old_logp, advantages, mask)
    el, eh = _check_eps(eps_low, eps_high)
    lo, hi = math.log(1.0 - el), math.log(1.0 + eh)
    log_ratio = (lp - olp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sign = torch.where(adv < 0, -torch.ones_like(adv), torch.ones_like(adv))
    clipped = log_ratio.clamp(lo, hi)
    lr_eff = sign * torch.minimum(sign * log_ratio, sign * clipped)
    n = m.sum(-1)
    seq_log = masked_sum(lr_eff, m, -1) / n.clamp(min=1).to(dt)
    g = torch.exp(_seq_token_form(seq_log, lr_eff))
    loss = safe(-adv * g, m, dt)
    lrd = log_ratio.detach()
    low = (lrd < lo) & (adv < 0)
    high = (lrd > hi) & ~(adv < 0)
    metrics = Metrics(
        **_clipfracs(low, high, m, dt, lr_eff.detach() != lrd),  # the clipped tokens: equals low | high
        seq_ratio_mean=masked_mean(torch.exp(seq_log.detach()), n > 0),
        approx_kl=_approx_kl(log_ratio, m),
    )
    return loss, metrics


def pg_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"] | None,
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    weights: Float[Tensor, "B T"] | None = None,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """Vanilla policy gradient / REINFORCE: ``ℓ = −w·A·logp`` (w an optional per-token IS weight, detached).

    The signature of every policy loss, ``(logp, old_logp, advantages, mask)``. The loss does not use
    ``old_logp``; it feeds ``approx_kl`` (k3 of KL(π_old‖π_θ), as in the other losses). ``old_logp=None`` means
    π_old = π_θ (one update per batch): ``approx_kl`` is then exactly 0.

    ``weights`` (e.g. from ``rollout_correction``) may hold NaN/inf at masked positions. Metrics:
    ``weight_mean`` (mean weight over valid tokens; 1 without weights), ``approx_kl``.
    """
    check_floating("logp", logp)
    check_ndim("logp", logp, 2, "[B, T]")
    if old_logp is None:
        m = as_bool_mask(mask, logp)
        dt = compute_dtype(logp)
        lp = safe(logp, m, dt)
        olp = lp.detach()
    else:
        m = check_token_pair("logp", logp, "old_logp", old_logp, mask)
        dt = compute_dtype(logp)
        lp = safe(logp, m, dt)
        olp = safe(old_logp, m, dt).detach()
    adv = broadcast_advantages(advantages, logp, m).detach()
    if weights is not None:
        check_floating("weights", weights)
        check_same_shape("logp", logp, "weights", weights)
        w = safe(weights, m, dt).detach()
    else:
        w = torch.ones_like(lp)
    loss = safe(-w * adv * lp, m, dt)
    log_ratio = (lp - olp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return loss, Metrics(weight_mean=masked_mean(w, m), approx_kl=_approx_kl(log_ratio, m))


def decoupled_ppo_loss(
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    mask: Shaped[Tensor, "B T"],
    *,
    rollout_logp: Float[Tensor, "B T"],
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    rollout_weight_cap: float | None = None,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """Decoupled PPO (AReaL): ``ℓ = w·PPOclip(π_θ/π_old)`` with ``w = π_old/π_rollout`` (detached).

    ``old_logp`` is the proximal policy (the trainer's log-probs before this update, AReaL's ``prox_logp``);
    ``rollout_logp`` (keyword) the behaviour policy that generated the tokens, i.e. the engine's processed
    log-probs (AReaL's ``behav_logp``). The trust region is centred on π_old; ``w`` corrects the off-policy
    sampling: ``log w = old_logp − rollout_logp``, clamped to ±20 before ``exp``, as is the PPO log-ratio.
    As in AReaL, ``rollout_weight_cap`` *drops* tokens whose weight exceeds the cap (weight set to 0) rather
    than truncating them; a NaN weight is not above the cap, so its token is kept and its loss is NaN.

    Metrics: those of ``ppo_clip_loss`` (``clipfrac``, ``clipfrac_low``, ``clipfrac_high``, ``dual_clipfrac``,
    ``approx_kl``, measured against π_old) plus ``rollout_weight_mean`` (mean ``w`` over kept tokens) and
    ``rollout_capped_frac`` (fraction of valid tokens dropped by the cap).
    """
    m = check_token_pair("logp", logp, "old_logp", old_logp, mask)
    check_floating("rollout_logp", rollout_logp)
    check_same_shape("logp", logp, "rollout_logp", rollout_logp)
    cap = None if rollout_weight_cap is None else check_real("rollout_weight_cap", rollout_weight_cap, gt=0.0)
    dt = compute_dtype(logp)
    olp = safe(old_logp, m, dt).detach()
    rlp = safe(rollout_logp, m, dt).detach()
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, m, eps_low=eps_low, eps_high=eps_high)
    w = torch.exp((olp - rlp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    # "drop when above the cap", not "keep when below": a NaN weight is not above the cap, so its token is kept
    # and the NaN reaches the loss (``w <= cap`` is False for NaN and would drop the token silently)
    keep = m if cap is None else m & ~(w > cap)
    w = safe(w, keep, dt)
    loss = safe(loss * w, m, dt)
    metrics["rollout_weight_mean"] = masked_mean(w, keep)
    metrics["rollout_capped_frac"] = masked_mean((m & ~keep).to(dt), m)
    return loss, metrics


def value_loss(
    values: Float[Tensor, "B T"],
    old_values: Float[Tensor, "B T"],
    returns: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    clip: float | None = 0.2,
) -> tuple[Float[Tensor, "B T"], Metrics]:
    """Clipped value loss ``½·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²)``; ``clip=None``: ``½(V − R)²``.

    Metrics: ``vf_clipfrac`` (fraction of valid tokens where the clipped branch is larger), ``vf_mse``.
    """
    m = check_token_pair("values", values, "old_values", old_values, mask)
    check_floating("returns", returns)
    check_same_shape("values", values, "returns", returns)
    dt = compute_dtype(values)
    v = safe(values, m, dt)
    vo = safe(old_values, m, dt).detach()
    ret = safe(returns, m, dt).detach()
    err1 = (v - ret) ** 2
    if clip is None:
        loss = 0.5 * err1
        clipfrac = _zero(dt, v.device)
    else:
        c = check_real("clip", clip, ge=0.0)
        v_clipped = vo + (v - vo).clamp(-c, c)
        err2 = (v_clipped - ret) ** 2
        loss = 0.5 * torch.maximum(err1, err2)
        clipfrac = masked_mean((err2 > err1).to(dt), m)
    loss = safe(loss, m, dt)
    return loss, Metrics(vf_clipfrac=clipfrac, vf_mse=masked_mean(err1.detach(), m))


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
