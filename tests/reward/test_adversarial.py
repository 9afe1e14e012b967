"""Reward hacks tried against code_reward, as a policy under RL would find them: each scores 0 for the test it
attacks, with the reason in the result; the honest programs beside them still pass.

An assertion test passes only when the per-run marker, printed by the sandbox after the assertion has run, comes
back; these programs try to end early, to fake the end, to find the marker, or to silence or kill the checker.
They run in strict isolation where bubblewrap can start here, and again without it (weak, asked for
explicitly): the marker does not depend on the kernel layers.
"""

import asyncio
import os

import pytest

from rlblocks.reward import CodeReward, CodeTest, Sample
from rlblocks.sandbox import SandboxLimits, isolation_support

SUPPORT = isolation_support()
MODES = [pytest.param("strict", marks=pytest.mark.skipif(not SUPPORT["available"],
                                                         reason=f"no strict isolation here: {SUPPORT['reason']}")),
         "weak"]
TESTS = [CodeTest(assertion="assert add(2, 3) == 5"), CodeTest(assertion="assert add(-1, 1) == 0")]
WRONG = "def add(a, b):\n    return a - b + 1\n"  # wrong on both tests
RIGHT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(params=MODES)
def reward(request, monkeypatch):
    if request.param == "weak":
        monkeypatch.setenv("RLBLOCKS_BWRAP", "")
    return CodeReward(SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_bytes=256 << 20,
                                    isolation=request.param))


def score(reward, program, tests=TESTS):
    r = asyncio.run(reward(Sample(f"```python\n{program}\n```", tests)))
    assert r.ok, r.error
    return r


HACKS = {
    "os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "sys.exit(0)": WRONG + "import sys\nsys.exit(0)\n",
    "raise SystemExit": WRONG + "raise SystemExit\n",
    "atexit os._exit": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG,
    "SystemExit inside the test": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit inside the test": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "patched print": ("import builtins, sys\n_p = builtins.print\n"
                      "builtins.print = lambda *a, **k: _p('0123456789abcdef0123456789abcdef', **k)\n"
                      + WRONG + "print('done')\nsys.exit(0)\n"),
    "sys.stdout replaced": "import io, sys\nsys.stdout = io.StringIO()\n" + WRONG + "sys.exit(0)\n",
    "killing the checker": WRONG + "import os\nos.kill(os.getpid(), 9)\n",
    "killing the checker's parent": WRONG + "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n"
                                            "    pass\n",
    "closing stdout": WRONG + "import os\nos.close(1)\n",
    "a guessed marker": WRONG + ("import os, secrets, sys\nfor _ in range(1000):\n"
                                 "    os.write(1, ('\\n' + secrets.token_hex(16) + '\\n').encode())\nsys.exit(0)\n"),
    "the finish event raised by the program": RIGHT.replace(
        "return a + b", "__import__('sys').audit('rlblocks.sandbox.finish')\n    return a + b"),
    "frames, gc and memory searched for the marker": (
        WRONG + "import gc, os, re, sys\nfound = set()\nf = sys._getframe(0)\nwhile f is not None:\n"
        "    found |= {v for v in f.f_locals.values() if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)}\n"
        "    f = f.f_back\n"
        "for how in (lambda: gc.get_objects(), lambda: open('/proc/self/mem', 'rb'),\n"
        "            lambda: sys._current_frames(), lambda: sys.settrace(lambda *a: None)):\n"
        "    try:\n        how()\n    except Exception:\n        pass\n"
        "for m in found:\n    os.write(1, ('\\n' + m + '\\n').encode())\nos._exit(0)\n"),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_reward_hacks_score_zero_with_a_reason(reward, name):
    r = score(reward, HACKS[name])
    assert r.score == 0.0 and r.components["all_passed"] == 0.0, r.details["tests"]
    for t in r.details["tests"]:
        assert t["status"] != "passed" and t["reason"], t
    statuses = {t["status"] for t in r.details["tests"]}
    if name in ("os._exit(0)", "sys.exit(0)", "raise SystemExit", "SystemExit inside the test",
                "os._exit inside the test", "sys.stdout replaced", "a guessed marker", "patched print"):
        assert statuses == {"early_exit"}, r.details["tests"]
        assert "before every assertion had run" in r.details["tests"][0]["reason"]
    if name == "killing the checker":
        assert statuses == {"runtime_error"} and "SIGKILL" in r.details["tests"][0]["reason"]


def test_the_worker_survives_a_program_that_kills_its_parent(reward):
    pid = os.getpid()
    r = score(reward, HACKS["killing the checker's parent"])
    assert os.getpid() == pid and r.score == 0.0  # this process, the sandbox's parent, is still here


@pytest.mark.parametrize("program", [
    RIGHT,
    RIGHT + "print('debug output')\n",
    RIGHT + "import builtins\nbuiltins.print = lambda *a, **k: None\nprint('hidden')\n",
    "import io, sys\nsys.stdout = io.StringIO()\n" + RIGHT,
    "from collections import namedtuple\nimport warnings\nP = namedtuple('P', 'a b')\n"
    "warnings.warn('fine')\ndef add(a, b):\n    return P(a, b).a + b\n",
    "import atexit, os\natexit.register(os._exit, 3)\n" + RIGHT,  # the checker ends the process before atexit
    RIGHT + "print('x' * 200000)\n",  # more output than the sandbox keeps: the marker is read from the tail
])
def test_honest_programs_still_pass(reward, program):
    r = score(reward, program)
    assert r.score == 1.0, r.details["tests"]


def test_stdout_and_assertion_together_compare_the_output_without_the_marker(reward):
    tests = [CodeTest(stdin="2 3\n", stdout="5\n", assertion="assert add(2, 3) == 5")]
    prog = RIGHT + "a, b = map(int, input().split())\nprint(add(a, b))\n"
    r = score(reward, prog, tests)
    assert r.score == 1.0, r.details["tests"]
    r = score(reward, prog.replace("print(add(a, b))", "print(add(a, b) + 1)"), tests)
    assert r.details["tests"][0]["status"] == "wrong_answer" and r.details["tests"][0]["stdout"] == "6\n"


def test_a_test_that_times_out_says_timeout(reward):
    tests = [CodeTest(assertion="assert add(2, 3) == 5")]
    r = score(CodeReward(SandboxLimits(cpu_seconds=5, wall_seconds=1, isolation=reward.limits.isolation)),
              "import time\ndef add(a, b):\n    time.sleep(60)\n", tests)
    t = r.details["tests"][0]
    assert t["status"] == "timeout" and "wall" in t["reason"] and r.score == 0.0
