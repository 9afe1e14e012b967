"""The implementation of :mod:`rlblocks.sandbox` (see the package's documentation for the layers): the limits,
the result, the probe of what this machine allows, and the run itself."""


from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlblocks._checks import check_bool, check_choice, check_int, check_seconds
from rlblocks.errors import ArgumentError, SandboxUnavailable
from rlblocks.sandbox import _bwrap, _seccomp
from rlblocks.sandbox._cgroup import PidsCgroup

__all__ = ["SandboxLimits", "SandboxResult", "arun_python", "isolation_support", "run_python"]

_ISOLATION = ("strict", "weak")
_BOOT = (Path(__file__).with_name("_boot.py")).read_text(encoding="utf-8")
_REFUSED_RC = 97  # the bootstrap's exit status when a required layer is missing
# Seconds each step of the clean-up after the wall clock may take (reap, empty the cgroup, drain the pipes): three
# steps stay under the one second a call may run past wall_seconds.
_GRACE = 0.3
_WEAK_PREFIX = "rlblocks-sandbox-"
# Layers a strict run requires (checked again inside, before the program is read).
_REQUIRED = ("user_namespace", "pid_namespace", "seccomp", "no_capabilities", "no_new_privs", "read_only_root",
             "scratch_limit", "network_namespace", "process_limit")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run. Times in seconds, sizes in bytes.

    ``max_processes``: processes and threads of the program at once, itself included. ``disk_bytes``: the size
    of the scratch directory (all files together; ``file_bytes`` caps each one). ``max_created_files``: weak
    isolation only, new files the program may create. ``isolation``: ``"strict"`` (default) refuses to run
    where a layer of the table above cannot be put in force; ``"weak"`` runs anyway with what there is, and
    :attr:`SandboxResult.isolation` says what that was.
    """

    cpu_seconds: float = 5.0
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    max_output_bytes: int = 64 << 10
    max_processes: int = 16
    open_files: int = 64
    max_created_files: int = 256
    allow_subprocesses: bool = False
    allow_network: bool = False
    isolation: str = "strict"

    def __post_init__(self) -> None:
        # frozen: the checked values (plain floats and ints, numpy ones converted) are set through object
        for name in ("cpu_seconds", "wall_seconds"):
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        for name in ("memory_bytes", "file_bytes", "disk_bytes", "max_output_bytes", "max_processes", "open_files",
                     "max_created_files"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        if self.disk_bytes < 4096:
            raise ArgumentError(f"disk_bytes: expected at least 4096 (one page of tmpfs), got {self.disk_bytes}")
        # A permission is a bool: ``allow_network="no"`` is truthy and would open the network.
        check_bool("allow_subprocesses", self.allow_subprocesses)
        check_bool("allow_network", self.allow_network)
        check_choice("isolation", self.isolation, _ISOLATION)


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    ``limit``: the limit that ended the run, if one did: ``"wall"``, ``"cpu"``, ``"memory"``, ``"file_size"``,
    ``"disk"`` (the scratch directory is full), or ``"killed"`` (SIGKILL from outside the sandbox's own limits,
    e.g. the OOM killer). Output is never a reason to stop (it is truncated, not fatal). ``isolation``: the layers
    in force, as the sandbox's first code found them (``mode``, ``tool``, ``namespaces``, ``seccomp``,
    ``network``, ``processes``, ``files``, ``disk``, ``proc``, ``capabilities``, ``audit_hook``, and with checks
    ``checks``: where they ran). ``checks_passed``: for a run with ``checks``, whether every check ran to its end
    without an error while the program's process kept answering (the checker's verdict, read from a pipe the
    program cannot write to); ``None`` without checks. ``error``: the sandbox itself failed (the interpreter
    would not start); the program did not run.
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
    checks_passed: bool | None = None

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited with status 0 (and passed its checks, when it had any)."""
        return (self.returncode == 0 and not self.timed_out and self.error is None
                and self.checks_passed is not False)


def isolation_support(python: str | None = None) -> dict[str, object]:
    """What a strict run would get here, without running anything untrusted: ``available`` (bool), ``tool``,
    ``missing`` (layer names) and ``reason``. Probed once per process (one minimal sandbox is started)."""
    python = python or sys.executable
    pr = _bwrap.probe(_bwrap.find_bwrap(), str(python))
    missing = list(pr.missing)
    reason = pr.reason
    if pr.ok and os.geteuid() == 0 and not _cgroup_possible():
        missing.append("process_limit")
        reason = ("running as root, where RLIMIT_NPROC is not enforced, and no writable pids cgroup "
                  "(/sys/fs/cgroup/pids, or a cgroup2 directory delegating pids) to bound the processes per run")
    if pr.ok and os.geteuid() != 0 and _kernel() < (5, 14) and not _cgroup_possible():
        missing.append("process_limit")
        reason = "kernel older than 5.14 (RLIMIT_NPROC is per user, not per user namespace) and no pids cgroup"
    return {"available": not missing, "tool": pr.tool, "missing": missing, "reason": reason}


def _kernel() -> tuple[int, ...]:
    rel = os.uname().release.split("-")[0].split(".")
    return tuple(int(x) for x in rel[:2] if x.isdigit())


_CGROUP_OK: list[bool] = []


def _cgroup_possible() -> bool:
    if not _CGROUP_OK:
        cg = PidsCgroup.create(8)
        _CGROUP_OK.append(cg is not None)
        if cg is not None:
            cg.remove()
    return _CGROUP_OK[0]


class _Capture:
    """One output stream: the first ``cap`` bytes and the count of the rest; what was read so far stays
    available when reading is stopped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.dropped = 0

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = self.cap - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped += len(chunk) - max(min(room, len(chunk)), 0)


def _check_run_args(code: object, stdin: object, args: object, files: object, python: object,
                    checks: object) -> None:
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
            parts = rel.split("/")
            if rel.startswith("/") or ".." in parts or "" in parts or "." in parts or "\0" in rel:
                raise ArgumentError(f"files: expected relative paths inside the sandbox, got {rel!r}")
            if rel == "main.py":
                raise ArgumentError(f"files: {rel!r} is the program's own file; choose another name")
    if python is not None and not isinstance(python, (str, os.PathLike)):
        raise ArgumentError(f"python: expected None or the path of an interpreter, got {type(python).__name__}")
    if checks is not None:
        if isinstance(checks, (str, bytes)) or not isinstance(checks, Sequence) or not checks:
            raise ArgumentError(f"checks: expected None or a non-empty sequence of str (Python statements), got "
                                f"{checks!r:.80}")
        for i, c in enumerate(checks):
            if not isinstance(c, str):
                raise ArgumentError(f"checks[{i}]: expected a str of Python statements, got {type(c).__name__}")


def _sweep_weak_dirs() -> None:
    """Remove temporary directories of weak runs whose process died before it could remove them."""
    tmp = Path(tempfile.gettempdir())
    try:
        entries = [p for p in tmp.iterdir() if p.name.startswith(_WEAK_PREFIX)]
    except OSError:
        return
    for p in entries:
        try:
            owner = int(p.name[len(_WEAK_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner == os.getpid():
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _dir_bytes(path: Path) -> int:
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass
        except OSError:
            pass
    return total


def _status(fd: int, marker: str | None) -> tuple[dict, dict]:
    """What the sandbox's first code wrote on the status pipe: the layers in force (the first line), and with
    checks the checker's verdict (a later line carrying this run's marker; none when the checker died)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except OSError:  # nothing more (EAGAIN)
        pass
    lines = []
    for line in data.split(b"\n"):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            lines.append(obj)
    isolation = lines[0] if lines and "marker" not in lines[0] else {}
    verdict = next((v for v in lines if marker is not None and v.get("marker") == marker), {})
    return isolation, verdict


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("rlblocks-sandbox-file", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _classify(rc: int | None, sig: str | None, seconds: float, stderr: str, limits: SandboxLimits,
              timed_out: bool, disk_full: bool) -> str | None:
    if timed_out:
        return "wall"
    if disk_full:
        return "disk"
    if sig == "SIGXCPU" or (sig == "SIGKILL" and seconds >= limits.cpu_seconds):
        # RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL one second later; a SIGKILL before the CPU budget
        # could even have been spent came from elsewhere (e.g. the kernel's OOM killer)
        return "cpu"
    if sig == "SIGKILL":
        return "killed"
    if sig == "SIGXFSZ":
        return "file_size"
    if rc not in (0, None):
        # The program's own stderr names these; a program that exits 0 was not stopped by a limit, whatever it
        # printed (a correct program may catch a MemoryError, or print the words).
        if "MemoryError" in stderr:
            return "memory"
        if "File too large" in stderr:
            return "file_size"
        if "No space left on device" in stderr:
            return "disk"
    return None


async def arun_python(
    code: str,
    *,
    stdin: str = "",
    args: tuple[str, ...] = (),
    files: dict[str, str | bytes] | None = None,
    limits: SandboxLimits | None = None,
    python: str | None = None,
    checks: Sequence[str] | None = None,
) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh, confined interpreter; never in this process.

    ``stdin`` (a str) is fed to the program; ``args`` (str each) become ``sys.argv[1:]``; ``files`` (relative path
    → str or bytes content) are written into the scratch directory first, beside the program itself (``main.py``,
    a name ``files`` may not use). The program runs as ``__main__``.

    ``checks``: Python statements (assertion tests) run after the program, as if in its namespace, but in a
    separate checker process inside the same sandbox: the checks, their constants and the verdict never enter
    the program's process, so no frame walk, garbage-collector search or re-run of code it finds can read or
    forge them. The checks see the program's top-level names as proxies: calls, attributes, items, ``len``,
    ``bool``, iteration and ``str`` go to the program's process over a pipe, and results come back as plain
    built-in values (a namedtuple as a tuple, a numpy scalar as a number; an object of the program's own class
    stays a reference, equal only to itself), so the comparisons run on the checker's side and no ``__eq__`` of
    the program decides them. Lists, dicts, sets and bytearrays passed to a call are updated in place afterwards.
    A program name that is also a builtin's (``abs``, ``len``, ...) is not seen by the checks. ``checks_passed``
    is the checker's verdict, written with a per-run marker on a pipe the program's process does not hold: an
    early ``os._exit(0)`` / ``sys.exit(0)`` / ``atexit`` exit, a patched ``print`` or ``sys.stdout``, a killed
    checker, printed or guessed verdicts never pass. The program's process ends when the checks are done (no
    ``atexit`` handlers run); a program that ends before, killed by a signal or not, ends the run the same way
    (its exit status, or ``0`` with ``checks_passed`` False). Checks with ``allow_subprocesses=True`` are refused:
    in weak isolation a child process could read the checker's memory.

    Returns a :class:`SandboxResult`; a program that fails, is killed or exceeds a limit is a result, not an
    exception, and the call returns within about ``wall_seconds + 1`` s. Raises
    :class:`~rlblocks.errors.ArgumentError` for bad arguments and :class:`~rlblocks.errors.SandboxUnavailable`
    where strict isolation cannot be had, both before anything runs.
    """
    _check_run_args(code, stdin, args, files, python, checks)
    limits = SandboxLimits() if limits is None else limits
    if not isinstance(limits, SandboxLimits):
        raise ArgumentError(f"limits: expected a SandboxLimits, got {type(limits).__name__}")
    if checks is not None and limits.allow_subprocesses:
        raise ArgumentError("checks: expected limits.allow_subprocesses=False with checks (a child process could "
                            "read the checker's memory), got allow_subprocesses=True")
    python = os.fspath(python) if python is not None else sys.executable
    t0 = time.perf_counter()
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return SandboxResult(None, "", "", time.perf_counter() - t0,
                             error=f"FileNotFoundError: no executable Python interpreter at {python!r}")

    support = isolation_support(python)
    strict = limits.isolation == "strict"
    if strict and not support["available"]:
        raise SandboxUnavailable(
            f"the sandbox cannot run untrusted code here: missing {', '.join(support['missing'])} "
            f"({support['reason']}). Install bubblewrap (pip install 'rlblocks[sandbox]') on a kernel with user "
            f"namespaces, or opt into the weaker isolation explicitly with SandboxLimits(isolation='weak')")
    use_bwrap = _bwrap.probe(_bwrap.find_bwrap(), python).ok or (
        not strict and _bwrap.probe(_bwrap.find_bwrap(), python).missing == ["seccomp"])
    bwrap = _bwrap.find_bwrap() if use_bwrap else None
    with_seccomp = use_bwrap and _seccomp.SUPPORTED

    fds: list[int] = []  # descriptors of this process to close at the end
    work: Path | None = None
    cgroup: PidsCgroup | None = None
    marker: str | None = None
    proc: asyncio.subprocess.Process | None = None

    def passed_file(data: bytes) -> int:
        # an anonymous in-memory file (no size limit, unlike a pipe's buffer, and no path anyone could open)
        fd = _memfd(data)
        fds.append(fd)
        pass_fds.append(fd)
        return fd

    try:
        extra = 1 if checks is not None else 0  # the checker process
        cgroup = PidsCgroup.create(limits.max_processes + extra + (2 if use_bwrap else 1))
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        pass_fds = [status_w]
        secret_fd = -1
        if checks is not None:
            marker = secrets.token_hex(16)
            secret_fd = passed_file(json.dumps({"marker": marker, "checks": list(checks)}).encode())
        cfg = {
            "status_fd": status_w, "secret_fd": secret_fd, "args": list(args), "mode": limits.isolation,
            "tool": support["tool"] if use_bwrap else "none", "bwrap": use_bwrap, "cgroup": cgroup is not None,
            "allow_network": limits.allow_network, "allow_subprocesses": limits.allow_subprocesses,
            "limits": dataclasses.asdict(limits), "max_created_files": limits.max_created_files,
            "require": list(_REQUIRED if strict else ()), "host_uid": os.getuid(),
        }
        if strict and not with_seccomp:
            cfg["require"].remove("seccomp")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if use_bwrap:
            scratch = _bwrap.SCRATCH
            cfg["program"] = f"{scratch}/main.py"
            prefixes = _bwrap.python_prefixes(python)
            cfg["ro_prefixes"] = [p.rstrip("/") + "/" for p in prefixes]
            argv = [bwrap, *_bwrap.base_args(allow_network=limits.allow_network, disk_bytes=limits.disk_bytes),
                    *_bwrap.bind_args(prefixes, limits.allow_network)]
            for k, v in (("HOME", scratch), ("TMPDIR", scratch), ("PATH", env["PATH"]), ("LANG", "C.UTF-8")):
                argv += ["--setenv", k, v]
            made = set()
            for rel, content in [("main.py", code), *(files or {}).items()]:
                parts = rel.split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i])
                    if d not in made:
                        made.add(d)
                        argv += ["--dir", f"{scratch}/{d}"]
                fd = passed_file(content.encode() if isinstance(content, str) else bytes(content))
                argv += ["--file", str(fd), f"{scratch}/{rel}"]
            if with_seccomp:
                argv += ["--seccomp", str(passed_file(_seccomp.filter_program()))]
            argv += ["--chdir", scratch, *_bwrap.final_args(), "--",
                     python, "-I", "-S", "-B", "-c", _BOOT]
            cwd = None
        else:
            _sweep_weak_dirs()
            work = Path(tempfile.mkdtemp(prefix=f"{_WEAK_PREFIX}{os.getpid()}-"))
            program = work / "main.py"
            program.write_text(code, encoding="utf-8")
            for rel, content in (files or {}).items():
                target = work / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content.encode() if isinstance(content, str) else bytes(content))
            cfg["program"] = str(program)
            env.update({"HOME": str(work), "TMPDIR": str(work)})
            argv = [python, "-I", "-S", "-B", "-c", _BOOT]
            cwd = str(work)
        argv.append(json.dumps(cfg))
        if cgroup is not None:
            argv = cgroup.wrap(argv)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=env, start_new_session=True, pass_fds=pass_fds,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        for fd in pass_fds:  # the child has its copies; ours would keep the pipes open
            if fd in fds:
                fds.remove(fd)
                os.close(fd)
        out_cap, err_cap = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
        readers = asyncio.ensure_future(asyncio.gather(out_cap.pump(proc.stdout), err_cap.pump(proc.stderr)))

        async def feed() -> None:
            try:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        disk_full = False

        async def watch_disk() -> None:
            # weak isolation has no size-limited filesystem: poll the directory and stop the run when it is full
            nonlocal disk_full
            while True:
                await asyncio.sleep(0.05)
                if _dir_bytes(work) > limits.disk_bytes:
                    disk_full = True
                    return

        timed_out = False
        # The run ends when the process exits, not when its pipes close: a stray descendant may hold them.
        waiters = [asyncio.ensure_future(_exited(proc))]
        if work is not None:
            waiters.append(asyncio.ensure_future(watch_disk()))
        feeder = asyncio.ensure_future(feed())
        try:
            done, _ = await asyncio.wait(waiters, timeout=limits.wall_seconds, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not done
        finally:
            for w in [*waiters, feeder]:
                w.cancel()
            await asyncio.gather(*waiters, feeder, return_exceptions=True)
            await _kill(proc, cgroup, group=work is not None)
        try:
            await asyncio.wait_for(readers, _GRACE)
        except asyncio.TimeoutError:  # a descendant outside every kill still holds a pipe: stop reading there
            pass
        out, out_dropped = bytes(out_cap.kept), out_cap.dropped
        err, err_dropped = bytes(err_cap.kept), err_cap.dropped
        seconds = time.perf_counter() - t0
        isolation, verdict = _status(status_r, marker)
        rc = proc.returncode
        if use_bwrap and rc is not None and 128 < rc < 128 + signal.NSIG:
            # bubblewrap exits with 128 + N when the program was killed by signal N (a program that exits with
            # such a status itself is read the same way)
            rc = 128 - rc
        stderr = err.decode("utf-8", "replace")
        if rc == _REFUSED_RC and isolation.get("missing"):
            if strict:
                raise SandboxUnavailable(f"the sandbox refused to run the program: layers not in force here: "
                                         f"{', '.join(isolation['missing'])}")
        if use_bwrap and not isolation and rc not in (0, None) and not timed_out:
            # bubblewrap itself failed before the interpreter started
            msg = stderr.strip()[-500:] or f"exit status {rc}"
            if strict:
                raise SandboxUnavailable(f"bubblewrap could not start the sandbox: {msg}")
            return SandboxResult(None, "", stderr, seconds, error=f"bubblewrap could not start the sandbox: {msg}")
        passed = None if marker is None else verdict.get("checks") == "passed"
        if "checker" in verdict:
            isolation["checks"] = verdict["checker"]
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
        return SandboxResult(
            returncode=None if timed_out else rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=stderr,
            seconds=seconds,
            timed_out=timed_out,
            limit=_classify(rc, sig, seconds, stderr, limits, timed_out, disk_full),
            signal=sig,
            stdout_truncated_bytes=out_dropped,
            stderr_truncated_bytes=err_dropped,
            isolation=isolation,
            checks_passed=passed,
        )
    except (ArgumentError, SandboxUnavailable):
        raise
    except OSError as e:  # could not even start the interpreter
        return SandboxResult(None, "", "", time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    finally:
        # Every path (a result, an interpreter that would not start, a cancelled call) kills what is left and
        # removes the cgroup and the directory, and closes every descriptor: a long run of code rewards must not
        # pile up processes, cgroups, temporary files or descriptors.
        if proc is not None:
            if proc.returncode is None:
                await _kill(proc, cgroup, group=work is not None)
            transport = getattr(proc, "_transport", None)  # its pipes, should a stray process still hold them
            if transport is not None:
                transport.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if cgroup is not None:
            cgroup.remove()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Returns when the process has exited (a pidfd becomes readable), whoever still holds its pipes."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3), or already reaped
        while proc.returncode is None:
            await asyncio.sleep(0.01)
        return
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _reaped(proc: asyncio.subprocess.Process, timeout: float) -> None:
    """Wait (at most ``timeout``) until asyncio has reaped the process and knows its exit status."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.002)


async def _kill(proc: asyncio.subprocess.Process, cgroup: PidsCgroup | None, *, group: bool) -> None:
    """Kill the whole run, then reap it within a bound.

    With bubblewrap, killing its outer process is enough: the sandbox's init dies with it (``--die-with-parent``)
    and the kernel then kills every process of the PID namespace. Without it, the process group (and the cgroup,
    where there is one) is what can be reached; a process that left the group by ``setsid()`` is reached only
    through the cgroup. The pid and group are signalled only while they are known to be this run's (the process
    not reaped yet, or its group still holding members)."""
    if proc.returncode is None:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if cgroup is not None:
        cgroup.kill(timeout=_GRACE)
    await _reaped(proc, _GRACE)


def run_python(code: str, **kwargs) -> SandboxResult:
    """Blocking form of :func:`arun_python` (same arguments). Do not call it from a running event loop."""
    return asyncio.run(arun_python(code, **kwargs))
