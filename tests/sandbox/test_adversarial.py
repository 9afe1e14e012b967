"""Escapes tried against rlblocks.sandbox, as an attacker would: each is refused or contained, and the run returns
within its wall limit plus one second.

Every test runs in two modes: ``strict`` (bubblewrap; skipped where it cannot start here) and ``weak`` without
bubblewrap at all (``RLBLOCKS_BWRAP=""``: the rlimits, a cgroup where one can be made, and the audit hook), the
mode a machine without user namespaces gets when the caller opts into it. The assertions look at what happened
outside the sandbox (a server that never accepted, a process that still runs, a path that does not exist), not
only at what the program printed.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlblocks.sandbox import SandboxLimits, isolation_support, run_python

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = isolation_support()
MODES = [pytest.param("strict", marks=pytest.mark.skipif(not SUPPORT["available"],
                                                         reason=f"no strict isolation here: {SUPPORT['reason']}")),
         "weak"]
WALL = 3.0


@pytest.fixture(params=MODES)
def mode(request, monkeypatch):
    if request.param == "weak":
        monkeypatch.setenv("RLBLOCKS_BWRAP", "")
    return request.param


def limits(mode, **kw):
    kw.setdefault("cpu_seconds", 2)
    kw.setdefault("wall_seconds", WALL)
    return SandboxLimits(isolation=mode, **kw)


def timed(code, lim, **kw):
    t0 = time.perf_counter()
    r = run_python(code, limits=lim, **kw)
    elapsed = time.perf_counter() - t0
    assert elapsed <= lim.wall_seconds + 1.0, (elapsed, r)  # a bound, not a speed goal
    return r


# A separate process plays the reward worker: it runs the sandbox and reports, so that a kill that got through
# would show as a worker that never reported, not as a dead test runner.
WORKER = """
import json, os, sys, time
from rlblocks.sandbox import SandboxLimits, run_python
t0 = time.perf_counter()
r = run_python(sys.argv[1], args=[str(os.getpid())],
               limits=SandboxLimits(cpu_seconds=2, wall_seconds=float(sys.argv[3]), isolation=sys.argv[2]))
print(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr[-3000:],
                  "seconds": time.perf_counter() - t0, "isolation": r.isolation, "pid": os.getpid()}))
"""


def run_in_worker(code, mode, *, argv_token="", env_token=""):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    if mode == "weak":
        env["RLBLOCKS_BWRAP"] = ""
    if env_token:
        env["RLBLOCKS_TEST_SECRET"] = env_token
    p = subprocess.run([sys.executable, "-c", WORKER, code, mode, str(WALL), argv_token], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # the worker was not killed
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["seconds"] <= WALL + 1.0, report
    return report


def test_killing_the_parent_does_not_reach_the_worker(mode):
    code = (
        "import os, signal, sys, time\n"
        "host = int(sys.argv[1])\n"
        "for name, pid in (('parent', os.getppid()), ('worker', host)):\n"
        "    for how, f in (('kill', lambda: os.kill(pid, 9)), ('killpg', lambda: os.killpg(pid, 9)),\n"
        "                   ('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open(pid), 9))):\n"
        "        try:\n"
        "            f()\n"
        "            print(name, how, 'sent')\n"
        "        except Exception as e:\n"
        "            print(name, how, 'refused', type(e).__name__)\n"
        "time.sleep(0.2)\n"
        "print('still running')\n"
    )
    report = run_in_worker(code, mode)
    out = report["stdout"]
    assert "still running" in out, report  # the sandbox's own init ignored the kill, or the hook refused it
    assert "worker kill sent" not in out and "worker killpg sent" not in out and "worker pidfd sent" not in out
    if mode == "weak":  # no PID namespace: the audit hook is what stands between the program and its parent
        assert "parent kill refused PermissionError" in out and "parent killpg refused PermissionError" in out
    else:
        assert report["isolation"]["proc"] == "private"


def test_native_fork_through_ctypes_is_unreachable(mode):
    code = (
        "import glob, importlib.util, os, sys, sysconfig\n"
        "for name in ('ctypes', '_ctypes', 'cffi'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print(name, 'imported')\n"
        "    except ImportError as e:\n"
        "        print(name, 'refused')\n"
        "seen, stack, native = set(), [object], []\n"
        "while stack:\n"
        "    c = stack.pop()\n"
        "    for s in type.__subclasses__(c):\n"
        "        if s not in seen:\n"
        "            seen.add(s)\n"
        "            stack.append(s)\n"
        "            if getattr(s, '__module__', '') in ('_ctypes', 'ctypes'):\n"
        "                native.append(s.__name__)\n"
        "print('ctypes classes reachable:', len(native))\n"
        "so = glob.glob(os.path.join(sysconfig.get_paths()['platstdlib'], 'lib-dynload', '_ctypes*.so'))\n"
        "try:\n"
        "    spec = importlib.util.spec_from_file_location('_ctypes', so[0])\n"
        "    importlib.util.module_from_spec(spec)\n"
        "    print('loaded by hand')\n"
        "except (ImportError, IndexError) as e:\n"
        "    print('by hand refused')\n"
        "print('pid', os.getpid())\n"
    )
    r = timed(code, limits(mode))
    assert r.ok, r.stderr
    assert "ctypes refused" in r.stdout and "_ctypes refused" in r.stdout and "cffi refused" in r.stdout
    assert "ctypes classes reachable: 0" in r.stdout and "by hand refused" in r.stdout
    assert "imported" not in r.stdout and "loaded by hand" not in r.stdout


def _host_processes_with(token: str) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if token.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                    found.append(int(p))
            except OSError:
                pass
    return found


def test_a_setsid_grandchild_dies_with_the_run(mode):
    token = f"rlblocks-escape-{uuid.uuid4().hex}"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv('/bin/sh', ['sh', '-c', 'sleep 300; :', sys.argv[1]])\n"
        "    os._exit(0)\n"
        "print('spawned', flush=True)\n"
        "time.sleep(300)\n"
    )
    lim = limits(mode, allow_subprocesses=True, wall_seconds=2)
    r = timed(code, lim, args=[token])
    assert r.timed_out and "spawned" in r.stdout, r
    if mode == "weak" and r.isolation["processes"] != "cgroup":
        leftover = _host_processes_with(token)
        for pid in leftover:
            os.kill(pid, 9)
        pytest.skip("weak isolation without a writable pids cgroup reaches only the process group: a setsid() "
                    "child escapes it (subprocesses are refused by default for that reason)")
    deadline = time.monotonic() + 5
    while _host_processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _host_processes_with(token) == []
    # without subprocesses allowed the child cannot even be made
    r = timed(code, limits(mode), args=[token])
    assert r.returncode == 1 and "os.fork is not allowed" in r.stderr and _host_processes_with(token) == []


@pytest.mark.parametrize("allow_network", [False, True])
def test_a_unix_socket_of_the_host_is_unreachable(mode, allow_network):
    if allow_network and mode == "weak":
        pytest.skip("weak isolation with the network allowed has no kernel layer against Unix sockets")
    d = Path(tempfile.mkdtemp(prefix="rlblocks-test-sock-"))
    path = str(d / "s")
    abstract = f"\0rlblocks-test-{uuid.uuid4().hex}"
    servers = []
    for addr in (path, abstract):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(addr)
        srv.listen(8)
        srv.setblocking(False)
        servers.append(srv)
    code = (
        "import socket, sys\n"
        "for addr in sys.argv[1:]:\n"
        "    addr = addr.replace('@', '\\0', 1)\n"
        "    try:\n"
        "        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "        s.connect(addr)\n"
        "        print('connected', repr(addr))\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
    )
    try:
        r = timed(code, limits(mode, allow_network=allow_network), args=[path, "@" + abstract[1:]])
        assert r.ok and "connected" not in r.stdout and r.stdout.count("refused") == 2, r
        for srv in servers:  # nothing ever reached the host's listeners
            with pytest.raises(BlockingIOError):
                srv.accept()
    finally:
        for srv in servers:
            srv.close()
        os.unlink(path)
        d.rmdir()


def test_tcp_to_a_listening_localhost_port_is_unreachable(mode):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    code = (
        "import socket, sys\n"
        "for host in ('127.0.0.1', 'localhost', '::1'):\n"
        "    try:\n"
        "        socket.create_connection((host, int(sys.argv[1])), timeout=1)\n"
        "        print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
    )
    try:
        r = timed(code, limits(mode), args=[str(port)])
        assert r.ok and "connected" not in r.stdout and r.stdout.count("refused") == 3, r
        with pytest.raises(BlockingIOError):
            srv.accept()
        if mode == "strict":
            assert r.isolation["network"] == "namespace"
    finally:
        srv.close()


def test_filling_the_disk_is_bounded(mode):
    mib = 1 << 20
    lim = limits(mode, disk_bytes=8 * mib, file_bytes=2 * mib, max_created_files=6, wall_seconds=8, cpu_seconds=6)
    code = (
        "import os\n"
        "total = 0\n"
        "try:\n"
        "    for i in range(10000):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(2):\n"
        "                f.write(b'x' * (1 << 20))\n"
        "                f.flush()\n"
        "                total += 1 << 20\n"
        "except OSError as e:\n"
        "    print('stopped', type(e).__name__, flush=True)\n"
        "print('total', total, flush=True)\n"
        "for p in ('/dev/shm/x', '/var/tmp/x', os.path.expanduser('~/../x')):\n"
        "    try:\n"
        "        open(p, 'wb').write(b'x')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p)\n"
    )
    r = timed(code, lim)
    if r.limit == "disk":  # weak isolation: the host saw the directory pass disk_bytes and stopped the run
        assert mode == "weak"
        return
    assert r.ok, r
    total = int(r.stdout.split("total ")[1].split()[0])
    bound = 8 * mib if mode == "strict" else lim.max_created_files * lim.file_bytes
    assert 0 < total <= bound and "stopped" in r.stdout and "wrote" not in r.stdout, r.stdout


def test_the_parents_environment_and_cmdline_are_unreadable(mode):
    argv_token, env_token = f"argv-{uuid.uuid4().hex}", f"env-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "print('env', dict(os.environ))\n"
        "targets = {os.getppid(), int(sys.argv[1])}\n"
        "try:\n"
        "    targets |= {int(p) for p in os.listdir('/proc') if p.isdigit()}\n"
        "except OSError:\n"
        "    pass\n"
        "for pid in sorted(targets):\n"
        "    for what in ('cmdline', 'environ'):\n"
        "        try:\n"
        "            print(pid, what, open(f'/proc/{pid}/{what}', 'rb').read())\n"
        "        except OSError as e:\n"
        "            print(pid, what, 'refused', type(e).__name__)\n"
    )
    report = run_in_worker(code, mode, argv_token=argv_token, env_token=env_token)
    text = report["stdout"] + report["stderr"]
    assert "env {" in report["stdout"], report
    assert argv_token not in text and env_token not in text
    assert f"{report['pid']} cmdline b'" not in report["stdout"]  # the worker's own entry is not readable


def test_writes_and_links_outside_the_scratch_directory(mode):
    name = f"rlblocks-escape-{uuid.uuid4().hex}"
    host_tmp = os.path.join(tempfile.gettempdir(), name)
    code = (
        "import os\n"
        f"for p in ('/{name}', '/usr/{name}', {os.path.expanduser('~/' + name)!r}, {host_tmp!r}):\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p)\n"
        "for target in ('/proc/self/mem', '/', '../../..'):\n"
        "    try:\n"
        "        os.symlink(target, 'link')\n"
        "        print('linked', target, open('link/x' if target != '/proc/self/mem' else 'link', 'rb').read(1))\n"
        "    except OSError as e:\n"
        "        print('refused link', target)\n"
        "    if os.path.islink('link'):\n"
        "        os.remove('link')\n"
        "for p in ('/proc/self/mem', '/proc/self/task/%d/mem' % os.getpid()):\n"
        "    try:\n"
        "        open(p, 'rb').read(1)\n"
        "        print('read', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p)\n"
    )
    r = timed(code, limits(mode))
    assert r.ok, r.stderr
    for p in (f"/{name}", f"/usr/{name}", os.path.expanduser("~/" + name), host_tmp):
        assert not os.path.exists(p)
    assert "refused link /proc/self/mem" in r.stdout and "linked" not in r.stdout
    assert "read /proc" not in r.stdout and r.stdout.count("refused /proc/") == 2
    if mode == "weak":  # strict: the host's /tmp path is the sandbox's own tmpfs, and vanished with it
        assert r.stdout.count("refused /") >= 4


def test_crafted_code_objects_and_written_bytecode_are_refused(mode):
    code = (
        "import marshal, os, sys\n"
        "c = compile('x = 1', 'x', 'exec')\n"
        "for name, f in (('replace', lambda: c.replace(co_consts=(2,))),\n"
        "                ('CodeType', lambda: type(c)(*[0] * 18)),\n"
        "                ('marshal', lambda: marshal.loads(marshal.dumps(c)))):\n"
        "    try:\n"
        "        f()\n"
        "        print(name, 'made')\n"
        "    except (PermissionError, TypeError) as e:\n"
        "        print(name, 'refused', type(e).__name__)\n"
        "import importlib._bootstrap_external as ibe, importlib.util\n"
        "open('mod.py', 'w').write('VALUE = \"source\"\\n')\n"
        "st = os.stat('mod.py')\n"
        "pyc = ibe._code_to_timestamp_pyc(compile('VALUE = \"bytecode\"', 'mod.py', 'exec'), st.st_mtime, st.st_size)\n"
        "os.mkdir('__pycache__')\n"
        "open('pyc.bin', 'wb').write(pyc)  # a valid, up-to-date .pyc of other code\n"
        "for how, f in (('write', lambda: open(importlib.util.cache_from_source('mod.py'), 'wb').write(pyc)),\n"
        "               ('rename', lambda: os.rename('pyc.bin', importlib.util.cache_from_source('mod.py')))):\n"
        "    try:\n"
        "        f()\n"
        "        print(how, 'pyc placed')\n"
        "    except PermissionError:\n"
        "        print(how, 'pyc refused')\n"
        "sys.path.insert(0, os.getcwd())\n"
        "import mod\n"
        "print('mod', mod.VALUE)\n"
    )
    r = timed(code, limits(mode))
    assert r.ok, r.stderr
    assert "replace refused PermissionError" in r.stdout and "marshal refused PermissionError" in r.stdout
    assert "made" not in r.stdout
    assert "write pyc refused" in r.stdout and "rename pyc refused" in r.stdout
    assert "mod source" in r.stdout  # no bytecode of the program's making was read: the module came from source


@pytest.mark.parametrize("program", [
    "while True:\n    pass",
    "import time\ntime.sleep(300)",
    "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(300)",
    "import threading, time\n[threading.Thread(target=time.sleep, args=(300,)).start() for _ in range(4)]",
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(300)",
])
def test_the_run_returns_within_its_wall_limit(mode, program):
    r = timed(program, limits(mode, cpu_seconds=60, wall_seconds=2))
    assert r.timed_out and r.limit == "wall" and r.returncode is None
