"""Reduce a per-token loss ``[B, T]`` to a scalar with an explicit, optionally global, normaliser.

Give the global counts (all-reduced over data-parallel ranks and gradient-accumulation micro-batches) and the sum
of ``aggregate`` over all shards equals ``aggregate`` on the whole batch; without them the local counts are used,
which reproduces the known bugs when shards differ in size (verl #3741, TRL #5619, ms-swift #10117).
"""

from __future__ import annotations

import numbers

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks._checks import as_bool_mask, check_choice, check_floating, check_ndim
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import compute_dtype, masked_sum

__all__ = ["AGG_MODES", "aggregate"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")

Count = int | float | Tensor


def _count(
    name: str, value: Count | None, default: Tensor, dt: torch.dtype, any_valid: Tensor,
    at_least: Tensor | None = None,
) -> Tensor:
    """The normaliser to divide by (a 0-dim tensor in ``dt``), read without a host sync.

    A count must be positive and finite. A count of 0 is right only when nothing is valid anywhere: then this
    call has no valid token either, its masked sum is 0, and dividing by 1 gives the 0 loss. Every other count
    that cannot be right gives NaN, so the loss (and its gradient) show it instead of being scaled by a guess:
    a tensor that is negative, NaN or ±inf, or 0 while this call has valid tokens, and any count (tensor or
    Python) below ``at_least`` when given (a bound read from the mask, so compared on the device, never on the
    host). Python numbers are checked on the host for free, so a negative, NaN, infinite or non-numeric one
    raises; a Python 0 follows the tensor rule.
    """
    if value is None:
        return default.to(dt)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ArgumentError(f"{name}: expected a number or a 1-element tensor, got shape {list(value.shape)}")
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise ArgumentError(f"{name}: expected a real count, got a tensor of dtype {value.dtype}")
        v = value.reshape(()).to(device=default.device, dtype=dt)
    elif isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < float("inf")):
        raise ArgumentError(f"{name}: expected a finite number >= 0 (0 only when nothing is valid), got {value!r}")
    else:
        v = torch.tensor(float(value), dtype=dt, device=default.device)
    one = torch.ones((), dtype=dt, device=v.device)
    nan = torch.full((), float("nan"), dtype=dt, device=v.device)
    empty_ok = (v == 0) & ~any_valid
    ok = (v > 0) & torch.isfinite(v)
    if at_least is not None:
        ok = ok & (v >= at_least.to(dt))
    return torch.where(ok, v, torch.where(empty_ok, one, nan))


def aggregate(
    per_token: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    max_len: Count | None = None,
) -> Float[Tensor, ""]:
    """Aggregate a per-token loss; masked positions are ignored (even if NaN/inf).

    With ``N`` = num_tokens (default: local valid tokens), ``S`` = num_seqs (default: local rows with at least one
    valid token; for ``seq-mean-token-sum-norm``: local rows ``B``), ``L`` = max_len (default ``T``):

    - ``token-mean``: ``Σ mℓ / N``
    - ``seq-mean-token-mean``: ``Σ_i (Σ_t mℓ / |y_i|) / S``
    - ``seq-mean-token-sum``: ``Σ mℓ / S``
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): ``Σ mℓ / (S·L)``
    - ``token-sum``: ``Σ mℓ``

    Golden: ℓ=[[1,1,1,1],[2,2,0,0]], m=[[1,1,1,1],[1,1,0,0]] → 1.3333, 1.5, 4.0, 1.0.
    Counts may be Python numbers or 1-element tensors (e.g. all-reduced over ranks). A count of 0 gives a 0 loss
    when this call has no valid token (a global batch with nothing to train on) and NaN otherwise; a tensor count
    that is negative, NaN or ±inf gives NaN (read without a host sync); a Python count that is negative, NaN,
    ±inf, a bool or not a number raises ``ArgumentError``. ``max_len`` is a bound on every row's length, so one
    below the longest row's valid tokens (``max_len=2`` for a row of 4 valid tokens) gives NaN too, value and
    gradient. It is compared with the valid tokens of each row, not with ``T``: in a next-token layout ``T`` also
    spans the prompt positions, and padding columns are no tokens; the comparison reads the mask, so it is made
    on the device (NaN), not on the host (an error would need a sync). ``num_tokens`` and ``num_seqs`` may be
    smaller than this call's own counts, even fractional: a data-parallel rank whose gradients are averaged
    over ``W`` ranks passes the global count divided by ``W``. Without counts, a local count of 0 (an all-false
    mask) gives 0, never NaN. Accumulates in float32 (float64 for float64 input).
    """
    check_floating("per_token", per_token)
    check_ndim("per_token", per_token, 2, "[B, T]")
    m = as_bool_mask(mask, per_token, like_name="per_token")
    check_choice("mode", mode, AGG_MODES)
    dt = compute_dtype(per_token)
    x = per_token.to(dt)
    b, t = x.shape
    if mode == "token-sum":
        return masked_sum(x, m)
    any_valid = m.any()
    # The default (local) counts are clamped to 1: a local count is 0 only when the masked sum is 0 too.
    if mode == "token-mean":
        n = _count("num_tokens", num_tokens, m.sum().clamp(min=1), dt, any_valid)
        return masked_sum(x, m) / n
    lengths = m.sum(-1)
    if mode == "seq-mean-token-sum-norm":
        longest = torch.cat([lengths, lengths.new_zeros(1)]).amax()  # 0 for an empty batch
        s = _count("num_seqs", num_seqs, torch.tensor(max(b, 1), device=x.device), dt, any_valid)
        L = _count("max_len", max_len, torch.tensor(max(t, 1), device=x.device), dt, any_valid, longest)
        return masked_sum(x, m) / (s * L)
    s = _count("num_seqs", num_seqs, (lengths > 0).sum().clamp(min=1), dt, any_valid)
    if mode == "seq-mean-token-sum":
        return masked_sum(x, m) / s
    per_seq = masked_sum(x, m, -1) / lengths.clamp(min=1).to(dt)
    return per_seq.sum() / s
