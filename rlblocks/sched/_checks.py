"""Argument checks used by the sched modules: integers that count tokens, positions, versions or groups.

They are the project's shared checks (:mod:`rlblocks._checks`), re-exported here so the sched modules keep one
import; see that module for the rules (genuine integers only: no bools, no floats, numpy / 0-d torch ints fine).
"""

from __future__ import annotations

from rlblocks._checks import (
    as_int,
    check_bool,
    check_int,
    check_int_list,
    check_logprob_list,
    check_optional_int,
    check_real,
    check_real_list,
    check_seconds,
    check_state_keys,
    check_timeout,
)

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
    "check_timeout",
]
