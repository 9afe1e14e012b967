"""The policy-loss flags of the GRPO loops and distillation: ``--loss``, the clip offsets, the train/rollout
correction, and their checks. The update itself is written out in ``cookbook/grpo.py``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxtyping import Bool, Float
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.losses import cispo_loss, decoupled_ppo_loss, gspo_loss, ppo_clip_loss

from .flags import check_at_least, opt

POLICY_LOSSES: dict[str, Callable] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "decoupled": decoupled_ppo_loss,
}
CORRECTION_CAP = 2.0  # --correction tis|mis without --correction-cap: ρ = π_old/π_rollout bounded by 2 (and 1/2)


def loss_defaults(arg: str) -> str:
    """``"ppo 0.2, gspo 0.0003, ..."``: the library's own default of ``arg`` for each policy loss (read from the
    signatures, so the flags' help texts cannot drift from the code)."""
    return ", ".join(f"{name} {inspect.signature(fn).parameters[arg].default:g}" for name, fn in POLICY_LOSSES.items())


@dataclass
class LossFlags:
    """The policy-loss flags (a loop's ``Config`` inherits them; checked by :func:`check_loss_flags`)."""

    loss: str = opt("ppo", "policy loss", tuple(POLICY_LOSSES))
    eps_low: float | None = opt(None, "clip offset below 1 (ratio ≥ 1 − eps_low; cispo: IS-weight floor); "
                                      f"default: the loss's own ({loss_defaults('eps_low')})", type=float)
    eps_high: float | None = opt(None, "clip offset above 1 (ratio ≤ 1 + eps_high); default: the loss's own "
                                       f"({loss_defaults('eps_high')})", type=float)
    rollout_weight_cap: float | None = opt(None, "--loss decoupled only: drop tokens whose π_old/π_rollout "
                                                 "exceeds this (AReaL); default: no cap", type=float)
    correction: str = opt("auto", "train/rollout mismatch correction on ρ = π_old/π_rollout; auto: tis when the "
                                  "engine samples in another dtype than the trainer computes in (--engine-dtype; "
                                  "grpo_async: --rollout-dtype fp8), else none",
                          ("auto", "tis", "mis", "none"))
    correction_cap: float | None = opt(None, f"--correction tis|mis only: tis truncates ρ at this, mis masks tokens "
                                             f"with ρ outside [1/cap, cap]; default {CORRECTION_CAP}", type=float)


def check_loss_flags(cfg: Any) -> None:
    """Refuse loss flags that would be ignored: ``rollout_weight_cap`` belongs to ``--loss decoupled`` only and
    ``correction_cap`` to ``--correction tis|mis`` only. Raises :class:`ArgumentError` naming the flag."""
    if cfg.loss not in POLICY_LOSSES:
        raise ArgumentError(f"--loss: expected one of {sorted(POLICY_LOSSES)}, got {cfg.loss!r}")
    if cfg.rollout_weight_cap is not None and cfg.loss != "decoupled":
        raise ArgumentError(f"--rollout-weight-cap: only --loss decoupled weights tokens by π_old/π_rollout, got "
                            f"--loss {cfg.loss}; use --correction tis|mis --correction-cap for the other losses")
    if cfg.correction_cap is not None and cfg.correction == "none":
        raise ArgumentError("--correction-cap: bounds --correction tis|mis, got --correction none")
    if cfg.correction_cap is not None and not cfg.correction_cap > 1.0:
        raise ArgumentError(f"--correction-cap: expected a float > 1 (the upper bound of π_old/π_rollout), "
                            f"got {cfg.correction_cap}")
    check_at_least(cfg, 1, "ppo_epochs", "mini_batches")


def policy_loss(
    cfg: Any,
    logp: Float[Tensor, "B T"],
    old_logp: Float[Tensor, "B T"],
    advantages: Float[Tensor, " B"],
    mask: Bool[Tensor, "B T"],
    *,
    rollout_logp: Float[Tensor, "B T"],
) -> tuple[Float[Tensor, "B T"], dict[str, Tensor]]:
    """Per-token loss of ``cfg.loss`` with the clip offsets ``cfg.eps_low``/``cfg.eps_high`` (when given; else the
    loss's own defaults), ratios ``exp(logp − old_logp)``. ``decoupled`` also takes the engine's log-probs
    (AReaL's behaviour policy) and ``cfg.rollout_weight_cap``. Returns ``(per_token_loss [B, T], metrics)``."""
    eps = {k: v for k in ("eps_low", "eps_high") if (v := getattr(cfg, k)) is not None}
    fn = POLICY_LOSSES[cfg.loss]
    if cfg.loss == "decoupled":
        return fn(logp, old_logp, advantages, mask, rollout_logp=rollout_logp, **eps,
                  rollout_weight_cap=cfg.rollout_weight_cap)
    return fn(logp, old_logp, advantages, mask, **eps)
