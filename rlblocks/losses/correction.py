"""Training/rollout mismatch: importance weights that correct it, and metrics that measure it.

``ρ = π_old / π_rollout`` per token, ``log ρ = old_logp − rollout_logp``: ``old_logp`` are the trainer's
log-probs of the sampled tokens before this update, ``rollout_logp`` the engine's processed log-probs of the same
tokens. The rollout engine (vLLM, SGLang) and the trainer compute different probabilities for the same tokens
(kernels, precision, sampling filters, or a policy several versions old); these weights correct the policy
gradient for that and the metrics tell how large the gap is.

The first argument was called ``train_logp`` before; ``train_logp=`` still works for one release, with a
DeprecationWarning.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from rlblocks._deprecate import renamed_kwargs
from rlblocks.losses._common import (
    LOG_RATIO_CLAMP,
    check_choice,
    check_number,
    check_token_pair,
    masked_mean,
    masked_sum,
    safe,
)

__all__ = ["mismatch_metrics", "rollout_correction"]


def _log_rho(old_logp: Tensor, rollout_logp: Tensor, m: Tensor) -> Tensor:
    """Detached fp32 token log-ratio ``old_logp − rollout_logp``, 0 at masked positions (fp64 for fp64 inputs)."""
    dt = torch.float64 if old_logp.dtype == torch.float64 else torch.float32
    return (safe(old_logp, m, dt) - safe(rollout_logp, m, dt)).detach()


@renamed_kwargs(train_logp="old_logp")
def rollout_correction(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float | None = 2.0,
    lower: float | None = None,
) -> tuple[Float[Tensor, "B T"], Bool[Tensor, "B T"], dict[str, Tensor]]:
    """Importance weights ``ρ = π_old/π_rollout`` for the train/rollout mismatch. Returns
    ``(weights, keep_mask, metrics)``.

    Levels (ρ broadcast to the tokens of a sequence for the sequence levels):

    - ``"token"``: ``ρ_t = exp(clamp(log ρ_t, ±20))``;
    - ``"sequence"``: ``ρ_i = exp(clamp(Σ_t log ρ_t, ±20))`` (product of the token ratios);
    - ``"geometric"``: ``ρ_i = exp(clamp(mean_t log ρ_t, ±20))`` (geometric mean).

    Modes:

    - ``"truncate"``: ``weights = min(ρ, upper)`` (then ``max(·, lower)`` if ``lower`` is given),
      ``keep_mask = mask`` (no token is dropped);
    - ``"mask"``: ``keep_mask = mask & ¬(ρ < lower ∨ ρ > upper)`` with ``lower`` defaulting to 0,
      ``weights = ρ`` where kept, else 0. A NaN ρ (NaN in valid data) is kept with weight NaN, never dropped.

    ``upper=None`` means no upper bound. Weights are detached, 0 at masked positions, float32 (float64 for
    float64 inputs). Multiply them into a per-token loss (e.g. ``pg_loss(..., weights=w)``) and use ``keep_mask``
    as its mask. Metrics (0-dim): ``weight_mean`` (over kept tokens), ``clipped_frac`` (fraction of valid tokens
    whose weight was truncated, truncate mode) or ``masked_frac`` (fraction of valid tokens dropped, mask mode),
    ``rho_mean`` (mean of ρ over valid tokens).
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    check_choice("level", level, ("token", "sequence", "geometric"))
    check_choice("mode", mode, ("truncate", "mask"))
    hi = float("inf") if upper is None else check_number("upper", upper, gt=0.0)
    if lower is not None:
        lo = check_number("lower", lower, ge=0.0, le=hi)
    else:
        lo = None
    lr = _log_rho(old_logp, rollout_logp, m)
    dt = lr.dtype
    if level == "token":
        log_rho = lr
    else:
        total = masked_sum(lr, m, -1)
        if level == "geometric":
            total = total / m.sum(-1).clamp(min=1).to(dt)
        log_rho = total[:, None].expand_as(lr)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "truncate":
        w = rho.clamp(max=hi)
        if lo is not None:
            w = w.clamp(min=lo)
        keep = m
        changed = masked_mean(((w != rho) & ~torch.isnan(rho)).to(dt), m)  # a NaN ρ stays NaN: not "clipped"
        metrics = {"clipped_frac": changed}
    else:
        # drop what is provably outside the band; a NaN ratio is kept (weight NaN) so it shows in the loss
        keep = m & ~((rho < (0.0 if lo is None else lo)) | (rho > hi))
        w = rho
        metrics = {"masked_frac": masked_mean((m & ~keep).to(dt), m)}
    w = safe(w, keep, dt)
    metrics["weight_mean"] = masked_mean(w, keep)
    metrics["rho_mean"] = masked_mean(rho, m)
    return w, keep, metrics


@renamed_kwargs(train_logp="old_logp")
def mismatch_metrics(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
) -> dict[str, Tensor]:
    """Size of the train/rollout mismatch, as 0-dim float32 tensors (detached, no host sync).

    With ``l = rollout_logp − old_logp`` (so KL(π_rollout‖π_train) estimated from the rollout samples) and
    ``ρ = exp(clamp(−l, ±20))``:

    - ``kl_k1`` = masked mean of l; ``kl_k3`` = masked mean of ``e^{−l} − 1 + l``;
    - ``ppl_train`` = exp(−masked token mean of old_logp) (the trainer's); ``ppl_rollout`` likewise;
    - ``chi2_token`` = E[ρ²] − 1 over valid tokens;
    - ``chi2_seq`` = E[ρ_seq²] − 1 over non-empty sequences, ``ρ_seq = exp(clamp(Σ_t log ρ_t, ±20))``;
    - ``ess`` = 1 / E[(ρ/E[ρ])²] = E[ρ]² / E[ρ²] over valid tokens, in (0, 1].

    With no valid token: kl 0, perplexities 1, χ² 0, ess 1.
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    lr = _log_rho(old_logp, rollout_logp, m)
    dt = lr.dtype
    l_ = -lr
    rho = torch.exp(lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    any_valid = m.any()
    seq_has = m.any(-1)
    rho_seq = torch.exp(masked_sum(lr, m, -1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    e_rho = masked_mean(rho, m)
    e_rho2 = masked_mean(rho * rho, m)
    one = torch.ones((), dtype=dt, device=lr.device)
    zero = torch.zeros((), dtype=dt, device=lr.device)
    out = {
        "kl_k1": masked_mean(l_, m),
        "kl_k3": masked_mean(rho - 1.0 + l_, m),
        "ppl_train": torch.exp(-masked_mean(safe(old_logp, m, dt).detach(), m)),
        "ppl_rollout": torch.exp(-masked_mean(safe(rollout_logp, m, dt).detach(), m)),
        "chi2_token": torch.where(any_valid, e_rho2 - 1.0, zero),
        "chi2_seq": torch.where(seq_has.any(), masked_mean(rho_seq * rho_seq, seq_has) - 1.0, zero),
        "ess": torch.where(any_valid, e_rho * e_rho / torch.where(any_valid, e_rho2, one), one),
    }
    return {k: v.to(torch.float32) if dt != torch.float64 else v for k, v in out.items()}
