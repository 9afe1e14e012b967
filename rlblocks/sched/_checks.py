"""Argument checks shared by the sched modules: integers that count tokens, positions, versions or groups.

A count read from a float would be truncated (``int(2.7) == 2``) and ``True`` would be read as 1, both silently,
so every check here accepts only genuine integers: Python ``int`` and anything with ``__index__`` (numpy and
0-d torch integers), never ``bool`` (nor a torch bool tensor), never a float even if it is integral (``3.0``),
and returns a plain ``int``. Each failure raises :class:`rlblocks.errors.ArgumentError` naming the argument.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError


def as_int(value: object) -> int | None:
    """``value`` as a plain int if it is a genuine integer (not a bool, not a float), else ``None``."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """A genuine integer ``>= minimum`` (when given), as a plain ``int``."""
    iv = as_int(value)
    want = "an int" if minimum is None else f"an int >= {minimum}"
    if iv is None:
        raise ArgumentError(f"{name}: expected {want}, got {value!r} ({type(value).__name__})")
    if minimum is not None and iv < minimum:
        raise ArgumentError(f"{name}: expected {want}, got {iv}")
    return iv


def check_optional_int(name: str, value: object, *, minimum: int) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def check_int_list(name: str, values: Iterable[object], *, minimum: int | None = None) -> list[int]:
    """Every element a genuine integer ``>= minimum``; the message names the first bad index."""
    if isinstance(values, (str, bytes)):
        raise ArgumentError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        out.append(check_int(f"{name}[{i}]", v, minimum=minimum))
    return out


def check_real_list(name: str, values: Iterable[object]) -> list[float]:
    """Every element a real number (int or float, not a bool, not a string), as Python floats."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or isinstance(v, (str, bytes)):
            raise ArgumentError(f"{name}[{i}]: expected a real number, got {v!r}")
        try:
            out.append(float(v))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ArgumentError(f"{name}[{i}]: expected a real number, got {v!r}") from None
    return out


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` only (a truthy string or number is a caller's mistake, not a flag)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}: expected True or False, got {value!r}")
    return value


def check_timeout(value: object) -> float | None:
    """``None`` (no limit), or a number of seconds >= 0; ``math.inf`` means no limit and is returned as ``None``
    (the condition variables underneath cannot wait an infinite time: ``OverflowError``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0):
        raise ArgumentError(f"timeout: expected None or a number of seconds >= 0, got {value!r}")
    return None if math.isinf(value) else float(value)
