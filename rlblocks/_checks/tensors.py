"""Checks of tensor arguments: kind, dtype, number of dimensions, shape, masks.

Every refusal names the argument, the expected kind or shape (``[B, T]`` layouts spelled out) and what came. None
of them reads tensor values (no host sync), so they are safe inside ``torch.compile(fullgraph=True)``: they only
look at types, shapes and dtypes, which are static at trace time.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool
from torch import Tensor

from rlblocks.errors import ArgumentError

__all__ = [
    "as_bool_mask",
    "check_floating",
    "check_group_inputs",
    "check_integer",
    "check_last_dim",
    "check_ndim",
    "check_real_tensor",
    "check_same_shape",
    "check_tensor",
    "check_token_pair",
    "shape_str",
]


def shape_str(x: Tensor) -> str:
    """``[2, 3]`` for a tensor of shape ``(2, 3)``."""
    return "[" + ", ".join(str(int(s)) for s in x.shape) + "]"


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_floating(name: str, x: object) -> Tensor:
    check_tensor(name, x)
    if not x.is_floating_point():
        raise ArgumentError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def check_integer(name: str, x: object, layout: str = "") -> Tensor:
    """An integer tensor (not bool, not floating, not complex); ``layout`` (e.g. ``"[B, T]"``) is named in the
    message."""
    check_tensor(name, x)
    if x.is_floating_point() or x.dtype.is_complex or x.dtype == torch.bool:
        hint = f" {layout}" if layout else ""
        raise ArgumentError(f"{name}: expected an integer tensor{hint}, got dtype {x.dtype}")
    return x


def check_real_tensor(name: str, x: object, layout: str = "", *, allow_bool: bool = False) -> Tensor:
    """A real tensor: integer or floating, not complex; a bool tensor only with ``allow_bool`` (pass/fail rewards
    are numbers, a bool length is a mistake)."""
    check_tensor(name, x)
    if x.dtype.is_complex or (x.dtype == torch.bool and not allow_bool):
        hint = f" {layout}" if layout else ""
        raise ArgumentError(f"{name}: expected a real tensor{hint}, got dtype {x.dtype}")
    return x


def check_ndim(name: str, x: object, ndim: int | tuple[int, ...], layout: str = "") -> Tensor:
    check_tensor(name, x)
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        hint = f" {layout}" if layout else ""
        raise ArgumentError(f"{name}: expected a {want} tensor{hint}, got shape {shape_str(x)}")
    return x


def check_last_dim(name: str, x: object, symbol: str = "H") -> Tensor:
    """A tensor ``[..., symbol]`` whose last dimension is not empty (e.g. the hidden size of a contraction with a
    weight: over 0 entries it means nothing, and the flattening ``reshape(-1, 0)`` is ambiguous). The leading
    dimensions may be 0: an empty batch is a batch, and gives an empty result."""
    check_tensor(name, x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ArgumentError(f"{name}: expected shape [..., {symbol}] with {symbol} > 0, got {shape_str(x)}")
    return x


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ArgumentError(
            f"{name_b}: expected the same shape as {name_a} {shape_str(a)}, got {shape_str(b)}"
        )


def as_bool_mask(mask: object, like: Tensor, *, name: str = "mask", like_name: str = "logp") -> Tensor:
    """Check a per-token mask against ``like`` and return it as ``torch.bool``.

    Accepted dtypes: bool, or an integer / floating tensor holding 0 and 1 (non-zero counts as valid).
    """
    check_tensor(name, mask)
    if mask.dtype.is_complex:
        raise ArgumentError(f"{name}: expected dtype bool (or 0/1 int/float), got {mask.dtype}")
    if mask.shape != like.shape:
        raise ArgumentError(f"{name}: expected the shape of {like_name} {shape_str(like)}, got {shape_str(mask)}")
    return mask if mask.dtype == torch.bool else mask != 0


def check_token_pair(
    name_a: str, a: object, name_b: str, b: object, mask: object, *, mask_name: str = "mask"
) -> Bool[Tensor, "B T"]:
    """Two floating ``[B, T]`` tensors of equal shape and a matching mask; returns the mask as bool."""
    check_floating(name_a, a)
    check_ndim(name_a, a, 2, "[B, T]")
    check_floating(name_b, b)
    check_same_shape(name_a, a, name_b, b)
    return as_bool_mask(mask, a, name=mask_name, like_name=name_a)


def check_group_inputs(
    rewards: object, group_ids: object, *, rewards_name: str = "rewards", ndim: int = 1
) -> tuple[Tensor, Tensor]:
    """``rewards [n]`` (or ``[n, F]`` when ``ndim == 2``), a real tensor (bool pass/fail rewards included), and
    integer ``group_ids [n]``."""
    layout = "[n]" if ndim == 1 else "[n, F]"
    check_real_tensor(rewards_name, rewards, allow_bool=True)
    check_ndim(rewards_name, rewards, ndim, layout)
    check_integer("group_ids", group_ids)
    check_ndim("group_ids", group_ids, 1, "[n]")
    if group_ids.shape[0] != rewards.shape[0]:
        raise ArgumentError(
            f"group_ids: expected length n = {rewards.shape[0]} (from {rewards_name} {shape_str(rewards)}), "
            f"got {shape_str(group_ids)}"
        )
    return rewards, group_ids
