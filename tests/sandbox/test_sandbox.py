"""rlblocks.sandbox: untrusted programs run in a separate, limited process; every limit is exercised for real.

Strict isolation (bubblewrap) where this machine allows it, else the weak mode, opted into explicitly; the tests of
layers only bubblewrap gives are skipped where it cannot start, with the reason."""

import asyncio
import glob
import os
import subprocess
import tempfile
import time
import uuid

import pytest

from rlblocks.errors import ArgumentError, SandboxUnavailable
from rlblocks.sandbox import SandboxLimits, arun_python, isolation_support, run_python

SUPPORT = isolation_support()
ISO = "strict" if SUPPORT["available"] else "weak"
FAST = SandboxLimits(cpu_seconds=1, wall_seconds=5, isolation=ISO)
needs_strict = pytest.mark.skipif(not SUPPORT["available"], reason=f"no strict isolation here: {SUPPORT['reason']}")


def own_cgroups() -> list[str]:
    """This process's run cgroups still present (other processes' runs have their own names)."""
    return glob.glob(f"/sys/fs/cgroup/pids/**/rlblocks-sandbox-{os.getpid()}-*", recursive=True)


def test_runs_a_program_with_stdin_args_and_files():
    code = "import sys; data = open('in.txt').read(); print(data, sys.argv[1:], sys.stdin.read())"
    r = run_python(code, stdin="from-stdin", args=("a", "b"), files={"in.txt": "file-content"}, limits=FAST)
    assert r.ok, r.stderr
    assert r.stdout.strip() == "file-content ['a', 'b'] from-stdin"
    assert {"network", "processes", "files"} <= set(r.isolation)  # the bootstrap reported its layers
    assert r.isolation["mode"] == ISO and r.isolation["missing"] == []


@needs_strict
def test_strict_isolation_reports_every_layer_in_force():
    r = run_python("import os; print(os.getpid(), os.getuid() >= 0)", limits=FAST)
    assert r.ok, r.stderr
    iso = r.isolation
    assert iso["tool"].startswith("bubblewrap ") and iso["namespaces"] == "user,pid,mount,ipc,uts,net"
    assert iso["network"] == "namespace" and iso["files"] == "read-only-root" and iso["proc"] == "private"
    assert iso["capabilities"] == "none" and iso["processes"] in ("cgroup", "rlimit-userns")
    assert iso["disk"] == f"tmpfs {FAST.disk_bytes}"
    assert r.stdout.split()[0] == "2"  # bubblewrap's init is 1 in the sandbox's PID namespace


@needs_strict
@pytest.mark.skipif(os.geteuid() != 0, reason="as root the per-run cgroup is the only process limit")
def test_the_sandbox_refuses_before_the_program_when_a_layer_is_not_in_force(monkeypatch):
    """The first code inside checks every layer again: without its cgroup, a root run has no process limit, and
    the program is not even read."""
    from rlblocks.sandbox import _cgroup

    monkeypatch.setattr(_cgroup.PidsCgroup, "create", classmethod(lambda cls, n: None))
    marker = f"ran-{uuid.uuid4().hex}"
    with pytest.raises(SandboxUnavailable, match="process_limit"):
        run_python(f"open({marker!r}, 'w'); print({marker!r})", limits=FAST)


def test_strict_isolation_refuses_where_bubblewrap_is_missing(monkeypatch):
    """No binary: a clear error naming the missing layer, nothing run; weak isolation still works when asked
    for, and says that it is weak."""
    monkeypatch.setenv("RLBLOCKS_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match=r"missing bubblewrap.*isolation='weak'"):
        run_python("print('ran')", limits=SandboxLimits(cpu_seconds=1, wall_seconds=5))
    r = run_python("print('ran')", limits=SandboxLimits(cpu_seconds=1, wall_seconds=5, isolation="weak"))
    assert r.ok and r.stdout == "ran\n"
    assert r.isolation["mode"] == "weak" and r.isolation["tool"] == "none" and r.isolation["namespaces"] == "none"
    assert isolation_support()["available"] is False and isolation_support()["missing"] == ["bubblewrap"]


def test_failure_is_a_result_not_an_exception():
    r = run_python("raise SystemExit(3)", limits=FAST)
    assert r.returncode == 3 and not r.ok
    r = run_python("1/0", limits=FAST)
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr


def test_infinite_loop_is_killed_by_the_cpu_limit():
    t0 = time.perf_counter()
    r = run_python("while True: pass", limits=SandboxLimits(cpu_seconds=1, wall_seconds=20, isolation=ISO))
    assert time.perf_counter() - t0 < 10
    assert r.limit == "cpu" and r.signal in ("SIGXCPU", "SIGKILL") and not r.ok


def test_sleeping_program_is_killed_at_the_wall_clock():
    t0 = time.perf_counter()
    r = run_python("import time; time.sleep(60)", limits=SandboxLimits(cpu_seconds=5, wall_seconds=1, isolation=ISO))
    assert time.perf_counter() - t0 < 8
    assert r.timed_out and r.limit == "wall" and r.returncode is None


def test_memory_bomb_is_refused():
    r = run_python("x = bytearray(8 << 30)", limits=SandboxLimits(memory_bytes=256 << 20, cpu_seconds=2, isolation=ISO))
    assert r.limit == "memory" and "MemoryError" in r.stderr


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'x' * (4 << 20))", limits=SandboxLimits(file_bytes=1 << 20, isolation=ISO))
    assert r.limit == "file_size" and not r.ok


def test_fork_is_refused_by_default():
    r = run_python("import os\nwhile True: os.fork()", limits=FAST)
    assert r.returncode == 1 and "not allowed" in r.stderr
    r = run_python("import subprocess; subprocess.run(['true'])", limits=FAST)
    assert r.returncode == 1 and "not allowed" in r.stderr


def test_fork_bomb_is_bounded_even_with_subprocesses_allowed():
    code = (
        "import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        print('refused after', n, flush=True); break\n    if pid == 0:\n        time.sleep(60)\n    n += 1\n"
    )
    limits = SandboxLimits(allow_subprocesses=True, max_processes=8, wall_seconds=3, cpu_seconds=3, isolation=ISO)
    others = [subprocess.Popen(["sleep", "60"]) for _ in range(24)]  # this user has more processes than 8
    try:
        r = run_python(code, limits=limits)
    finally:
        for p in others:
            p.kill()
            p.wait()
    if r.isolation.get("processes") not in ("cgroup", "rlimit-userns"):
        pytest.skip(f"no kernel process limit here (isolation={r.isolation}); the audit hook refuses fork by default")
    # the budget is the run's own: the program and at most 7 children, however many processes this user has
    n = int(r.stdout.split()[-1])
    assert n == 7, r.stdout
    assert own_cgroups() == []  # removed after the run, with every child in it killed


def test_network_is_unreachable():
    code = "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('connected')"
    r = run_python(code, limits=FAST)
    assert r.returncode != 0 and "connected" not in r.stdout


def test_writes_outside_the_sandbox_directory_fail():
    name = f"rlblocks-sandbox-escape-{uuid.uuid4().hex}"
    for target in (f"/{name}", f"/usr/{name}", f"/etc/{name}", f"/dev/{name}", f"/dev/shm/{name}",
                   os.path.join(os.path.expanduser("~"), name)):
        for code in (f"open({target!r}, 'w').write('x')", f"import os; os.mkdir({target!r})",
                     f"import os; os.open({target!r}, os.O_WRONLY | os.O_CREAT)"):
            r = run_python(code, limits=FAST)
            assert r.returncode == 1, (code, r.stderr)
            assert not os.path.exists(target)
    # the host's temporary directory: the sandbox's own /tmp (strict) or refused (weak); never the host's
    host_tmp = os.path.join(tempfile.gettempdir(), name)
    run_python(f"open({host_tmp!r}, 'w').write('x')", limits=FAST)
    assert not os.path.exists(host_tmp)
    r = run_python("open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())", limits=FAST)
    assert r.ok and r.stdout.strip() == "ok"


def test_nothing_written_inside_survives_the_run():
    name = f"rlblocks-sandbox-left-{uuid.uuid4().hex}"
    code = f"import os; open({name!r}, 'w').write('x'); print(os.path.abspath({name!r}), flush=True)"
    for extra, limits in (("", FAST), ("\nimport time; time.sleep(30)", SandboxLimits(wall_seconds=1, isolation=ISO))):
        r = run_python(code + extra, limits=limits)
        assert r.stdout.strip().endswith(name), r.stderr
        assert not os.path.exists(r.stdout.strip())
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"rlblocks-sandbox-{os.getpid()}-*")) == []
        assert own_cgroups() == []
    assert r.timed_out


def test_output_is_truncated_and_counted():
    r = run_python("print('x' * 100000)", limits=SandboxLimits(max_output_bytes=1000, isolation=ISO))
    assert len(r.stdout) == 1000 and r.stdout_truncated_bytes == 100001 - 1000


def test_concurrent_runs_are_independent():
    async def main():
        return await asyncio.gather(*(arun_python(f"print({i} * {i})", limits=FAST) for i in range(6)))

    results = asyncio.run(main())
    assert [r.stdout.strip() for r in results] == [str(i * i) for i in range(6)]


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cpu_seconds": 0}, "cpu_seconds"), ({"wall_seconds": float("inf")}, "wall_seconds"),
     ({"memory_bytes": -1}, "memory_bytes"), ({"max_processes": True}, "max_processes")],
)
def test_bad_limits_name_the_argument(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        SandboxLimits(**kwargs)


def test_bad_arguments():
    with pytest.raises(ArgumentError, match="code"):
        run_python(b"print(1)")
    with pytest.raises(ArgumentError, match="files"):
        run_python("print(1)", files={"../escape.txt": "x"})
