"""Names a package hands on but imports only when first used (PEP 562's module ``__getattr__`` and ``__dir__``).

A package whose names need a heavy import (triton, vllm, FastAPI, torch in a torch-free package) lists them in a
``{name: module}`` table and installs the pair this module builds, instead of importing the module at package import::

    if TYPE_CHECKING:  # for type checkers and readers: where each lazy name comes from
        from .server import Gateway

    __getattr__, __dir__ = lazy_exports(__name__, globals(), {"Gateway": ".server"})

The first access imports the module and stores the name in the package's namespace, so later lookups skip
``__getattr__``. ``dir(package)`` lists the lazy names before they are loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package`` whose globals are ``namespace``.

    Args:
        package: the package's ``__name__`` (relative module names in ``table`` are resolved against it).
        namespace: the package's ``globals()``; a loaded name is stored there.
        table: ``{name: module}``, the module (relative, like ``".server"``, or absolute) that defines each name.
    """
    table = dict(table)

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value  # later lookups skip __getattr__
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())) | set(table))

    return __getattr__, __dir__
