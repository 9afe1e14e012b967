"""rlblocks.sandbox refuses bad arguments before anything runs (ArgumentError naming the argument, never a raw
AttributeError from inside, never a silent reinterpretation), cleans up after every call, and reports a limit only
when a limit stopped the program."""

from __future__ import annotations

import glob
import math
import os
import tempfile

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.sandbox import SandboxLimits, isolation_support, run_python

ISO = "strict" if isolation_support()["available"] else "weak"
FAST = SandboxLimits(cpu_seconds=1, wall_seconds=5, isolation=ISO)

BAD = [
    ("cpu_seconds", lambda: SandboxLimits(cpu_seconds=math.nan)),
    ("wall_seconds", lambda: SandboxLimits(wall_seconds=True)),
    ("memory_bytes", lambda: SandboxLimits(memory_bytes=1e9)),
    ("open_files", lambda: SandboxLimits(open_files=0)),
    # a permission must be a bool: "no" is truthy and would have opened the network
    ("allow_network", lambda: SandboxLimits(allow_network="no")),
    ("allow_subprocesses", lambda: SandboxLimits(allow_subprocesses=1)),
    ("isolation", lambda: SandboxLimits(isolation="none")),  # only "strict" or "weak"; never silently weaker
    ("isolation", lambda: SandboxLimits(isolation=True)),
    ("disk_bytes", lambda: SandboxLimits(disk_bytes=100)),
    ("max_created_files", lambda: SandboxLimits(max_created_files=0)),
    ("code", lambda: run_python(None)),
    ("stdin", lambda: run_python("print(1)", stdin=b"x")),
    ("stdin", lambda: run_python("print(1)", stdin=None)),
    ("args", lambda: run_python("print(1)", args="abc")),  # was split into ['a', 'b', 'c']
    (r"args\[0\]", lambda: run_python("print(1)", args=[1])),
    ("files", lambda: run_python("print(1)", files=["a.txt"])),
    (r"files\['a'\]", lambda: run_python("print(1)", files={"a": 3})),  # bytes(3): three zero bytes
    ("files", lambda: run_python("print(1)", files={"main.py": "print(2)"})),  # replaced the program
    ("files", lambda: run_python("print(1)", files={"/etc/passwd": "x"})),
    ("files", lambda: run_python("print(1)", files={"": "x"})),
    ("limits", lambda: run_python("print(1)", limits={"cpu_seconds": 1})),
    ("files", lambda: run_python("print(1)", files={"a/../b": "x"})),
    ("files", lambda: run_python("print(1)", files={"./main.py": "x"})),
    ("python", lambda: run_python("print(1)", python=3)),
    ("checks", lambda: run_python("print(1)", checks="assert True")),  # one str would be read as characters
    ("checks", lambda: run_python("print(1)", checks=[])),
    (r"checks\[0\]", lambda: run_python("print(1)", checks=[b"assert True"])),
    # a child process could read the marker from the checker's memory
    ("allow_subprocesses=False", lambda: run_python("print(1)", checks=["assert True"],
                                                     limits=SandboxLimits(allow_subprocesses=True))),
]


@pytest.mark.parametrize(("arg", "call"), BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_refused_and_named(arg, call):
    with pytest.raises(ArgumentError, match=arg):
        call()


def _leftovers() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"rlblocks-sandbox-{os.getpid()}-*")))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_nothing_is_left_behind_when_the_interpreter_cannot_start():
    """A missing interpreter is an error result; it used to leave the config directory and both ends of the status
    pipe behind, on every call."""
    before, fds = _leftovers(), _open_fds()
    for _ in range(3):
        r = run_python("print(1)", python="/nonexistent/python3", limits=FAST)
        assert r.error is not None and "nonexistent" in r.error and r.returncode is None
    assert _leftovers() - before == set()
    assert _open_fds() == fds


def test_a_program_that_prints_the_words_of_a_limit_is_not_stopped_by_one():
    """The stderr heuristics only name a limit for a program that failed: a correct program may print
    "MemoryError" (e.g. after catching one) and exit 0."""
    code = ("import sys\ntry:\n    x = bytearray(1 << 40)\nexcept MemoryError as e:\n"
            "    print('MemoryError caught', file=sys.stderr)\nprint('File too large', file=sys.stderr)\nprint('ok')")
    r = run_python(code, limits=SandboxLimits(memory_bytes=256 << 20, cpu_seconds=2, isolation=ISO))
    assert r.ok and r.limit is None and r.stdout.strip() == "ok" and "MemoryError" in r.stderr
    # a program the limit really stopped still reports it
    r = run_python("x = bytearray(1 << 40)", limits=SandboxLimits(memory_bytes=256 << 20, cpu_seconds=2, isolation=ISO))
    assert r.limit == "memory" and r.returncode == 1


def test_valid_arguments_still_work():
    r = run_python("import sys; print(sys.argv[1:], open('d/b.bin', 'rb').read())", args=["x"],
                   files={"d/b.bin": b"\x01\x02"}, limits=FAST)
    assert r.ok and r.stdout.strip() == "['x'] b'\\x01\\x02'"
