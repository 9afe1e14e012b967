"""Deprecation helpers: old names keep working for one release and warn once per call site.

Renamed keyword arguments, renamed attributes and positional arguments that became keyword-only all go through
:func:`warn_renamed`, so every deprecation message has the same shape::

    rlblocks: `PartialRolloutBuffer(max_age=...)` is deprecated and will be removed in 0.3; use `max_staleness=`.

``DeprecationWarning`` is the category (shown by pytest and in ``__main__``; enable elsewhere with
``-W default::DeprecationWarning``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from rlblocks.errors import ArgumentError

__all__ = ["REMOVED_IN", "renamed_kwargs", "take_renamed", "warn_renamed"]

REMOVED_IN = "0.3"

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Emit the project's one deprecation message: ``old`` is deprecated, use ``new``."""
    warnings.warn(
        f"rlblocks: {old} is deprecated and will be removed in {REMOVED_IN}; use {new}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def take_renamed(
    kwargs: dict[str, Any], old: str, new: str, value: Any, *, where: str, default: Any = None, stacklevel: int = 4
) -> Any:
    """Resolve a keyword that was renamed from ``old`` to ``new`` inside a function that takes ``**kwargs``.

    Returns the value to use for ``new``: ``value`` if the caller passed the new name (anything but ``default``),
    else the old keyword's value (with a warning), else ``default``. Passing both is an :class:`ArgumentError`.
    ``kwargs`` is modified in place (``old`` is removed).
    """
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if value is not default:
        raise ArgumentError(f"{where}: got both `{new}=` and its deprecated name `{old}=`; pass only `{new}=`")
    warn_renamed(f"`{where}({old}=...)`", f"`{new}=`", stacklevel=stacklevel)
    return old_value


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Decorator: accept deprecated keyword names, mapping each ``old=new`` onto the new name with a warning.

    ``@renamed_kwargs(max_age="max_staleness")`` lets ``f(max_age=2)`` keep working as ``f(max_staleness=2)``.
    Passing both names raises :class:`ArgumentError`.
    """

    def deco(fn: F) -> F:
        where = fn.__qualname__.replace(".__init__", "")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise ArgumentError(
                            f"{where}: got both `{new}=` and its deprecated name `{old}=`; pass only `{new}=`"
                        )
                    warn_renamed(f"`{where}({old}=...)`", f"`{new}=`")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco
