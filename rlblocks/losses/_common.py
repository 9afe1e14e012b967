"""Helpers shared by the loss modules: dtype promotion, sanitising of padded positions, masked reductions.

The argument checks are in :mod:`rlblocks._checks`.

Nothing here reads tensor values on the host, so every helper is safe under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import check_floating, shape_str
from rlblocks.errors import ArgumentError

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (e^20 ≈ 4.9e8 stays finite in fp32 and bf16)."""


class Metrics(dict):
    """The ``dict[str, Tensor]`` of 0-dim metrics a loss returns (a plain ``dict``; the name marks what it holds)."""


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (so that ``gradcheck`` in float64 stays exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def broadcast_advantages(
    advantages: Tensor, like: Tensor, mask: Bool[Tensor, "B T"], *, name: str = "advantages", like_name: str = "logp"
) -> Float[Tensor, "B T"]:
    """Accept ``[B, T]`` or ``[B]`` advantages; return ``[B, T]`` in the compute dtype, zero at masked positions."""
    check_floating(name, advantages)
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ArgumentError(
                f"{name}: expected shape [B] = [{like.shape[0]}] or [B, T] = {shape_str(like)} "
                f"(from {like_name} {shape_str(like)}), got {shape_str(advantages)}"
            )
        advantages = advantages[:, None].expand(like.shape)
    elif advantages.shape != like.shape:
        raise ArgumentError(
            f"{name}: expected shape [B] = [{like.shape[0]}] or [B, T] = {shape_str(like)} "
            f"(from {like_name} {shape_str(like)}), got {shape_str(advantages)}"
        )
    return safe(advantages, mask, compute_dtype(like))


def safe(x: Tensor, mask: Bool[Tensor, "..."], dtype: torch.dtype) -> Tensor:
    """``x`` cast to ``dtype`` with masked positions replaced by 0.

    ``torch.where`` (never ``x * mask``) keeps NaN/inf in padding out of the value, and its backward routes an exact
    zero to the masked positions, so those never reach the gradient either.
    """
    return torch.where(mask, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def detached_log_ratio(a: Tensor, b: Tensor, m: Tensor) -> Tensor:
    """Detached ``a − b`` in fp32 (fp64 for fp64 ``a``), 0 at masked positions (never read there)."""
    dt = compute_dtype(a)
    return (safe(a, m, dt) - safe(b, m, dt)).detach()


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if dim is None:
        return torch.where(mask, x, zero).sum()
    return torch.where(mask, x, zero).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Masked mean; 0 (never NaN) where there is no valid element."""
    n = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)


def seq_lengths(mask: Bool[Tensor, "B T"]) -> Int[Tensor, " B"]:
    return mask.sum(-1)
