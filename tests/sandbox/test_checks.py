"""Checks (assertion tests) run in a checker process, against proxies of the program's top-level names: what they
can do with the program's values, and what reaches them. Each run compares against what the same program and
checks do when executed together in one plain interpreter (the reference), or against literal expectations."""

import pytest

from rlblocks.sandbox import SandboxLimits, isolation_support, run_python

ISO = "strict" if isolation_support()["available"] else "weak"
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=8, memory_bytes=512 << 20, isolation=ISO)


def checked(program, checks, **kw):
    return run_python(program, checks=checks, limits=LIMITS, **kw)


def reference(program, checks):
    """The same program and checks in one namespace of this interpreter (only for trusted test programs)."""
    ns = {"__name__": "__main__"}
    exec(compile(program, "<program>", "exec"), ns)
    for c in checks:
        exec(compile(c, "<checks>", "exec"), ns)


VALUES = """
import collections, decimal, enum, fractions, math
import numpy as np

P = collections.namedtuple("P", "x y")
class Color(enum.IntEnum):
    RED = 1

def values():
    return {
        "int": 7, "big": 3 ** 5000, "neg_big": -(7 ** 3000), "float": 0.1, "nan": math.nan, "inf": -math.inf,
        "zero": -0.0, "complex": 1 - 2j, "str": "h\\u00e9\\ud800", "bytes": b"\\x00\\xff", "ba": bytearray(b"ab"),
        "tuple": (1, (2, [3])), "set": {1, 2}, "frozen": frozenset({(1, 2)}), "none": None, "bool": True,
        "dict": {(1, 2): [3], None: {"a": 1}}, "named": P(1, 2), "counter": collections.Counter("aab"),
        "enum": Color.RED, "np_int": np.int64(5), "np_float": np.float32(0.5), "np_bool": np.bool_(True),
        "array": np.arange(6, dtype=np.int16).reshape(2, 3), "fraction": fractions.Fraction(1, 3),
        "decimal": decimal.Decimal("1.10"), "keys": {3: 0, 1: 0}.keys(), "items": {1: "a"}.items(),
        "range": range(1, 9, 3),
    }
"""
VALUE_CHECKS = ["""
import collections, decimal, fractions, math
import numpy as np
v = values()
assert v["int"] == 7 and type(v["int"]) is int
assert v["big"] == 3 ** 5000 and v["neg_big"] == -(7 ** 3000)
assert v["float"] == 0.1 and math.isnan(v["nan"]) and v["inf"] == -math.inf and math.copysign(1, v["zero"]) == -1
assert v["complex"] == 1 - 2j and v["str"] == "h\\u00e9\\ud800" and v["bytes"] == b"\\x00\\xff"
assert v["ba"] == bytearray(b"ab") and type(v["ba"]) is bytearray
assert v["tuple"] == (1, (2, [3])) and v["set"] == {1, 2} and v["frozen"] == frozenset({(1, 2)})
assert v["none"] is None and v["bool"] is True and v["dict"] == {(1, 2): [3], None: {"a": 1}}
assert v["named"] == (1, 2) and v["counter"] == {"a": 2, "b": 1} and v["enum"] == 1
assert v["np_int"] == 5 and v["np_float"] == 0.5 and v["np_bool"] == 1
assert (v["array"] == np.arange(6).reshape(2, 3)).all() and v["array"].dtype == np.int16
assert v["fraction"] == fractions.Fraction(1, 3) and v["decimal"] == decimal.Decimal("1.10")
assert str(v["decimal"]) == "1.10"
assert v["keys"] == {1, 3} and list(v["keys"]) == [3, 1] and v["items"] == {(1, "a")} and v["range"] == range(1, 9, 3)
"""]


def test_results_arrive_as_the_built_in_values_they_are():
    reference(VALUES, VALUE_CHECKS)
    r = checked(VALUES, VALUE_CHECKS)
    assert r.checks_passed and r.ok, r.stderr
    # what arrives is plain data: subclasses became their base type, numpy scalars Python numbers
    types = ["v = values()\nassert type(v['named']) is tuple and type(v['counter']) is dict\n"
             "assert type(v['enum']) is int and type(v['np_int']) is int and type(v['np_float']) is float\n"
             "assert v['np_bool'] is True"]
    assert checked(VALUES, types).checks_passed


OBJECTS = """
class Stack:
    def __init__(self, items=()):
        self.items = list(items)
        self.label = "s"
    def push(self, x):
        self.items.append(x)
        return self
    def __len__(self):
        return len(self.items)
    def __getitem__(self, i):
        return self.items[i]  # an int or a slice
    def __iter__(self):
        return iter(self.items)
    def __bool__(self):
        return bool(self.items)
    def __str__(self):
        return f"Stack{self.items}"

def countdown(n):
    while n:
        yield n
        n -= 1

def same(a, b):
    return a is b

class Oops(Exception):
    pass

def fail(kind):
    if kind == "value":
        raise ValueError("bad value")
    if kind == "key":
        raise KeyError("k")
    raise Oops("custom")

def sort_in_place(xs, table=None, seen=None):
    xs.sort()
    if table is not None:
        table["n"] = len(xs)
    if seen is not None:
        seen.update(xs)

LIMIT = 10
TABLE = list(range(50000))
"""
OBJECT_CHECKS = ["""
s = Stack([1]).push(2)
assert len(s) == 2 and s[0] == 1 and s[::-1] == [2, 1] and list(s) == [1, 2] and 2 in s and bool(s) and not Stack()
assert s.label == "s" and s.items == [1, 2] and str(s) == "Stack[1, 2]"
assert same(s, s) and not same(s, Stack()) and s == s and s != Stack([1, 2])
assert list(countdown(3)) == [3, 2, 1] and sum(countdown(4)) == 10
it = iter(countdown(1))
assert next(it) == 1 and next(it, "end") == "end"
assert LIMIT == 10 and len(TABLE) == 50000 and TABLE[49999] == 49999
""", """
try:
    fail("value")
    raise AssertionError("no exception")
except ValueError as e:
    assert str(e) == "bad value"
try:
    fail("key")
    raise AssertionError("no exception")
except KeyError:
    pass
try:
    fail("custom")
    raise AssertionError("no exception")
except Exception as e:
    assert "custom" in str(e)
""", """
xs, table, seen = [3, 1, 2], {}, set()
assert sort_in_place(xs, table, seen=seen) is None
assert xs == [1, 2, 3] and table == {"n": 3} and seen == {1, 2, 3}
"""]


def test_the_programs_objects_calls_exceptions_and_in_place_changes():
    reference(OBJECTS, OBJECT_CHECKS)
    r = checked(OBJECTS, OBJECT_CHECKS)
    assert r.checks_passed and r.ok, r.stderr


@pytest.mark.parametrize("program,check,why", [
    # a name that is also a builtin's is the builtin in the checks: shadowing cannot make a check pass
    ("abs = lambda x: 0\ndef dist(a, b):\n    return a - b\n", "assert abs(dist(1, 5) - 4) < 1e-9", "AssertionError"),
    # a program object is equal only to itself: the program's __eq__ never runs on the checker's side
    ("class A:\n    def __eq__(self, o):\n        return True\ndef make():\n    return A()\n",
     "assert make() == make()", "AssertionError"),
    # the checks' own functions cannot be sent to the program
    ("def apply(f, x):\n    return f(x)\n", "assert apply(lambda v: v + 1, 1) == 2", "cannot be passed to the program"),
    # the program's process ends inside a call: not a pass, even when the checks swallow every error
    ("import os\ndef add(a, b):\n    os._exit(0)\n", "try:\n    add(1, 2)\nexcept:\n    pass", None),
])
def test_what_cannot_pass(program, check, why):
    r = checked(program, [check])
    assert r.checks_passed is False and not r.ok
    if why is not None:
        assert why in r.stderr, r.stderr
    else:
        assert r.returncode == 0  # the program's own exit status, and no verdict: an early exit


def test_output_order_and_the_run_report():
    prog = "print('program')\ndef add(a, b):\n    print('call', a, b)\n    return a + b\n"
    r = checked(prog, ["print('check 1')\nassert add(1, 2) == 3\nprint('check 2')"])
    assert r.checks_passed and r.stdout == "program\ncheck 1\ncall 1 2\ncheck 2\n", r.stdout
    if ISO == "strict":
        assert r.isolation["checks"] == "separate process, not dumpable"


def test_a_program_that_breaks_its_channel_fails_with_the_reason():
    prog = "import os\nfor fd in range(3, 20):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n" \
           "def add(a, b):\n    return a + b\n"
    r = checked(prog, ["assert add(1, 2) == 3"])
    assert r.checks_passed is False and r.returncode == 0  # its channel ended: as if the program had ended
    junk = "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'\\xff' * 8)\n    except OSError:\n" \
           "        pass\ndef add(a, b):\n    return a + b\n"
    r = checked(junk, ["assert add(1, 2) == 3"])
    assert r.checks_passed is False and "broke the checker's channel" in r.stderr, r.stderr
