"""code_reward: programs run in the sandbox against tests; limits exercised for real, per-test outcomes."""

import asyncio
import glob
import os
import subprocess
import tempfile
import time
import uuid

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.reward import CodeReward, CodeTest, RewardPool, Sample, extract_code, outputs_match
from rlblocks.sandbox import SandboxLimits, isolation_support

# strict isolation where bubblewrap can start here; else the weak mode, asked for explicitly
ISO = "strict" if isolation_support()["available"] else "weak"
FAST = CodeReward(SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=256 << 20, isolation=ISO))
ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"}, CodeTest(stdin="0 0", stdout="0")]


def run(reward, response, tests):
    return asyncio.run(reward(Sample(response, tests)))


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt reads two numbers."


def test_correct_program_passes_every_test():
    r = run(FAST, fenced("a, b = map(int, input().split())\nprint(a + b)"), ADD)
    assert r.ok and r.score == 1.0 and r.components == {"pass_rate": 1.0, "all_passed": 1.0}
    assert [t["status"] for t in r.details["tests"]] == ["passed"] * 3
    assert {"network", "processes", "files"} <= set(r.details["isolation"])


def test_score_is_the_fraction_passed_with_per_test_outcomes():
    # right on the first test only; crashes on a negative number; prints the wrong thing for zeros
    code = "a, b = map(int, input().split())\nassert b >= 0, 'negative'\nprint(a + b if a else 'zero')"
    r = run(FAST, fenced(code), ADD)
    assert r.ok and r.score == pytest.approx(1 / 3) and r.components["all_passed"] == 0.0
    st = [t["status"] for t in r.details["tests"]]
    assert st == ["passed", "runtime_error", "wrong_answer"]
    assert "AssertionError: negative" in r.details["tests"][1]["stderr"]
    assert r.details["tests"][2]["stdout"] == "zero\n"


def test_assertion_style_tests():
    tests = [CodeTest(assertion="assert add(2, 3) == 5"), {"assert": "assert add(-1, 1) == 0"},
             {"assertion": "assert add(0.5, 0.25) == 1"}]
    r = run(FAST, "```py\ndef add(a, b):\n    return a + b\n```", tests)
    assert [t["status"] for t in r.details["tests"]] == ["passed", "passed", "runtime_error"]
    assert r.score == pytest.approx(2 / 3)


def test_infinite_loop_is_stopped():
    t0 = time.perf_counter()
    r = run(FAST, "while True:\n    pass", [{"input": "", "output": "1"}])
    assert time.perf_counter() - t0 < 10
    assert r.ok and r.score == 0.0 and r.details["tests"][0]["status"] in ("cpu_limit", "timeout")


def test_sleeping_program_is_stopped_at_the_wall_clock():
    r = run(CodeReward(SandboxLimits(cpu_seconds=5, wall_seconds=1, isolation=ISO)), "import time; time.sleep(60)",
            [{"input": "", "output": ""}, CodeTest(assertion="assert True")])
    for t in r.details["tests"]:  # a timeout, never a wrong answer, whatever kind of test it is
        assert t["status"] == "timeout" and "wall" in t["reason"], t
    assert r.score == 0.0


def test_memory_bomb_is_refused():
    r = run(FAST, "x = bytearray(8 << 30)\nprint('allocated')", [{"input": "", "output": "allocated"}])
    assert r.score == 0.0 and r.details["tests"][0]["status"] == "memory_limit"


def test_fork_bomb_is_refused_and_leaves_no_process():
    code = "import os\nwhile True:\n    os.fork()"
    r = run(FAST, code, [{"input": "", "output": "never"}])
    assert r.score == 0.0 and r.details["tests"][0]["status"] == "runtime_error"
    assert "not allowed" in r.details["tests"][0]["stderr"]
    assert not glob.glob(f"/sys/fs/cgroup/pids/**/rlblocks-sandbox-{os.getpid()}-*", recursive=True)


def test_fork_bomb_with_subprocesses_allowed_is_bounded_per_run_while_this_user_forks():
    """The process budget is the run's own (a pids cgroup, or RLIMIT_NPROC counted in the sandbox's user
    namespace): 20 other processes of this user, more than the run's budget of 6, change nothing."""
    others = [subprocess.Popen(["sleep", "60"]) for _ in range(20)]
    try:
        code = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
                "        print(n); break\n    if pid == 0:\n        time.sleep(60)\n    n += 1\n")
        reward = CodeReward(SandboxLimits(cpu_seconds=2, wall_seconds=6, max_processes=6, allow_subprocesses=True,
                                          isolation=ISO))
        r = run(reward, code, [{"input": "", "output": "5"}])
    finally:
        for p in others:
            p.kill()
            p.wait()
    if r.details["isolation"].get("processes") not in ("cgroup", "rlimit-userns"):
        pytest.skip(f"no kernel process limit here: {r.details['isolation']}")
    assert r.score == 1.0, r.details  # exactly the program and 5 children, then fork fails


def test_network_is_unreachable():
    code = "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')"
    r = run(FAST, code, [{"input": "", "output": "connected"}])
    assert r.score == 0.0 and r.details["tests"][0]["status"] == "runtime_error"


def test_writes_outside_the_scratch_directory_fail_and_nothing_written_survives():
    name = f"rlblocks-reward-escape-{uuid.uuid4().hex}"
    code = f"import os\nopen('/usr/{name}', 'w').write('x')\nprint('wrote')"
    r = run(FAST, code, [{"input": "", "output": "wrote"}])
    assert r.score == 0.0 and r.details["tests"][0]["status"] == "runtime_error"
    assert not os.path.exists(f"/usr/{name}")
    # the host's temporary directory is never written (strict: it is the sandbox's own /tmp)
    host_tmp = os.path.join(tempfile.gettempdir(), name)
    run(FAST, f"open({host_tmp!r}, 'w').write('x')", [{"input": "", "output": ""}])
    assert not os.path.exists(host_tmp)
    # inside its own directory the program may write; nothing of it is left afterwards
    code = f"import os\nopen({name!r}, 'w').write('ok')\nprint(open({name!r}).read(), os.path.abspath({name!r}))"
    r = run(FAST, code, [{"input": "", "output": "nothing"}])
    out = r.details["tests"][0]["stdout"].split()
    assert out[0] == "ok" and out[1].endswith(name) and not os.path.exists(out[1])


def test_file_size_and_output_limits():
    reward = CodeReward(SandboxLimits(file_bytes=1 << 20, max_output_bytes=1000, isolation=ISO))
    r = run(reward, "open('big', 'wb').write(b'x' * (4 << 20))", [{"input": "", "output": ""}])
    assert r.details["tests"][0]["status"] == "file_size_limit"
    r = run(reward, "print('y' * 5000)", [{"input": "", "output": "y" * 5000}])
    assert r.details["tests"][0]["status"] == "output_limit"  # cannot be checked: not a pass


def test_many_samples_through_a_pool():
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    samples = [Sample(good if i % 2 == 0 else "print('no')", ADD) for i in range(6)]
    with RewardPool(FAST, max_concurrency=3, timeout=60) as pool:
        results = pool.score(samples)
    assert [r.score for r in results] == [1.0, 0.0] * 3
    assert pool.stats()["ok"] == 6


def test_bad_references_are_error_results():
    for ref in (None, [], "print(1)", [{"inptu": "1"}], [{"input": "1"}]):
        r = run(FAST, "print(1)", ref)
        assert not r.ok and r.score is None and r.error.startswith("ArgumentError"), (ref, r)
        assert "reference" in r.error or "test" in r.error, (ref, r.error)


def test_extract_code_and_compare():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("```PY\nz = 3\n```") == "z = 3\n"
    assert extract_code("print(4)") == "print(4)"
    assert extract_code("```bash\nls\n```") == "```bash\nls\n```"  # not Python: the whole text
    assert outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert not outputs_match("1  2\n3", "1 2\n3")
    assert outputs_match("1  2\n3", "1 2 3", "tokens")
    assert not outputs_match("1\n", "1", "exact")
    with pytest.raises(ArgumentError, match="compare"):
        CodeReward(compare="fuzzy")
    with pytest.raises(ArgumentError, match="stdout/assertion"):
        CodeTest(stdin="1")


def test_no_isolation_is_an_error_result_not_a_score(monkeypatch):
    """Where strict isolation cannot be had, the reward is an error (the infrastructure failed), never a 0 that
    would train the policy away from a correct program."""
    monkeypatch.setenv("RLBLOCKS_BWRAP", "/nonexistent/bwrap")
    r = run(CodeReward(SandboxLimits(cpu_seconds=1, wall_seconds=4)), fenced("print(3)"), ADD[:1])
    assert not r.ok and r.score is None and "SandboxUnavailable" in r.error and "bubblewrap" in r.error
    assert r.details["tests"][0]["status"] == "sandbox_error"
