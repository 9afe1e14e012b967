"""Command-line flags from a dataclass: every field of a loop's ``Config`` is a flag, ``--help`` shows them all."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from rlblocks.errors import ArgumentError


def opt(default: Any, help: str = "", choices: tuple | None = None, type: type | None = None) -> Any:
    """A dataclass field with a help text (and optional ``choices``; ``type`` for a field whose default is
    ``None``) for :func:`parse_flags`."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "type": type})


def parse_flags(cls: type, argv: list[str] | None = None, check: Callable[[Any], None] | None = None) -> Any:
    """Build an ``argparse`` parser from the fields of dataclass ``cls`` and return an instance.

    The description is the first paragraph of ``cls``' docstring. Each field becomes ``--field-name`` (bools get
    ``--x/--no-x``; choices come from ``field.metadata["choices"]``; a field whose default is ``None`` takes its type
    from ``field.metadata["type"]``). Help texts are literal (a ``%`` is shown as is) and end with the default.
    A checkpoint flag (``--model``, ``--critic-model``, ``--distill-from``) that names a model of
    :data:`.models.MODELS` (``--model smollm2-135m``) is replaced by its cached HF directory (converted once).
    ``check(cfg)`` may raise :class:`ArgumentError` for flag combinations; the parser then exits with status 2 and
    the message, like any other bad flag.
    """
    from .models import resolve_model_flags

    summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # the docstring's first paragraph
    parser = argparse.ArgumentParser(description=summary, formatter_class=_DefaultsHelp)
    for f in dataclasses.fields(cls):
        # argparse %-formats help strings (for %(default)s): escape the text's own percent signs
        helptext = f.metadata.get("help", "").replace("%", "%%")
        if isinstance(f.default, bool):
            kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            kw = {"type": f.metadata.get("type") or type(f.default), "choices": f.metadata.get("choices")}
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=helptext, **kw)
    ns = parser.parse_args(argv)
    cfg = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    try:
        resolve_model_flags(cfg)  # the one place a model name becomes a directory, for every loop
        if check is not None:
            check(cfg)
    except ArgumentError as e:
        parser.error(str(e))
    return cfg


class _DefaultsHelp(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the default is ``None`` (the help then says what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is not None and action.default is not argparse.SUPPRESS and action.option_strings:
            text += " (default: %(default)s)"
        return text


def check_at_least(cfg: Any, minimum: int, *names: str) -> None:
    """Refuse an int flag below ``minimum``: raises :class:`ArgumentError` naming the first such flag."""
    for name in names:
        if getattr(cfg, name) < minimum:
            raise ArgumentError(f"--{name.replace('_', '-')}: expected an int >= {minimum}, got {getattr(cfg, name)}")


def every(step: int, n: int) -> bool:
    """``--eval-every N`` / ``--save-every N``: true at every ``N``-th step; ``N = 0`` never (the loops still
    evaluate before the first step and after the last)."""
    return n > 0 and step % n == 0
