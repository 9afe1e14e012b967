"""Argument checks on plain Python values (counts, ids, seconds, flags), shared by every package.

A count read from a float would be truncated (``int(2.7) == 2``) and ``True`` would be read as 1, both silently,
so the integer checks accept only genuine integers: Python ``int`` and anything with ``__index__`` (numpy and
0-d torch integers), never ``bool`` (nor a torch bool tensor), never a float even if it is integral (``3.0``),
and return a plain ``int``. Each failure raises :class:`rlblocks.errors.ArgumentError` naming the argument.

This module imports only the standard library (torch is looked up in ``sys.modules``: a value cannot be a torch
tensor unless torch is already imported), so the light packages (``rlblocks.reward``, ``rlblocks.sandbox``) use
it without pulling torch into a verifier worker process. Tensor checks live in :mod:`rlblocks._validate`.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
import threading
from collections.abc import Iterable, Mapping

from rlblocks.errors import ArgumentError

__all__ = [
    "as_int",
    "check_bool",
    "check_int",
    "check_int_list",
    "check_logprob_list",
    "check_optional_int",
    "check_real",
    "check_real_list",
    "check_seconds",
    "check_state_keys",
    "check_str_pair",
    "check_timeout",
]

MAX_WAIT_SECONDS = threading.TIMEOUT_MAX
"""The longest wait the platform's locks and ``select`` take (about 292 years on 64-bit Linux); a longer timeout
raises ``OverflowError`` from inside the wait."""


def _is_bool(value: object) -> bool:
    if isinstance(value, bool):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def as_int(value: object) -> int | None:
    """``value`` as a plain int if it is a genuine integer (not a bool, not a float), else ``None``."""
    if _is_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
              what: str | None = None) -> int:
    """A genuine integer in ``[minimum, maximum]`` (each bound when given), as a plain ``int``.

    ``what`` replaces the expectation in the message (e.g. ``"an int (<= 0 disables it)"``)."""
    iv = as_int(value)
    if what is None:
        if minimum is not None and maximum is not None:
            what = f"an int in [{minimum}, {maximum}]"
        elif minimum is not None:
            what = f"an int >= {minimum}"
        elif maximum is not None:
            what = f"an int <= {maximum}"
        else:
            what = "an int"
    if iv is None:
        raise ArgumentError(f"{name}: expected {what}, got {value!r} ({type(value).__name__})")
    if (minimum is not None and iv < minimum) or (maximum is not None and iv > maximum):
        raise ArgumentError(f"{name}: expected {what}, got {iv}")
    return iv


def check_optional_int(name: str, value: object, *, minimum: int) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def check_int_list(name: str, values: Iterable[object], *, minimum: int | None = None) -> list[int]:
    """Every element a genuine integer ``>= minimum``; the message names the first bad index. A bare ``str`` or
    ``bytes`` (a sequence of characters, not of ints) and a non-iterable are refused."""
    if isinstance(values, (str, bytes)):
        raise ArgumentError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise ArgumentError(f"{name}: expected a sequence of ints, got {type(values).__name__}") from None
    return [check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(items)]


def check_real(name: str, value: object, *, finite: bool = False) -> float:
    """A real number (int or float, numpy scalars included; not a bool, not a string) as a Python float.
    ``finite=True`` also refuses NaN and +-inf."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise ArgumentError(f"{name}: expected a {'finite ' if finite else ''}real number, got {value!r}")
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ArgumentError(f"{name}: expected a {'finite ' if finite else ''}real number, got {value!r}") from None
    if finite and not math.isfinite(v):
        raise ArgumentError(f"{name}: expected a finite real number, got {v}")
    return v


def check_real_list(name: str, values: Iterable[object]) -> list[float]:
    """Every element a real number (int or float, not a bool, not a string), as Python floats."""
    if isinstance(values, (str, bytes)):
        raise ArgumentError(f"{name}: expected a sequence of real numbers, got {type(values).__name__}")
    return [check_real(f"{name}[{i}]", v) for i, v in enumerate(values)]


def check_logprob_list(name: str, values: Iterable[object]) -> list[float]:
    """Every element a log-probability, as Python floats: a real number that is not NaN and not ``+inf``
    (``log p <= 0``; ``−inf``, a probability that underflowed, is kept). The message names the first bad index."""
    out = check_real_list(name, values)
    for i, v in enumerate(out):
        if math.isnan(v) or v == math.inf:
            raise ArgumentError(f"{name}[{i}]: expected a log-probability (a number <= 0, not NaN), got {v}")
    return out


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` only (a truthy string or number is a caller's mistake, not a flag)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}: expected True or False, got {value!r}")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool = False, allow_none: bool = False) -> float | None:
    """A finite number of seconds ``> 0`` (``>= 0`` with ``allow_zero``; ``None`` passes with ``allow_none``).

    Infinity is refused: a deadline of ``now + inf`` overflows ``select`` / ``wait_for`` (``OverflowError``), and a
    timeout that can never fire must be written ``None`` where the function allows it. So is anything longer than
    :data:`MAX_WAIT_SECONDS`, which overflows the same waits."""
    if value is None and allow_none:
        return None
    ok = not _is_bool(value) and isinstance(value, (int, float)) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok or value > MAX_WAIT_SECONDS:
        want = ">= 0" if allow_zero else "> 0"
        none = "None or " if allow_none else ""
        raise ArgumentError(
            f"{name}: expected {none}a finite number of seconds {want} and <= {MAX_WAIT_SECONDS:.0f}, got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def check_timeout(value: object) -> float | None:
    """``None`` (no limit), or a number of seconds >= 0 (numpy floats and ints included), as a float or ``None``.

    ``math.inf``, and any timeout longer than :data:`MAX_WAIT_SECONDS` (about 292 years), means no limit and is
    returned as ``None``: the condition variables underneath cannot wait that long (``OverflowError``), and a
    wait that long cannot end by timing out within the life of a process anyway."""
    if value is None:
        return None
    v = float(value) if isinstance(value, numbers.Real) and not _is_bool(value) else None
    if v is None or not (v >= 0):
        raise ArgumentError(f"timeout: expected None or a number of seconds >= 0, got {value!r}")
    return None if v > MAX_WAIT_SECONDS else v


def check_state_keys(owner: str, state: object, required: Iterable[str], optional: Iterable[str] = ()) -> Mapping:
    """``state`` (a checkpoint read back by ``owner.load_state_dict``) as a mapping holding every ``required`` key
    and nothing outside ``required`` and ``optional``.

    A missing key would otherwise surface as a bare ``KeyError`` deep in the restore, and an unknown one (a
    misspelt key, or a checkpoint of another block) would be ignored; both raise :class:`ArgumentError` naming
    ``owner``, the key, and the keys expected. Used for nested dicts too (``owner`` then names the path, e.g.
    ``"StalenessQueue.load_state_dict: state['counters']"``)."""
    required, optional = tuple(required), tuple(optional)
    if not isinstance(state, Mapping):
        raise ArgumentError(f"{owner}: expected a dict (a state_dict()), got {type(state).__name__}")
    expected = ", ".join(repr(k) for k in (*required, *optional))
    missing = [k for k in required if k not in state]
    if missing:
        raise ArgumentError(f"{owner}: missing key {missing[0]!r} (expected the keys {expected})")
    allowed = set(required) | set(optional)
    extra = sorted((k for k in state if k not in allowed), key=repr)
    if extra:
        raise ArgumentError(f"{owner}: unexpected key {extra[0]!r} (expected the keys {expected})")
    return state


def check_str_pair(name: str, value: object) -> tuple[str, str]:
    """A pair of non-empty strings (e.g. opening and closing tags)."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, str) and v for v in value)):
        raise ArgumentError(f"{name}: expected a pair of non-empty strings, got {value!r}")
    return value[0], value[1]
