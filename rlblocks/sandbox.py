"""Run untrusted Python in a separate, limited process: the sandbox behind code rewards and tool environments.

Untrusted code (a model's program, a tool call) never runs in the trainer's process. :func:`arun_python` starts a
fresh interpreter in a temporary directory that is removed afterwards, and confines it in layers, each as far as
the kernel allows:

============  ===========================================================================================
limit         how
============  ===========================================================================================
CPU time      ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL one second later)
wall clock    the parent kills the whole process group (and the process cgroup) at ``wall_seconds``
memory        ``RLIMIT_AS`` (allocations beyond it fail with ``MemoryError``)
file size     ``RLIMIT_FSIZE`` (a larger write fails with ``EFBIG``); ``RLIMIT_CORE`` 0
processes     a pids cgroup with ``pids.max`` where ``/sys/fs/cgroup/pids`` is writable, else ``RLIMIT_NPROC``
              (effective for non-root users); and an audit hook refusing fork/exec/spawn unless allowed
network       a new network namespace (``unshare(CLONE_NEWNET)``, or with a user namespace when unprivileged);
              and an audit hook refusing socket creation
files         writes outside the sandbox directory are refused by an audit hook; as root, additionally a
              private mount namespace in which every mount but the sandbox directory is read-only
output        stdout and stderr are each cut at ``max_output_bytes`` (the rest is read and discarded, counted)
============  ===========================================================================================

The audit hook (PEP 578) is installed before the untrusted code is compiled and cannot be removed from Python; it
also refuses ``ctypes`` and ``sys.addaudithook``-style escapes of the interpreter. It is defence in depth, not a
security boundary against native code: the kernel-level layers are. :attr:`SandboxResult.isolation` says which
layers were in force for that run, so nothing is claimed that did not happen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rlblocks.errors import ArgumentError

__all__ = ["SandboxLimits", "SandboxResult", "arun_python", "run_python"]

_CGROUP_PIDS = Path("/sys/fs/cgroup/pids")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run. Times in seconds, sizes in bytes."""

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    max_output_bytes: int = 64 << 10
    max_processes: int = 16
    open_files: int = 64
    allow_subprocesses: bool = False
    allow_network: bool = False

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < float("inf")):
                raise ArgumentError(f"{name}: expected a finite number of seconds > 0, got {v!r}")
        for name in ("memory_bytes", "file_bytes", "max_output_bytes", "max_processes", "open_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ArgumentError(f"{name}: expected an int >= 1, got {v!r}")
        # A permission is a bool: ``allow_network="no"`` is truthy and would open the network.
        for name in ("allow_subprocesses", "allow_network"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ArgumentError(f"{name}: expected True or False, got {v!r}")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    ``limit``: the limit that ended the run, if one did: ``"wall"``, ``"cpu"``, ``"memory"``, ``"file_size"``, or
    ``"killed"`` (SIGKILL from outside the sandbox's own limits, e.g. the OOM killer). Output is never a reason
    to stop (it is truncated, not fatal). ``isolation``: which layers were in
    force (``network``: ``"namespace"`` or ``"audit"``; ``processes``: ``"cgroup"``, ``"rlimit"`` or
    ``"audit"``; ``files``: ``"mount-namespace"`` or ``"audit"``).
    """

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    limit: str | None = None
    signal: str | None = None
    stdout_truncated_bytes: int = 0
    stderr_truncated_bytes: int = 0
    isolation: dict[str, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited with status 0."""
        return self.returncode == 0 and not self.timed_out and self.error is None


# The bootstrap runs first in the child interpreter (python -I -c BOOTSTRAP config.json), single-threaded and
# before any untrusted byte is compiled. It applies the kernel-level layers, records what it achieved, installs
# the audit hook, then executes the program file. It imports ctypes for unshare/mount before the hook forbids it.
_BOOTSTRAP = r"""
def _sandbox_main():
    import json, os, resource, sys, types
    cfg = json.load(open(sys.argv[1]))
    root = os.path.realpath(os.getcwd())
    status = {"network": "audit", "processes": "audit", "files": "audit"}
    if cfg["cgroup"]:
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            status["processes"] = "cgroup"
        except OSError:
            pass
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
    MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
    if not cfg["allow_network"]:
        if libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            status["network"] = "namespace"
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNS) == 0:
        m = libc.mount
        m.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        r = root.encode()
        if m(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0 and m(r, r, None, MS_BIND, None) == 0:
            with open("/proc/self/mountinfo") as f:
                targets = [line.split()[4].replace("\\040", " ") for line in f]
            important_failed = False
            for t in targets:
                if t == root:  # the sandbox directory's own bind mount stays writable
                    continue
                if m(None, t.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0:
                    important_failed |= t == "/" or t.startswith(("/tmp", "/var", "/dev/shm", "/home", "/root"))
            os.chdir(root)  # enter the writable bind mount: the old working directory is on the read-only one
            if not important_failed:
                status["files"] = "mount-namespace"
    lim = cfg["limits"]
    if status["processes"] != "cgroup" and os.geteuid() != 0:
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_processes"], lim["max_processes"]))
            status["processes"] = "rlimit"
        except (ValueError, OSError):
            pass
    cpu = max(1, int(-(-lim["cpu_seconds"] // 1)))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    # Drop every capability (and forbid regaining one through exec): without CAP_SYS_ADMIN the program cannot
    # leave its namespaces (setns), remount, or move itself out of the cgroup, even as uid 0.
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly past the last capability)

    class _CapHeader(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class _CapData(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    caps_dropped = libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()) == 0
    status["capabilities"] = "dropped" if caps_dropped else "kept"
    # With every kernel layer in force, native code (ctypes, numpy) cannot undo the confinement, so it is allowed;
    # otherwise the audit hook is a real layer and native code could switch it off, so ctypes is refused.
    kernel_confined = (
        caps_dropped
        and (status["network"] == "namespace" or cfg["allow_network"])
        and status["processes"] in ("cgroup", "rlimit")
        and status["files"] == "mount-namespace"
    )
    status["native_code"] = "allowed" if kernel_confined else "refused"
    os.write(cfg["status_fd"], json.dumps(status).encode())
    os.close(cfg["status_fd"])
    del libc
    for name in [k for k in sys.modules if k == "ctypes" or k.startswith("ctypes.") or k == "_ctypes"]:
        del sys.modules[name]  # a later `import ctypes` must go through the audit hook again

    blocked_imports = set() if kernel_confined else {"ctypes", "_ctypes", "cffi"}
    if not cfg["allow_subprocesses"]:
        blocked_imports.add("_posixsubprocess")
    proc_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen"}
    fs_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                 "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    # Everything the hook needs is bound as default arguments: setting a function's __defaults__ or __code__
    # raises the audit event "object.__setattr__", which the hook refuses for itself.
    def _sandbox_hook(event, args, root=root, allow_proc=cfg["allow_subprocesses"], allow_net=cfg["allow_network"],
                      proc_events=frozenset(proc_events), fs_events=frozenset(fs_events),
                      blocked=frozenset(blocked_imports), write_flags=write_flags, realpath=os.path.realpath,
                      fspath=os.fspath, sep=os.sep, PathLike=os.PathLike):
        def inside(p):
            if isinstance(p, int):
                return True
            try:
                p = realpath(fspath(p))
            except TypeError:
                return False
            if isinstance(p, bytes):
                p = p.decode("utf-8", "surrogateescape")
            return p == root or p.startswith(root + sep)

        if event == "open":
            path, mode, flags = args
            if isinstance(flags, int) and flags >= 0:
                writing = bool(flags & write_flags)
            else:
                writing = bool(mode) and any(c in mode for c in "wax+")
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the sandbox directory is not allowed: {path!r}")
        elif event in fs_events:
            for a in args[:2]:
                if isinstance(a, (str, bytes, PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed: {a!r}")
        elif event in proc_events:
            if not allow_proc:
                raise PermissionError(f"sandbox: {event} is not allowed (no subprocesses)")
        elif event.startswith("socket."):
            if not allow_net:
                raise PermissionError(f"sandbox: {event} is not allowed (no network)")
        elif event == "import":
            if args[0] in blocked:
                raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        elif event == "sys.addaudithook" or (event == "ctypes.dlopen" and "ctypes" in blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" and args[0] is _sandbox_hook:
            raise PermissionError(f"sandbox: changing the sandbox's audit hook ({args[1]}) is not allowed")

    program = cfg["program"]
    sys.argv = [program, *cfg["args"]]
    src = open(program, "rb").read()
    sys.addaudithook(_sandbox_hook)
    code = compile(src, program, "exec")
    main = types.ModuleType("__main__")
    main.__file__ = program
    sys.modules["__main__"] = main
    return code, main.__dict__


_code, _globals = _sandbox_main()
del _sandbox_main
exec(_code, _globals)
"""


def _cgroup_create(max_processes: int) -> Path | None:
    """A fresh pids cgroup limited to ``max_processes`` tasks, or None where the hierarchy is not writable."""
    if not _CGROUP_PIDS.is_dir() or not os.access(_CGROUP_PIDS, os.W_OK):
        return None
    path = _CGROUP_PIDS / f"rlblocks-sandbox-{os.getpid()}-{time.monotonic_ns()}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(max_processes))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return None
    return path


def _cgroup_kill_and_remove(path: Path | None) -> None:
    if path is None:
        return
    for _ in range(50):
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    try:
        path.rmdir()
    except OSError:
        pass


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, int]:
    kept = bytearray()
    dropped = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return bytes(kept), dropped
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        dropped += max(0, len(chunk) - max(room, 0))


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _check_run_args(code: object, stdin: object, args: object, files: object, python: object) -> None:
    if not isinstance(code, str):
        raise ArgumentError(f"code: expected a str of Python source, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise ArgumentError(f"stdin: expected a str (the program's standard input), got {type(stdin).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise ArgumentError(f"args: expected a tuple or list of str (sys.argv[1:]), got {args!r:.80}")
    for i, a in enumerate(args):
        if not isinstance(a, str):
            raise ArgumentError(f"args[{i}]: expected a str, got {type(a).__name__} {a!r:.40}")
    if files is not None:
        if not isinstance(files, Mapping):
            raise ArgumentError(f"files: expected a mapping of relative path -> str or bytes, got "
                                f"{type(files).__name__}")
        for rel, content in files.items():
            if not isinstance(rel, str) or not rel:
                raise ArgumentError(f"files: expected non-empty str paths, got {rel!r}")
            if not isinstance(content, (str, bytes, bytearray, memoryview)):
                # bytes(3) would silently write three zero bytes
                raise ArgumentError(f"files[{rel!r}]: expected str or bytes content, got {type(content).__name__}")
    if python is not None and not isinstance(python, (str, os.PathLike)):
        raise ArgumentError(f"python: expected None or the path of an interpreter, got {type(python).__name__}")


async def arun_python(
    code: str,
    *,
    stdin: str = "",
    args: tuple[str, ...] = (),
    files: dict[str, str | bytes] | None = None,
    limits: SandboxLimits | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh, limited interpreter; never in this process.

    ``stdin`` (a str) is fed to the program; ``args`` (str each) become ``sys.argv[1:]``; ``files`` (relative path
    → str or bytes content) are written into the sandbox directory first, beside the program itself
    (``main.py``, a name ``files`` may not use). The directory is the program's working directory and ``HOME``/
    ``TMPDIR``; it is removed afterwards in every case. The child gets a minimal environment (``PATH``, UTF-8 I/O)
    and runs with ``python -I`` (no ``PYTHONPATH``, no user site). Returns a :class:`SandboxResult`; a program
    that fails, is killed or exceeds a limit is a result, not an exception. Bad arguments raise
    :class:`~rlblocks.errors.ArgumentError` before anything runs.
    """
    _check_run_args(code, stdin, args, files, python)
    limits = SandboxLimits() if limits is None else limits
    if not isinstance(limits, SandboxLimits):
        raise ArgumentError(f"limits: expected a SandboxLimits, got {type(limits).__name__}")
    work = Path(tempfile.mkdtemp(prefix="rlblocks-sandbox-"))
    cfg_dir: Path | None = None
    status_fds: list[int] = []  # the status pipe's ends still open in this process
    cgroup = None
    t0 = time.perf_counter()

    def close_fd(fd: int) -> None:
        if fd in status_fds:
            status_fds.remove(fd)
            os.close(fd)

    try:
        program = work / "main.py"
        program.write_text(code, encoding="utf-8")
        for rel, content in (files or {}).items():
            target = (work / rel).resolve()
            if work.resolve() not in target.parents:
                raise ArgumentError(f"files: expected relative paths inside the sandbox, got {rel!r}")
            if target == program.resolve():
                raise ArgumentError(f"files: {rel!r} is the program's own file; choose another name")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content.encode() if isinstance(content, str) else bytes(content))
        cfg_dir = Path(tempfile.mkdtemp(prefix="rlblocks-sandbox-cfg-"))
        cgroup = _cgroup_create(limits.max_processes)
        status_r, status_w = os.pipe()
        status_fds += [status_r, status_w]
        cfg = {
            "program": str(program),
            "args": list(args),
            "status_fd": status_w,
            "cgroup": str(cgroup) if cgroup else "",
            "allow_network": limits.allow_network,
            "allow_subprocesses": limits.allow_subprocesses,
            "limits": dataclasses.asdict(limits),
        }
        (cfg_dir / "config.json").write_text(json.dumps(cfg))
        env = {"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8", "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = await asyncio.create_subprocess_exec(
            python or sys.executable, "-I", "-c", _BOOTSTRAP, str(cfg_dir / "config.json"),
            cwd=str(work), env=env, start_new_session=True, pass_fds=(status_w,),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        close_fd(status_w)
        cap = limits.max_output_bytes
        readers = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap))

        async def feed() -> None:
            try:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(feed(), proc.wait()), timeout=limits.wall_seconds)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc)
            _cgroup_kill_and_remove(cgroup)
            cgroup = None
            if proc.returncode is None:
                await proc.wait()
        (out, out_dropped), (err, err_dropped) = await readers
        seconds = time.perf_counter() - t0
        os.set_blocking(status_r, False)
        try:
            isolation = json.loads(os.read(status_r, 65536) or b"{}")
        except (OSError, ValueError):
            isolation = {}
        rc = proc.returncode
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
        stderr = err.decode("utf-8", "replace")
        limit = None
        if timed_out:
            limit = "wall"
        elif sig == "SIGXCPU" or (sig == "SIGKILL" and seconds >= limits.cpu_seconds):
            # RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL one second later; a SIGKILL before the CPU
            # budget could even have been spent came from elsewhere (e.g. the kernel's OOM killer)
            limit = "cpu"
        elif sig == "SIGKILL":
            limit = "killed"
        elif sig == "SIGXFSZ":
            limit = "file_size"
        elif rc != 0:
            # The program's own stderr names these; a program that exits 0 was not stopped by a limit, whatever it
            # printed (a correct program may catch a MemoryError, or print the words).
            if "MemoryError" in stderr:
                limit = "memory"
            elif "File too large" in stderr:
                limit = "file_size"
        return SandboxResult(
            returncode=None if timed_out else rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=stderr,
            seconds=seconds,
            timed_out=timed_out,
            limit=limit,
            signal=sig,
            stdout_truncated_bytes=out_dropped,
            stderr_truncated_bytes=err_dropped,
            isolation=isolation,
        )
    except ArgumentError:
        raise
    except OSError as e:  # could not even start the interpreter
        return SandboxResult(None, "", "", time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    finally:
        # Every path (a result, an interpreter that would not start, a cancelled call) removes both directories
        # and closes the status pipe: a long run of code rewards must not pile up temporary files or descriptors.
        for fd in list(status_fds):
            close_fd(fd)
        _cgroup_kill_and_remove(cgroup)
        if cfg_dir is not None:
            shutil.rmtree(cfg_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def run_python(code: str, **kwargs) -> SandboxResult:
    """Blocking form of :func:`arun_python` (same arguments). Do not call it from a running event loop."""
    return asyncio.run(arun_python(code, **kwargs))
