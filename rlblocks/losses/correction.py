"""Training/rollout mismatch: the importance weights that correct it (``rlblocks.losses.mismatch`` measures it).

``ρ = π_old / π_rollout`` per token, ``log ρ = old_logp − rollout_logp``: ``old_logp`` are the trainer's
log-probs of the sampled tokens before this update, ``rollout_logp`` the engine's processed log-probs of the same
tokens. The rollout engine (vLLM, SGLang) and the trainer compute different probabilities for the same tokens
(kernels, precision, sampling filters, or a policy several versions old); these weights correct the policy
gradient for that and the metrics tell how large the gap is.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rlblocks._checks import check_choice, check_real, check_same_shape, check_tensor, check_token_pair
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import LOG_RATIO_CLAMP, detached_log_ratio, masked_mean, masked_sum, safe
from rlblocks.losses._groups import segment_index

__all__ = ["mismatch_metrics", "rollout_correction"]


def rollout_correction(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float | None = 2.0,
    lower: float | None = None,
    turn_ids: Int[Tensor, "B T"] | None = None,
) -> tuple[Float[Tensor, "B T"], Bool[Tensor, "B T"], dict[str, Tensor]]:
    """Importance weights ``ρ = π_old/π_rollout`` for the train/rollout mismatch. Returns
    ``(weights, keep_mask, metrics)``.

    Levels (ρ broadcast to the tokens of a sequence for the sequence levels):

    - ``"token"``: ``ρ_t = exp(clamp(log ρ_t, ±20))``;
    - ``"sequence"``: ``ρ_i = exp(clamp(Σ_t log ρ_t, ±20))`` (product of the token ratios);
    - ``"geometric"``: ``ρ_i = exp(clamp(mean_t log ρ_t, ±20))`` (geometric mean);
    - ``"segment"``: ``ρ_k = exp(clamp(mean_{t∈k} log ρ_t, ±20))`` per segment k of a row, broadcast to the
      segment's tokens: segment-level (per turn) IS for multi-turn trajectories, ROLL's ``"segment"``
      granularity (``roll/utils/train_infer_corrections.py``). Segments are the tokens of one ``turn_ids``
      value within a row (e.g. ``RolloutBatch.turn_ids``); without ``turn_ids``, the maximal runs of
      consecutive valid tokens, as ROLL cuts them (the model's turns are separated by masked tool output).
      ``"truncate"`` gives segment-level truncated IS (``min(ρ_k, upper)``), ``"mask"`` drops whole turns.

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
    check_choice("level", level, ("token", "sequence", "geometric", "segment"))
    if turn_ids is not None:
        if level != "segment":
            raise ArgumentError(f"turn_ids: only used with level='segment', got level={level!r}")
        check_tensor("turn_ids", turn_ids)
        if turn_ids.is_floating_point() or turn_ids.dtype.is_complex or turn_ids.dtype == torch.bool:
            raise ArgumentError(f"turn_ids: expected an integer tensor, got dtype {turn_ids.dtype}")
        check_same_shape("old_logp", old_logp, "turn_ids", turn_ids)
    check_choice("mode", mode, ("truncate", "mask"))
    hi = float("inf") if upper is None else check_real("upper", upper, gt=0.0)
    if lower is not None:
        lo = check_real("lower", lower, ge=0.0, le=hi)
    else:
        lo = None
    lr = detached_log_ratio(old_logp, rollout_logp, m)
    dt = lr.dtype
    if level == "token":
        log_rho = lr
    elif level == "segment":
        seg = segment_index(m, turn_ids).reshape(-1)
        n = lr.numel()
        sums = torch.zeros(n, dtype=dt, device=lr.device).index_add(0, seg, lr.reshape(-1))  # lr is 0 off-mask
        counts = torch.zeros(n, dtype=dt, device=lr.device).index_add(0, seg, m.reshape(-1).to(dt))
        log_rho = (sums / counts.clamp(min=1))[seg].reshape(lr.shape)
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


# mismatch_metrics lives in its own module; importing it from here keeps working
from rlblocks.losses.mismatch import mismatch_metrics  # noqa: E402
