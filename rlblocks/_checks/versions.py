"""The weight version: the one integer that labels a policy across trainer, engines and sync transports.

A version is a genuine integer by :func:`~.scalars.check_int`'s rule (numpy and 0-d torch ints are fine; ``True``
is not a version, and ``3.0`` is refused rather than read as 3). Whether a version may go back is the rule of the
block that receives it (an engine's ``update_weights``, a delta chain), not of this check."""

from __future__ import annotations

from .scalars import check_int

__all__ = ["check_version"]


def check_version(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` (the argument ``name``) as a plain ``int`` weight version, ``>= minimum`` when given."""
    return check_int(name, value, minimum=minimum)
