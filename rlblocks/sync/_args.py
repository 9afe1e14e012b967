"""Argument helpers shared by the sync modules: the weight ``version`` is keyword-only everywhere.

``version`` used to be positional in ``WeightSender.send``, ``DeltaEncoder.encode`` and ``LoraSyncer.sync`` but
keyword-only in every engine's ``update_weights``, so one could not be passed where another was expected. It is
keyword-only now; a positional value keeps working for one release and warns through the project's one
deprecation message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from rlblocks._checks import as_int
from rlblocks._deprecate import warn_renamed
from rlblocks.errors import ArgumentError

F = TypeVar("F", bound=Callable[..., Any])


def keyword_only(n_positional: int, *names: str) -> Callable[[F], F]:
    """Decorator: the first ``n_positional`` arguments (``self`` included) stay positional; extra positional
    arguments are mapped, in order, onto the keyword-only parameters ``names`` with a DeprecationWarning.

    ``@keyword_only(2, "version")`` on ``def send(self, named, *, version)`` lets ``send(named, 3)`` keep working
    as ``send(named, version=3)``. Passing a value both ways, or more positionals than ``names``, is an
    :class:`ArgumentError`.
    """

    def deco(fn: F) -> F:
        where = fn.__qualname__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if len(args) > n_positional:
                extra = args[n_positional:]
                if len(extra) > len(names):
                    raise ArgumentError(
                        f"{where}: takes {n_positional - 1} positional argument(s) and the keyword-only "
                        f"{', '.join(names)}; got {len(args) - 1} positional"
                    )
                for name, value in zip(names, extra):
                    if name in kwargs:
                        raise ArgumentError(f"{where}: got `{name}` both positionally and as `{name}=`")
                    warn_renamed(f"passing `{name}` positionally to `{where}`", f"`{name}=` (keyword-only)")
                    kwargs[name] = value
                args = args[:n_positional]
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


def check_version(version: object, arg: str = "version") -> int:
    """``version`` as a plain int (numpy ints fine; bools refused: ``True`` is not a weight version, and a float
    such as ``3.0`` is refused rather than read as 3)."""
    v = as_int(version)
    if v is None:
        raise ArgumentError(f"{arg}: expected an int, got {version!r}")
    return v
