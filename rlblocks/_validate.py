"""Argument checks shared by the blocks.

Every check raises ``ValueError`` whose message names the argument, what was expected and what was given.
None of them reads tensor values (no host sync), so they are safe inside ``torch.compile(fullgraph=True)``:
they only look at shapes and dtypes, which are static at trace time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError


def shape_str(x: Tensor) -> str:
    return "[" + ", ".join(str(int(s)) for s in x.shape) + "]"


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_floating(name: str, x: Tensor) -> Tensor:
    check_tensor(name, x)
    if not x.is_floating_point():
        raise ArgumentError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def check_ndim(name: str, x: Tensor, ndim: int | tuple[int, ...], layout: str = "") -> Tensor:
    check_tensor(name, x)
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        hint = f" {layout}" if layout else ""
        raise ArgumentError(f"{name}: expected a {want} tensor{hint}, got shape {shape_str(x)}")
    return x


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ArgumentError(
            f"{name_b}: expected the same shape as {name_a} {shape_str(a)}, got {shape_str(b)}"
        )


def as_bool_mask(mask: Tensor, like: Tensor, *, name: str = "mask", like_name: str = "logp") -> Tensor:
    """Validate a per-token mask against ``like`` and return it as ``torch.bool``.

    Accepted dtypes: bool, or an integer / floating tensor holding 0 and 1 (non-zero counts as valid).
    """
    check_tensor(name, mask)
    if mask.dtype.is_complex:
        raise ArgumentError(f"{name}: expected dtype bool (or 0/1 int/float), got {mask.dtype}")
    if mask.shape != like.shape:
        raise ArgumentError(f"{name}: expected the shape of {like_name} {shape_str(like)}, got {shape_str(mask)}")
    return mask if mask.dtype == torch.bool else mask != 0
