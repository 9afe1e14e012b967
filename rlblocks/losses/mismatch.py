"""Train/rollout mismatch, in one place: the corrections, the masks and the metrics.

The rollout engine (vLLM, SGLang) and the trainer compute different probabilities for the same tokens (kernels,
precision, sampling filters, or a policy several versions old). Per token, ``ρ = π_old / π_rollout``,
``log ρ = old_logp − rollout_logp``: ``old_logp`` are the trainer's log-probs of the sampled tokens before this
update, ``rollout_logp`` the engine's processed log-probs of the same tokens. Log-ratios are clamped to ±20 before
``exp``. Bounds are absolute ratios (``lower``/``upper``), not offsets from 1.

One signature shape for every function here: ``f(trainer_logp, rollout_logp, mask, *, options)``, the trainer's
log-probs first (``old_logp``; ``logp``, this step's, for :func:`off_policy_sequence_mask`, whose rule reads the
policy being trained). Return shapes, by kind:

- corrections return ``(weights, keep, metrics)``: :func:`rollout_correction` (truncated / masked IS at token,
  sequence, geometric or per-turn segment level), :func:`icepop_correction`;
- masks return ``(keep, metrics)``: :func:`geometric_sequence_mask`, :func:`outlier_sequence_mask`,
  :func:`off_policy_sequence_mask` (OPSM);
- :func:`mismatch_metrics` returns the metrics only.

``keep`` is a subset of ``mask``; weights are detached, 0 at masked positions, float32 (float64 for float64
inputs); metrics are 0-dim tensors. No function does a host sync (each compiles with
``torch.compile(fullgraph=True)``). A token is dropped only when its statistic is *provably* outside the band: a
NaN ratio (NaN in valid data) keeps its token, so the NaN reaches the loss instead of vanishing with a dropped
token. Padding may hold NaN/inf and is never read.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rlblocks._checks import (
    as_int,
    check_choice,
    check_int,
    check_real,
    check_same_shape,
    check_tensor,
    check_token_pair,
)
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
from rlblocks.losses._groups import segment_index

__all__ = [
    "geometric_sequence_mask",
    "icepop_correction",
    "mismatch_metrics",
    "off_policy_sequence_mask",
    "outlier_sequence_mask",
    "rollout_correction",
]


# ================================================================================================ corrections
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


# ================================================================================================ masks
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


def off_policy_sequence_mask(
    logp: Float[Tensor, "B T"],
    rollout_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    advantages: Float[Tensor, "B T"] | Float[Tensor, " B"],
    delta: float,
) -> tuple[Bool[Tensor, "B T"], Metrics]:
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2). Returns ``(keep, metrics)``.

    A token is dropped when its advantage is negative and its sequence has drifted:
    ``A_{i,t} < 0`` and ``mean_t (rollout_logp − logp) > delta`` (the per-sequence mean over valid tokens, a k1
    estimate of KL(π_rollout‖π_θ)). ``logp`` is the policy being trained (π_θ, this step's log-probs, in the slot
    the other functions here give ``old_logp``); ``rollout_logp`` is the sampling policy as the engine reported it:
    DeepSeek-V3.2 takes "the sampling probability directly returned by the inference framework", so the test covers
    both the policy's staleness and the engine/trainer mismatch. Everything else valid is kept (a NaN drift or
    advantage keeps the token: it is never dropped on a NaN comparison). Metrics: ``masked_frac`` (valid tokens
    dropped), ``seq_masked_frac`` (non-empty sequences with a dropped token).
    """
    m = check_token_pair("logp", logp, "rollout_logp", rollout_logp, mask)
    d = check_real("delta", delta)
    dt = compute_dtype(logp)
    adv = broadcast_advantages(advantages, logp, m).detach()
    diff = (safe(rollout_logp, m, dt) - safe(logp, m, dt)).detach()
    seq_kl = masked_sum(diff, m, -1) / m.sum(-1).clamp(min=1).to(dt)
    drop = (adv < 0) & (seq_kl > d)[:, None]
    keep = m & ~drop
    has = m.any(-1)
    metrics = Metrics(
        masked_frac=masked_mean((m & ~keep).to(dt), m),
        seq_masked_frac=masked_mean((m & ~keep).any(-1).to(dt), has),
    )
    return keep, metrics


# ================================================================================================ metrics
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
