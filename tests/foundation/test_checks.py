"""The shared host-value checks (``rlblocks._checks``): timeouts past the platform's longest wait, checkpoint keys,
log-probability lists."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from rlblocks._checks import check_logprob_list, check_seconds, check_state_keys, check_timeout
from rlblocks.errors import ArgumentError


def test_check_timeout_maps_waits_longer_than_the_platform_allows_to_no_limit():
    """``Condition.wait(1e12)`` raises ``OverflowError``; such a timeout cannot expire within a process, so it
    means no limit (``None``), like ``math.inf``. Shorter ones come back as floats, numpy numbers included."""
    assert check_timeout(1e12) is None and check_timeout(math.inf) is None
    assert check_timeout(threading.TIMEOUT_MAX) == threading.TIMEOUT_MAX
    assert check_timeout(np.float32(2.5)) == 2.5 and check_timeout(np.int64(3)) == 3.0 and check_timeout(0) == 0.0
    for bad in (-1, math.nan, True, np.bool_(False), "1", [1]):
        with pytest.raises(ArgumentError, match=r"^timeout: expected None or a number of seconds >= 0"):
            check_timeout(bad)


def test_check_seconds_refuses_a_finite_deadline_the_platform_cannot_wait():
    """A finite limit (a wall clock, a request timeout) is used as a deadline in ``select`` / ``wait``: past the
    platform's longest wait it would overflow there, so it is refused here, naming the argument and the bound."""
    assert check_seconds("wall_seconds", 1e9) == 1e9
    with pytest.raises(ArgumentError, match=r"^wall_seconds: expected a finite number of seconds > 0 and <= \d+"):
        check_seconds("wall_seconds", 1e12)
    assert check_seconds("t", None, allow_none=True) is None


def test_check_state_keys_names_the_owner_and_the_key():
    state = {"a": 1, "b": 2, "c": 3}
    assert check_state_keys("X.load_state_dict: state", state, ("a", "b"), ("c",)) is state
    with pytest.raises(ArgumentError, match=r"^X: missing key 'b' \(expected the keys 'a', 'b', 'c'\)"):
        check_state_keys("X", {"a": 1}, ("a", "b"), ("c",))
    with pytest.raises(ArgumentError, match=r"^X: unexpected key 'd' \(expected the keys 'a', 'b'\)"):
        check_state_keys("X", {"a": 1, "b": 2, "d": 4}, ("a", "b"))
    with pytest.raises(ArgumentError, match=r"^X: expected a dict \(a state_dict\(\)\), got list"):
        check_state_keys("X", [("a", 1)], ("a",))


def test_check_logprob_list():
    assert check_logprob_list("lp", [-0.5, 0, -math.inf, np.float32(-1.0)]) == [-0.5, 0.0, -math.inf, -1.0]
    for bad, i in (([-0.5, math.nan], 1), ([math.inf], 0)):
        with pytest.raises(ArgumentError, match=rf"^lp\[{i}\]: expected a log-probability"):
            check_logprob_list("lp", bad)
    with pytest.raises(ArgumentError, match=r"^lp\[0\]: expected a real number"):
        check_logprob_list("lp", [True])
