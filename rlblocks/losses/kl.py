"""KL estimators of KL(π ‖ π_ref) from samples of π, and KL-coefficient controllers.

``l = logp − ref_logp`` per token (Schulman's estimators, with ``ratio = π_ref/π = e^{−l}``):

- ``k1 = l`` (unbiased, high variance, can be negative);
- ``k2 = l²/2`` (biased, low variance; its gradient ``l·∇logp`` is the gradient of the true reverse KL in expectation);
- ``k3 = e^{−l} − 1 + l`` (unbiased, non-negative); known values l=+1 → 0.3679, l=−1 → 0.7183;
- ``abs = |l|``;
- ``low_var_kl`` = k3 with l clamped to ±20 and the result clamped to [−10, 10] (verl).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks._checks import (
    as_bool_mask,
    check_bool,
    check_choice,
    check_floating,
    check_int,
    check_real,
    check_same_shape,
)
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import LOG_RATIO_CLAMP, compute_dtype, safe

__all__ = ["AdaptiveKLController", "FixedKLController", "kl_estimate"]

KL_KINDS = ("k1", "k2", "k3", "abs", "low_var_kl")


def kl_estimate(
    logp: Float[Tensor, "*shape"],
    ref_logp: Float[Tensor, "*shape"],
    *,
    kind: str = "k3",
    straight_through: bool = False,
    mask: Shaped[Tensor, "*shape"] | None = None,
) -> Float[Tensor, "*shape"]:
    """Per-token estimate of KL(π‖π_ref) with ``l = logp − ref_logp``; any matching shapes (usually ``[B, T]``).

    ``kind`` is one of ``"k1" | "k2" | "k3" | "abs" | "low_var_kl"`` (formulas in the module docstring). In k3 the
    exponent is clamped (``e^{−clamp(l, −20, 20)}``) so the value stays finite. ``straight_through=True`` returns
    the value of ``kind`` with the gradient of k2 (verl's ``k3+``): ``sg(k) + k2 − sg(k2)``. ``ref_logp`` is
    detached. The result has the input's shape; reduce it with ``aggregate``.

    Padding. With ``mask``, the masked positions are padding: their inputs are never read (they may hold NaN/inf)
    and the output there is exactly 0. Without ``mask``, a position is padding when its log-ratio
    ``logp − ref_logp`` is not finite (NaN or ±inf in either input, or an overflow): its output is NaN and it gets
    exactly zero gradient. So NaN/inf padding masked later (``aggregate(kl, mask)``) reaches neither the value nor
    the gradient, for every ``kind`` and with ``straight_through`` (a plain formula would send ``NaN·0 = NaN``
    back through k2's ``l·∇logp``), while a non-finite value at a position that *is* data still shows as a NaN in
    whatever reads it. Finite padding is data to this function: mask it (here or in ``aggregate``) as usual.
    With a mask, a NaN at a valid position propagates to the value and the gradient.

    Computed in float32 (float64 for float64 inputs).
    """
    check_floating("logp", logp)
    check_floating("ref_logp", ref_logp)
    check_same_shape("logp", logp, "ref_logp", ref_logp)
    check_choice("kind", kind, KL_KINDS)
    check_bool("straight_through", straight_through)
    dt = compute_dtype(logp)
    if mask is not None:
        m = as_bool_mask(mask, logp)
        lr = safe(logp, m, dt) - safe(ref_logp, m, dt).detach()
        fill = torch.zeros((), dtype=dt, device=logp.device)
    else:
        raw = logp.to(dt) - ref_logp.to(dt).detach()
        m = torch.isfinite(raw.detach())
        # torch.where routes an exact zero gradient to the non-finite positions (a product with 0 would give NaN)
        lr = safe(raw, m, dt)
        fill = torch.full((), float("nan"), dtype=dt, device=logp.device)
    if kind == "k1":
        k = lr
    elif kind == "k2":
        k = 0.5 * lr * lr
    elif kind == "abs":
        k = lr.abs()
    else:
        lc = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k = torch.expm1(-lc) + lr if kind == "k3" else (torch.expm1(-lc) + lc).clamp(-10.0, 10.0)
    if straight_through:
        k2 = 0.5 * lr * lr
        k = k.detach() + (k2 - k2.detach())
    return torch.where(m, k, fill)


def _read_kl(current_kl: float | Tensor, n_steps: int) -> tuple[float, int]:
    """The arguments of ``update``: ``current_kl`` a number or a 1-element real tensor (read on the host, one
    sync), not NaN; ``n_steps`` a genuine int >= 0 (numpy ints fine, bools and floats refused)."""
    if isinstance(current_kl, Tensor):
        if current_kl.numel() != 1 or current_kl.dtype == torch.bool or current_kl.dtype.is_complex:
            raise ArgumentError(
                f"current_kl: expected a number or a 1-element real tensor (the batch's mean KL), got a "
                f"{current_kl.dtype} tensor of shape {list(current_kl.shape)}"
            )
        current_kl = float(current_kl.detach().reshape(()).double().item())
    kl = check_real("current_kl", current_kl)
    return kl, check_int("n_steps", n_steps, minimum=0)


class FixedKLController:
    """Constant KL coefficient. ``update`` checks the same arguments as the adaptive one and does nothing else."""

    def __init__(self, kl_coef: float) -> None:
        self.value = check_real("kl_coef", kl_coef, ge=0.0, finite=True)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        _read_kl(current_kl, n_steps)
        return self.value


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, the PPO-for-LMs target/horizon rule).

    ``error = clip(current_kl / target − 1, −0.2, 0.2)``; ``value *= 1 + error·n_steps / horizon``.
    Holds Python state: ``update`` converts a tensor ``current_kl`` to a float (one host sync, once per step,
    outside the loss). ``current_kl`` is a number or a 1-element tensor (a per-token KL tensor must be reduced
    first: ``ArgumentError`` otherwise); a NaN one raises, an infinite one saturates the clip.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = check_real("init_kl_coef", init_kl_coef, ge=0.0, finite=True)
        self.target = check_real("target", target, gt=0.0, finite=True)
        self.horizon = check_real("horizon", horizon, gt=0.0, finite=True)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        kl, n_steps = _read_kl(current_kl, n_steps)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
