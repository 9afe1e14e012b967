"""Checks of one plain Python value: an int, a real number, a flag, a number of seconds, a choice, a string.

A count read from a float would be truncated (``int(2.7) == 2``) and ``True`` would be read as 1, both silently,
so the integer checks accept only genuine integers: Python ``int`` and anything with ``__index__`` (numpy and
0-d torch integers), never ``bool`` (nor a numpy or torch bool), never a float even if it is integral (``3.0``),
and return a plain ``int``. A real number is a ``numbers.Real`` (Python and numpy ints and floats), never a bool,
a string or a tensor (reading a tensor would be a host sync), returned as a Python ``float``.

Standard library only: torch and numpy are looked up in ``sys.modules`` (a value cannot be a torch tensor unless
torch is already imported), so light packages use these checks without importing torch.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
import threading
from collections.abc import Iterable

from rlblocks.errors import ArgumentError

__all__ = [
    "MAX_WAIT_SECONDS",
    "as_int",
    "check_bool",
    "check_choice",
    "check_int",
    "check_optional_int",
    "check_real",
    "check_seconds",
    "check_str",
    "check_timeout",
]

MAX_WAIT_SECONDS = threading.TIMEOUT_MAX
"""The longest wait the platform's locks and ``select`` take (about 292 years on 64-bit Linux); a longer timeout
raises ``OverflowError`` from inside the wait."""


def is_bool(value: object) -> bool:
    """``value`` is a Python, numpy or torch bool (never a count, never a number)."""
    if isinstance(value, bool):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def got(value: object) -> str:
    """How a refused value of the wrong kind is shown: its repr (cut at 60 characters) and its type."""
    return f"{value!r:.60} ({type(value).__name__})"


def as_int(value: object) -> int | None:
    """``value`` as a plain int if it is a genuine integer (not a bool, not a float), else ``None``."""
    if is_bool(value):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _bounds(lo: object, lo_open: bool, hi: object, hi_open: bool) -> str:
    """`` in [lo, hi]``, `` >= lo``, `` < hi`` ... (empty without a bound)."""
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
              what: str | None = None) -> int:
    """A genuine integer in ``[minimum, maximum]`` (each bound when given), as a plain ``int``.

    ``what`` replaces the expectation in the message (e.g. ``"an int (<= 0 disables it)"``)."""
    iv = as_int(value)
    if what is None:
        what = "an int" + _bounds(minimum, False, maximum, False)
    if iv is None:
        raise ArgumentError(f"{name}: expected {what}, got {got(value)}")
    if (minimum is not None and iv < minimum) or (maximum is not None and iv > maximum):
        raise ArgumentError(f"{name}: expected {what}, got {iv}")
    return iv


def check_optional_int(name: str, value: object, *, minimum: int | None = None,
                       maximum: int | None = None) -> int | None:
    """``None``, or :func:`check_int` of ``value``."""
    return None if value is None else check_int(name, value, minimum=minimum, maximum=maximum)


def check_real(
    name: str,
    value: object,
    *,
    finite: bool = False,
    nan: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    what: str | None = None,
) -> float:
    """A real number (Python or numpy int or float; not a bool, a string or a tensor) as a Python ``float``.

    NaN is refused unless ``nan=True`` (a NaN setting compares False with every bound and would pass any test
    silently); ``finite=True`` also refuses ``±inf``. ``ge``/``gt`` (a lower bound, inclusive or not) and
    ``le``/``lt`` (an upper bound) bound the value. ``what`` replaces the expectation in the message."""
    if what is None:
        lo, lo_open = (gt, True) if gt is not None else (ge, False)
        hi, hi_open = (lt, True) if lt is not None else (le, False)
        what = ("a finite real number" if finite else "a real number") + _bounds(lo, lo_open, hi, hi_open)
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{name}: expected {what}, got {got(value)}")
    v = float(value)
    if math.isnan(v):
        if nan and ge is None and gt is None and le is None and lt is None and not finite:
            return v
        raise ArgumentError(f"{name}: expected {what}, got nan")
    if (finite and math.isinf(v)) or (ge is not None and v < ge) or (gt is not None and v <= gt) or (
            le is not None and v > le) or (lt is not None and v >= lt):
        raise ArgumentError(f"{name}: expected {what}, got {v}")
    return v


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` only (a truthy string or number is a caller's mistake, not a flag)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}: expected True or False, got {value!r:.60}")
    return value


def check_choice(name: str, value: object, choices: Iterable[object]) -> object:
    """One of ``choices`` (compared with ``==``); returns ``value``."""
    choices = tuple(choices)
    if is_bool(value) or value not in choices:
        raise ArgumentError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r:.60}")
    return value


def check_str(name: str, value: object, *, non_empty: bool = False, what: str | None = None) -> str:
    """A ``str`` (``non_empty=True``: not ``""``). ``what`` replaces the expectation in the message."""
    if what is None:
        what = "a non-empty str" if non_empty else "a str"
    if not isinstance(value, str):
        raise ArgumentError(f"{name}: expected {what}, got {got(value)}")
    if non_empty and not value:
        raise ArgumentError(f"{name}: expected {what}, got ''")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool = False, allow_none: bool = False) -> float | None:
    """A finite number of seconds ``> 0`` (``>= 0`` with ``allow_zero``; ``None`` passes with ``allow_none``).

    Infinity is refused: a deadline of ``now + inf`` overflows ``select`` / ``wait_for`` (``OverflowError``), and a
    timeout that can never fire must be written ``None`` where the function allows it. So is anything longer than
    :data:`MAX_WAIT_SECONDS`, which overflows the same waits."""
    if value is None and allow_none:
        return None
    ok = not is_bool(value) and isinstance(value, numbers.Real) and math.isfinite(value) and (
        value >= 0 if allow_zero else value > 0)
    if not ok or value > MAX_WAIT_SECONDS:
        want = ">= 0" if allow_zero else "> 0"
        none = "None or " if allow_none else ""
        raise ArgumentError(
            f"{name}: expected {none}a finite number of seconds {want} and <= {MAX_WAIT_SECONDS:.0f}, got {value!r:.60}"
        )
    return float(value)  # type: ignore[arg-type]


def check_timeout(value: object, name: str = "timeout") -> float | None:
    """``None`` (no limit), or a number of seconds >= 0 (numpy floats and ints included), as a float or ``None``.

    ``math.inf``, and any timeout longer than :data:`MAX_WAIT_SECONDS` (about 292 years), means no limit and is
    returned as ``None``: the condition variables underneath cannot wait that long (``OverflowError``), and a
    wait that long cannot end by timing out within the life of a process anyway."""
    if value is None:
        return None
    v = float(value) if isinstance(value, numbers.Real) and not is_bool(value) else None
    if v is None or not (v >= 0):
        raise ArgumentError(f"{name}: expected None or a number of seconds >= 0, got {value!r:.60}")
    return None if v > MAX_WAIT_SECONDS else v
