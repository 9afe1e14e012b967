"""The shared argument checks (``rlblocks._checks``): timeouts past the platform's longest wait, checkpoint keys,
log-probability lists."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from rlblocks._checks import (
    LOGPROB_SLACK,
    check_logprob_list,
    check_seconds,
    check_state_keys,
    check_timeout,
    check_token_ids,
)
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
    assert check_logprob_list("lp", [1e-7, LOGPROB_SLACK]) == [1e-7, LOGPROB_SLACK]  # fp32 rounding, unchanged
    for bad, i in (([-0.5, math.nan], 1), ([math.inf], 0), ([-1.0, 0.5], 1), ([np.float32(0.01)], 0),
                   ([-1.0, LOGPROB_SLACK * 1.5], 1)):
        with pytest.raises(ArgumentError, match=rf"^lp\[{i}\]: expected a log-probability"):
            check_logprob_list("lp", bad)
    with pytest.raises(ArgumentError, match=r"^lp\[0\]: expected a real number"):
        check_logprob_list("lp", [True])


def test_check_token_ids():
    ids = [3, 0, 9]
    out = check_token_ids("ids", ids, vocab_size=10)
    assert out == ids and out is not ids
    assert check_token_ids("ids", (np.int64(2), 4)) == [2, 4]
    for bad, msg in (([1, -1], r"^ids\[1\]: expected an int >= 0, got -1"), ([True], r"^ids\[0\]: expected an int"),
                     ([2.0], r"^ids\[0\]: expected an int >= 0, got 2\.0"), ("12", r"^ids: expected a sequence"),
                     ([1, 10], r"^ids\[1\]: expected a token id in \[0, 10\) \(the vocabulary\), got 10")):
        with pytest.raises(ArgumentError, match=msg):
            check_token_ids("ids", bad, vocab_size=10)
    with pytest.raises(ArgumentError, match=r"^vocab_size: expected an int >= 1, got 0"):
        check_token_ids("ids", [1], vocab_size=0)


def test_one_rule_per_kind_of_value():
    """The rule of each scalar check, against the values a caller gets wrong: numpy numbers are numbers, a bool is
    neither a count nor a number nor a version, a float is no count, NaN is no setting."""
    from rlblocks._checks import check_choice, check_int, check_real, check_str, check_version

    for check in (check_int, check_version):
        assert check("n", np.int64(3)) == 3 and type(check("n", np.int64(3))) is int
        for bad in (True, np.bool_(True), 3.0, "3", None):
            with pytest.raises(ArgumentError, match=r"^n: expected an int, got "):
                check("n", bad)
    assert check_version("version", 2, minimum=0) == 2
    with pytest.raises(ArgumentError, match=r"^version: expected an int >= 0, got -1$"):
        check_version("version", -1, minimum=0)
    assert check_real("x", np.float32(0.5), gt=0, le=1) == 0.5 and check_real("x", 2) == 2.0
    for bad, kw, want in (
        (True, {}, "a real number"),
        ("1", {}, "a real number"),
        (math.nan, {}, "a real number"),
        (math.inf, {"finite": True}, "a finite real number"),
        (0.0, {"gt": 0, "le": 1}, r"a real number in \(0, 1\]"),
        (-1, {"finite": True, "ge": 0}, "a finite real number >= 0"),
        (1.0, {"lt": 1}, "a real number < 1"),
    ):
        with pytest.raises(ArgumentError, match=rf"^x: expected {want}, got "):
            check_real("x", bad, **kw)
    assert math.isnan(check_real("x", math.nan, nan=True))
    with pytest.raises(ArgumentError, match=r"^level: expected one of 1, 2, got True"):
        check_choice("level", True, (1, 2))  # True == 1, but True is no level
    assert check_choice("mode", "a", ("a", "b")) == "a"
    assert check_str("s", "") == "" and check_str("s", "x", non_empty=True) == "x"
    with pytest.raises(ArgumentError, match=r"^s: expected a non-empty str, got ''"):
        check_str("s", "", non_empty=True)


def test_the_scalar_checks_do_not_import_torch():
    """``rlblocks._checks`` serves the light packages: the tensor checks load torch on first use only."""
    import subprocess
    import sys

    code = ("import sys, rlblocks._checks as c; c.check_int('n', 1); before = 'torch' in sys.modules; "
            "c.check_tensor; print(before, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
