"""How far the trainer's probabilities are from the engine's: ``mismatch_metrics``.

``old_logp`` are the trainer's log-probs of the sampled tokens (before this update), ``rollout_logp`` the
engine's processed log-probs of the same tokens; ``ρ = π_old/π_rollout``, ``log ρ = old_logp − rollout_logp``.
Every metric is a detached 0-dim tensor computed without a host sync, so the function compiles with
``torch.compile(fullgraph=True)``; the per-version breakdown has one key set per staleness 0..η, fixed by the
Python ``max_staleness``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rlblocks._checks import as_int, check_int, check_real, check_same_shape, check_tensor, check_token_pair
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import LOG_RATIO_CLAMP, detached_log_ratio, masked_mean, masked_sum, safe

__all__ = ["mismatch_metrics"]


def _check_versions(versions: Tensor, like: Tensor, current_version: object, max_staleness: object) -> int:
    check_tensor("versions", versions)
    if versions.is_floating_point() or versions.dtype.is_complex or versions.dtype == torch.bool:
        raise ArgumentError(f"versions: expected an integer tensor [B, T] (-1 where none), got dtype {versions.dtype}")
    check_same_shape("old_logp", like, "versions", versions)
    if current_version is None:
        raise ArgumentError("current_version: required with versions (the trainer's version, an int or a 0-dim tensor)")
    if isinstance(current_version, Tensor):
        if current_version.numel() != 1 or current_version.is_floating_point() or current_version.dtype == torch.bool:
            raise ArgumentError(
                f"current_version: expected an int or a 1-element integer tensor, got {current_version.dtype} "
                f"of shape {list(current_version.shape)}"
            )
    elif as_int(current_version) is None:  # numpy ints are ints; a bool or a float is not a version
        raise ArgumentError(f"current_version: expected an int or a 1-element integer tensor, got {current_version!r}")
    what = "a Python int >= 0 with versions (it fixes the metric keys)"
    if isinstance(max_staleness, Tensor):  # reading it would be a host sync
        raise ArgumentError(f"max_staleness: expected {what}, got a tensor")
    return check_int("max_staleness", max_staleness, minimum=0, what=what)


def mismatch_metrics(
    old_logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    band: tuple[float, float] = (0.9, 1.1),
    versions: Int[Tensor, "B T"] | None = None,
    current_version: int | Int[Tensor, ""] | None = None,
    max_staleness: int | None = None,
) -> dict[str, Tensor]:
    """Size of the train/rollout mismatch, as 0-dim float32 tensors (float64 for float64 inputs).

    With ``l = rollout_logp − old_logp`` (so KL(π_rollout‖π_old) estimated from the rollout samples) and
    ``ρ = exp(clamp(−l, ±20))``:

    - ``kl_k1`` = masked mean of l; ``kl_k3`` = masked mean of ``e^{−l} − 1 + l``;
    - ``ppl_train`` = exp(−masked token mean of old_logp) (the trainer's); ``ppl_rollout`` likewise;
    - ``chi2_token`` = E[ρ²] − 1 over valid tokens;
    - ``chi2_seq`` = E[ρ_seq²] − 1 over non-empty sequences, ``ρ_seq = exp(clamp(Σ_t log ρ_t, ±20))``;
    - ``ess`` = 1 / E[(ρ/E[ρ])²] = E[ρ]² / E[ρ²] over valid tokens, in (0, 1];
    - ``ratio_in_band_frac``: fraction of valid tokens with ``band[0] ≤ ρ ≤ band[1]`` (default [0.9, 1.1], the
      band in which trl#6789 reports 48% of ratios at top_p = 0.8 without sampling-mask replay, 96% with it);
    - ``prob_corr``: Pearson correlation of the probabilities ``e^{old_logp}`` and ``e^{rollout_logp}`` over the
      valid tokens (two-pass, centred); NaN where it is undefined (fewer than two valid tokens, or one side
      constant), rather than a made-up 0 or 1.

    Per version (with ``versions [B, T]``, e.g. ``RolloutBatch.versions``, the weight version that produced each
    token, −1 where none; ``current_version``, the trainer's version, an int or a 0-dim tensor; and the Python
    int ``max_staleness`` η): with ``s = current_version − versions``, for each staleness ``s = 0..η``:
    ``staleness{s}_token_frac`` (fraction of valid tokens), ``staleness{s}_kl_k3`` and
    ``staleness{s}_ratio_in_band_frac`` (over that bucket's tokens; 0 if it is empty), and
    ``staleness_other_token_frac`` for valid tokens outside ``0..η`` (a version ahead of the trainer, older than
    η, or −1), so that the token fractions add up to 1 and no token goes uncounted. The keys depend only on η,
    so the graph is static.

    With no valid token: kl 0, perplexities 1, χ² 0, ess 1, band fraction 0, correlation NaN.
    NaN at a valid token propagates into every mean that reads it.
    """
    m = check_token_pair("old_logp", old_logp, "rollout_logp", rollout_logp, mask)
    if not (isinstance(band, tuple) and len(band) == 2):
        raise ArgumentError(f"band: expected a (low, high) tuple of ratios, got {band!r}")
    b_lo = check_real("band[0]", band[0], gt=0.0)
    b_hi = check_real("band[1]", band[1], ge=b_lo)
    eta = None if versions is None else _check_versions(versions, old_logp, current_version, max_staleness)
    lr = detached_log_ratio(old_logp, rollout_logp, m)
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
    k3 = rho - 1.0 + l_
    # comparisons with NaN are False, so a NaN ρ counts as outside the band (it is not "close")
    in_band = (rho >= b_lo) & (rho <= b_hi)
    olp = safe(old_logp, m, dt).detach()
    rlp = safe(rollout_logp, m, dt).detach()
    out = {
        "kl_k1": masked_mean(l_, m),
        "kl_k3": masked_mean(k3, m),
        "ppl_train": torch.exp(-masked_mean(olp, m)),
        "ppl_rollout": torch.exp(-masked_mean(rlp, m)),
        "chi2_token": torch.where(any_valid, e_rho2 - 1.0, zero),
        "chi2_seq": torch.where(seq_has.any(), masked_mean(rho_seq * rho_seq, seq_has) - 1.0, zero),
        "ess": torch.where(any_valid, e_rho * e_rho / torch.where(any_valid, e_rho2, one), one),
        "ratio_in_band_frac": masked_mean(in_band.to(dt), m),
        "prob_corr": _masked_corr(torch.exp(olp), torch.exp(rlp), m),
    }
    if eta is not None:
        cur = current_version.reshape(()) if isinstance(current_version, Tensor) else as_int(current_version)
        staleness = cur - versions
        n_valid = m.sum().clamp(min=1).to(dt)
        counted = torch.zeros_like(m)
        for s in range(eta + 1):
            sel = m & (staleness == s) & (versions >= 0)
            counted = counted | sel
            out[f"staleness{s}_token_frac"] = sel.sum().to(dt) / n_valid
            out[f"staleness{s}_kl_k3"] = masked_mean(k3, sel)
            out[f"staleness{s}_ratio_in_band_frac"] = masked_mean(in_band.to(dt), sel)
        out["staleness_other_token_frac"] = (m & ~counted).sum().to(dt) / n_valid
    return {k: v.to(torch.float32) if dt != torch.float64 else v for k, v in out.items()}


def _masked_corr(x: Tensor, y: Tensor, m: Tensor) -> Tensor:
    """Pearson correlation of ``x`` and ``y`` over ``m`` (two-pass); NaN where undefined."""
    n = m.sum().to(x.dtype)
    mx = masked_sum(x, m) / n.clamp(min=1)
    my = masked_sum(y, m) / n.clamp(min=1)
    dx = safe(x - mx, m, x.dtype)
    dy = safe(y - my, m, x.dtype)
    den = torch.sqrt((dx * dx).sum() * (dy * dy).sum())
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    ok = (n >= 2) & (den > 0)
    return torch.where(ok, (dx * dy).sum() / torch.where(ok, den, torch.ones_like(den)), nan)
