"""Reward hacks tried against code_reward, as a policy under RL would find them: each scores 0 for the test it
attacks, with the reason in the result; the honest programs beside them still pass.

An assertion test passes only on the verdict of a checker process that the program's process never shares: the
checks, their constants and the verdict are nowhere the program can look. These programs try to end early, to
fake the end, to find the checks (frame walks up from their function, tracebacks, generator and coroutine frames,
other threads, the garbage collector, ``inspect``, the checker's /proc entries) and re-run or read them, to win a
comparison with an object equal to everything, to print or write a verdict, or to silence or kill the checker.
The walks report on stderr what they found, and find nothing. They run in strict isolation where bubblewrap can
start here, and again without it (weak, asked for explicitly): the design, not the kernel layers, keeps the
checks out of reach.
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
    "killing its own process": WRONG + "import os\nos.kill(os.getpid(), 9)\n",
    "killing its parent, the checker": WRONG + "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n"
                                            "    pass\n",
    "closing stdout": WRONG + "import os\nos.close(1)\n",
    "a guessed marker": WRONG + ("import os, secrets, sys\nfor _ in range(1000):\n"
                                 "    os.write(1, ('\\n' + secrets.token_hex(16) + '\\n').encode())\nsys.exit(0)\n"),
    "an audit event raised by the program": WRONG.replace(
        "return", "__import__('sys').audit('rlblocks.sandbox.finish')\n    return"),
    "frames, gc and memory searched for the marker": (
        WRONG + "import gc, os, re, sys\nfound = set()\nf = sys._getframe(0)\nwhile f is not None:\n"
        "    found |= {v for v in f.f_locals.values() if isinstance(v, str) and re.fullmatch('[0-9a-f]{32}', v)}\n"
        "    f = f.f_back\n"
        "for how in (lambda: gc.get_objects(), lambda: open('/proc/self/mem', 'rb'),\n"
        "            lambda: sys._current_frames(), lambda: sys.settrace(lambda *a: None)):\n"
        "    try:\n        how()\n    except Exception:\n        pass\n"
        "for m in found:\n    os.write(1, ('\\n' + m + '\\n').encode())\nos._exit(0)\n"),
}


# What the walks below share: collect the code objects of the checks from the frames they reach, then use them:
# read the expected value from their constants, or run them again with ``add`` returning an object equal to
# everything (where the checks and the end of the run share a process, either passes every test).
WALK = """
import sys
CHECKS = "<checks>"
FOUND = []


class Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = object.__hash__


def from_frames(f):
    while f is not None:
        if f.f_code.co_filename == CHECKS and f.f_code not in FOUND:
            FOUND.append(f.f_code)
        f = f.f_back


def expected(a, b):
    for code in FOUND:
        todo, ints = [code], []
        while todo:
            c = todo.pop()
            for k in c.co_consts:
                if type(k) is int:
                    ints.append(k)
                elif type(k) is tuple:
                    for t in (k, *k):
                        if type(t) is tuple and len(t) == 3 and t[:2] == (a, b):
                            return t[2]
                elif hasattr(k, "co_consts"):
                    todo.append(k)
        for i in range(len(ints) - 2):
            if ints[i] == a and ints[i + 1] == b:
                return ints[i + 2]
    return None


def cheat(a, b, rerun=True):
    sys.stderr.write(f"walk found {len(FOUND)} code objects of the checks\\n")
    sys.stderr.flush()
    if rerun:
        for code in FOUND:
            try:
                exec(code, {"add": lambda *x: Anything(), "__builtins__": __builtins__})
            except BaseException:
                pass
    e = expected(a, b)
    return a - b + 1 if e is None else e
"""

WALKS = {
    "sys._getframe f_back walk reads the checks' constants":
        "def add(a, b):\n    from_frames(sys._getframe(1))\n    return cheat(a, b, rerun=False)\n",
    "sys._getframe walk re-runs the checks' code in a forged namespace":
        "def add(a, b):\n    from_frames(sys._getframe(1))\n    return cheat(a, b)\n",
    "traceback tb_frame walk":
        "def add(a, b):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
        "        from_frames(e.__traceback__.tb_frame)\n    return cheat(a, b)\n",
    "generator gi_frame and coroutine cr_frame walks": (
        "import gc\n"
        "def add(a, b):\n"
        "    def gen():\n        me = yield\n        from_frames(me.gi_frame.f_back)\n        yield\n"
        "    g = gen()\n    next(g)\n    g.send(g)\n"
        "    async def co():\n        from_frames(held[0].cr_frame.f_back)\n"
        "    held = [co()]\n    try:\n        held[0].send(None)\n    except StopIteration:\n        pass\n"
        "    try:\n"
        "        for o in gc.get_objects():\n"
        "            f = getattr(o, 'gi_frame', None) or getattr(o, 'cr_frame', None)\n"
        "            if f is not None:\n                from_frames(f)\n"
        "    except Exception:\n        pass\n"
        "    return cheat(a, b)\n"),
    "sys._current_frames of every thread": (
        "import threading\n"
        "def add(a, b):\n    try:\n        for f in sys._current_frames().values():\n            from_frames(f)\n"
        "    except Exception:\n        pass\n    return cheat(a, b)\n"),
    "gc.get_objects and gc.get_referrers": (
        "import gc, types\n"
        "def add(a, b):\n    try:\n        for o in gc.get_objects():\n"
        "            if type(o) is types.FunctionType and o.__code__.co_filename == CHECKS:\n"
        "                FOUND.append(o.__code__)\n"
        "            elif type(o) is types.FrameType:\n                from_frames(o)\n"
        "        for o in gc.get_referrers(sys._getframe(), add, add.__code__):\n"
        "            if type(o) is types.FrameType:\n                from_frames(o)\n"
        "    except Exception:\n        pass\n    return cheat(a, b)\n"),
    "inspect.stack()": (
        "import inspect\n"
        "def add(a, b):\n    for fi in inspect.stack():\n        from_frames(fi.frame)\n    return cheat(a, b)\n"),
}
# checks with a type check (what reading the constants must get right), and a generator expression (whose frame
# the generator walk reaches); the first walk also meets the plain shape
TYPED = [CodeTest(assertion="assert add(2, 3) == 5 and type(add(2, 3)) is int"),
         CodeTest(assertion="assert add(-1, 1) == 0 and type(add(-1, 1)) is int")]
GENEXP = [CodeTest(assertion="assert all(add(a, b) == c for a, b, c in [(2, 3, 5), (-1, 1, 0)])")]


@pytest.mark.parametrize("name", list(WALKS))
def test_walks_to_the_checks_find_nothing_and_score_zero(reward, name):
    shapes = {"sys._getframe f_back": [TESTS, TYPED], "generator": [GENEXP]}
    for tests in next((v for k, v in shapes.items() if name.startswith(k)), [TYPED]):
        r = score(reward, WALK + WALKS[name], tests)
        assert r.score == 0.0, (name, r.details["tests"])
        for t in r.details["tests"]:
            assert t["status"] == "runtime_error" and t["reason"], t
            assert "walk found 0 code objects of the checks" in t["stderr"], t  # it looked, and found nothing


EQUAL_TO_ANYTHING = {
    "an object whose __eq__ is always true": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()\n"),
    "an int subclass whose __eq__ is always true": (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Int(a - b + 1)\n"),
    "a list subclass whose __eq__ is always true, in a tuple": (
        "class L(list):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return (L([a - b]),)\n"),
}


@pytest.mark.parametrize("name", list(EQUAL_TO_ANYTHING))
def test_a_result_equal_to_anything_scores_zero(reward, name):
    tests = TESTS if "tuple" not in name else [CodeTest(assertion="assert add(2, 3) == ([5],)"),
                                               CodeTest(assertion="assert add(-1, 1) == ([0],)")]
    r = score(reward, EQUAL_TO_ANYTHING[name], tests)
    assert r.score == 0.0, r.details["tests"]
    for t in r.details["tests"]:
        assert t["status"] == "runtime_error" and "AssertionError" in t["reason"], t


FORGERIES = {
    "a fake verdict and marker printed on stdout": WRONG + (
        "import json, os, secrets, sys\n"
        "for _ in range(200):\n"
        "    m = secrets.token_hex(16)\n"
        "    line = json.dumps({'marker': m, 'checks': 'passed', 'checker': 'separate process'})\n"
        "    print(f'\\n{m}\\n{line}\\npassed')\n"
        "    os.write(1, f'\\n{m}\\n{line}\\n'.encode())\n"
        "sys.stdout.flush()\n"),
    "a verdict and forged replies written to every descriptor it can guess": WRONG + (
        "import json, os, secrets, sys\n"
        "opened = 0\n"
        "for pid in {os.getppid(), 1, 2}:\n"
        "    for fd in range(64):\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/fd/{fd}', 'wb') as f:\n"
        "                f.write(b'{\"checks\": \"passed\"}\\n')\n                opened += 1\n"
        "        except OSError:\n            pass\n"
        "sys.stderr.write(f'opened {opened} descriptors of other processes\\n')\n"
        "sys.stderr.flush()\n"
        "for fd in range(3, 256):\n"
        "    for data in (json.dumps({'marker': secrets.token_hex(16), 'checks': 'passed'}).encode() + b'\\n',\n"
        "                 len(b'{\"ok\":true}').to_bytes(4, 'big') + b'{\"ok\":true}'):\n"
        "        try:\n            os.write(fd, data)\n"
        "        except OSError:\n            pass\n"),
    "the checker's memory, environment and descriptors read through /proc": WRONG + (
        "import os, sys\n"
        "seen = []\n"
        "for pid in {os.getppid(), 1, 2}:\n"
        "    for what in ('mem', 'environ', 'cmdline', 'maps', 'stack', *[f'fd/{i}' for i in range(64)]):\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/{what}', 'rb') as f:\n                data = f.read(1 << 20)\n"
        "        except OSError:\n            continue\n"
        "        if b'add(2, 3)' in data or b'add(-1, 1)' in data:\n            seen.append(f'{pid}/{what}')\n"
        "sys.stderr.write(f'checks seen in {seen}\\n')\n"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_verdicts_and_the_checkers_process_are_out_of_reach(reward, name):
    r = score(reward, FORGERIES[name])
    assert r.score == 0.0, r.details["tests"]
    for t in r.details["tests"]:
        # its own channel, written over, no longer answers; else the checks ran, and failed
        forged = name.startswith("a verdict and forged replies")
        why = "broke the checker's channel" if forged else "AssertionError"
        assert t["status"] == "runtime_error" and why in t["reason"], t
        if forged:
            assert "opened 0 descriptors of other processes" in t["stderr"], t
        if "/proc" in name:
            assert "checks seen in []" in t["stderr"], t


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
    if name == "killing its own process":
        assert statuses == {"runtime_error"} and "SIGKILL" in r.details["tests"][0]["reason"]


def test_the_worker_survives_a_program_that_kills_its_parent(reward):
    pid = os.getpid()
    r = score(reward, HACKS["killing its parent, the checker"])
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
