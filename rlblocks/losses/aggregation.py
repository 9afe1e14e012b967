"""Reduce a per-token loss ``[B, T]`` to a scalar with an explicit, optionally global, normaliser.

Give the global counts (all-reduced over data-parallel ranks and gradient-accumulation micro-batches) and the sum
of ``aggregate`` over all shards equals ``aggregate`` on the whole batch; without them the local counts are used,
which reproduces the known bugs when shards differ in size (verl #3741, TRL #5619, ms-swift #10117).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks._validate import as_bool_mask, check_floating, check_ndim
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import check_choice, compute_dtype, masked_sum

__all__ = ["AGG_MODES", "aggregate"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")

Count = int | float | Tensor


def _count(name: str, value: Count | None, default: Tensor, dt: torch.dtype) -> Tensor:
    if value is None:
        return default.to(dt)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ArgumentError(f"{name}: expected a number or a 1-element tensor, got shape {list(value.shape)}")
        v = value.reshape(()).to(device=default.device, dtype=dt)
        return torch.where(v > 0, v, torch.ones_like(v))  # a global count of 0 (nothing valid anywhere) gives 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ArgumentError(f"{name}: expected a positive number, got {value!r}")
    return torch.tensor(float(value), dtype=dt, device=default.device)


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
    Counts may be positive Python numbers or 1-element tensors (e.g. all-reduced; a tensor count of 0 is read as
    1). A local count of 0 is clamped to 1 too, so an all-false mask gives 0, never NaN.
    Accumulates in float32 (float64 for float64 input).
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
    if mode == "token-mean":
        n = _count("num_tokens", num_tokens, m.sum().clamp(min=1), dt)
        return masked_sum(x, m) / n
    lengths = m.sum(-1)
    if mode == "seq-mean-token-sum-norm":
        s = _count("num_seqs", num_seqs, torch.tensor(max(b, 1), device=x.device), dt)
        L = _count("max_len", max_len, torch.tensor(max(t, 1), device=x.device), dt)
        return masked_sum(x, m) / (s * L)
    s = _count("num_seqs", num_seqs, (lengths > 0).sum().clamp(min=1), dt)
    if mode == "seq-mean-token-sum":
        return masked_sum(x, m) / s
    per_seq = masked_sum(x, m, -1) / lengths.clamp(min=1).to(dt)
    return per_seq.sum() / s
