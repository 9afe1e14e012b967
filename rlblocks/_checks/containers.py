"""Checks of a container of plain values: lists of ints, reals or log-probabilities, a pair of strings, and the
keys of a ``state_dict`` read back by ``load_state_dict``. Each element is checked by :mod:`.scalars`' rule and a
refusal names its index (``rewards[3]: ...``). Standard library only (torch is looked up in ``sys.modules``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

from rlblocks.errors import ArgumentError

from .scalars import check_int, check_real

__all__ = [
    "LOGPROB_SLACK",
    "check_int_list",
    "check_logprob_list",
    "check_real_list",
    "check_state_keys",
    "check_str_pair",
    "check_token_ids",
]

LOGPROB_SLACK = 1e-3
"""How far above 0 a log-probability may come out of an engine's arithmetic and still be accepted (unchanged).

``log p <= 0`` exactly, but an engine computes it as ``z − logsumexp(z)`` in fp32: for the top token of a
near-certain distribution the two terms agree to a few ulps of ``|z|``, and the difference can round to a tiny
positive number (``1e-7``; ``~2e-4`` for logits in the thousands, e.g. after a low temperature). A larger value is
no rounding: it is refused, since it would enter the importance ratios as a probability above 1."""


def _items(name: str, values: object, what: str) -> list[object]:
    """``values`` as a list; a bare ``str`` or ``bytes`` (a sequence of characters) and a non-iterable are refused."""
    if isinstance(values, (str, bytes)):
        raise ArgumentError(f"{name}: expected {what}, got {type(values).__name__}")
    try:
        return list(values)  # type: ignore[call-overload]
    except TypeError:
        raise ArgumentError(f"{name}: expected {what}, got {type(values).__name__}") from None


def _all_of(values: object, kind: type) -> bool:
    """``values`` is a list whose elements are all exactly of type ``kind`` (not a subclass: ``bool`` is no
    ``int`` here). C-speed (``map``/``set``): these checks run on every generation of an engine."""
    return type(values) is list and set(map(type, values)) <= {kind}


def check_int_list(name: str, values: Iterable[object], *, minimum: int | None = None) -> list[int]:
    """Every element a genuine integer ``>= minimum``, as plain ints."""
    items = _items(name, values, "a sequence of ints")
    return [check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(items)]


def check_token_ids(name: str, values: Iterable[object], *, vocab_size: int | None = None) -> list[int]:
    """Every element a token id: a genuine integer ``>= 0`` and, when ``vocab_size`` is given, ``< vocab_size``.

    Returns a new list of plain ints. A list of plain ints in range is checked at C speed, with no per-token
    message built (this runs on every generation of an engine); anything else is checked element by element, the first
    bad element named by its index."""
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    if _all_of(values, int) and (not values or (min(values) >= 0 and (vocab_size is None or
                                                                      max(values) < vocab_size))):
        return list(values)
    out = check_int_list(name, values, minimum=0)
    if vocab_size is not None:
        for i, t in enumerate(out):
            if t >= vocab_size:
                raise ArgumentError(f"{name}[{i}]: expected a token id in [0, {vocab_size}) (the vocabulary), "
                                    f"got {t}")
    return out


def _scalar(value: object) -> object:
    """A one-element real torch tensor as a Python number (a list is host data: reading it here is no extra sync);
    anything else unchanged, for :func:`check_real` to judge."""
    torch = sys.modules.get("torch")
    if (torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex
            and value.dtype != torch.bool):
        return value.item()
    return value


def check_real_list(name: str, values: Iterable[object]) -> list[float]:
    """Every element a real number (or a one-element real tensor), as Python floats. These are data (rewards,
    log-probs), not settings: NaN and ``±inf`` pass through, to propagate where they are used."""
    items = _items(name, values, "a sequence of real numbers")
    return [check_real(f"{name}[{i}]", _scalar(v), nan=True) for i, v in enumerate(items)]


def check_logprob_list(name: str, values: Iterable[object]) -> list[float]:
    """Every element a log-probability, as Python floats: a real number ``<= 0`` (up to :data:`LOGPROB_SLACK`
    of rounding, kept as it is), not NaN; ``−inf``, a probability that underflowed, is kept. A new list; a list
    of Python floats is checked at C speed, with no per-element message built."""
    # a NaN makes the sum NaN (so does +inf next to -inf): those take the path below, which names the element
    if _all_of(values, float) and (not values or (not math.isnan(sum(values)) and max(values) <= LOGPROB_SLACK)):
        return list(values)
    out = check_real_list(name, values)
    for i, v in enumerate(out):
        if math.isnan(v) or v > LOGPROB_SLACK:
            raise ArgumentError(f"{name}[{i}]: expected a log-probability (a number <= 0, up to {LOGPROB_SLACK} of "
                                f"rounding; not NaN), got {v}")
    return out


def check_str_pair(name: str, value: object) -> tuple[str, str]:
    """A pair of non-empty strings (e.g. opening and closing tags)."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, str) and v for v in value)):
        raise ArgumentError(f"{name}: expected a pair of non-empty strings, got {value!r:.60}")
    return value[0], value[1]


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
