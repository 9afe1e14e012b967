"""Killable worker processes for CPU-bound verifiers: a timeout that actually stops the work.

A thread cannot be stopped, and ``signal.alarm`` neither reaches a worker thread nor interrupts long C calls (a
sympy power such as ``10**10**10`` never returns to the interpreter). :class:`ProcessWorkers` therefore runs each
call in a long-lived child process and, when the call overruns its timeout, kills that child (SIGKILL to its process
group) and starts a fresh one for the next call. A child that dies (segfault, ``os._exit``, the OOM killer) is
detected by end-of-file on its pipe and replaced the same way. Nothing is lost: the caller gets
:class:`RewardTimeout`, :class:`WorkerCrashed` or :class:`WorkerError` for that call and every other call goes on.

Design: ``n`` threads, each owning one child; a call is queued on the threads (``concurrent.futures``), so at
most ``n`` calls run at once and the timeout counts from the moment a child starts the call, never the wait in
the queue. Usable from any event loop (:meth:`ProcessWorkers.arun`) or none (:meth:`ProcessWorkers.run`).

The function and its arguments travel by pickle, so the function must be importable by name in a fresh interpreter
(defined at module level of an importable module, as with ``multiprocessing``'s spawn start method). The child
gets this process's ``sys.path`` as ``PYTHONPATH`` and does not re-import the ``__main__`` script. The current
directory that ``python -c`` puts first on a child's ``sys.path`` is removed before anything is imported, so a
worker started from a directory that holds another ``rlblocks`` (a checkout, a stale copy) still imports this
process's; the worker reports the ``rlblocks`` it imported when it starts, and one that differs is refused
(:class:`WorkerCrashed`).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlblocks._checks import check_int, check_optional_int, check_seconds
from rlblocks.errors import ArgumentError, RewardTimeout, WorkerCrashed, WorkerError

__all__ = ["ProcessWorkers"]

_HEADER = struct.Struct(">Q")
# ``python -c`` puts "" (the current directory) first on sys.path: drop it before the first import, so the worker
# imports the rlblocks on this process's sys.path (its PYTHONPATH), not one that happens to sit in the directory
_BOOTSTRAP = ("import sys\nif sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
              "from rlblocks.reward._worker import main\nmain()")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the rlblocks/ package directory
_STDERR_KEEP = 1 << 20  # a worker's stderr file is emptied after a call once it holds more than this


def _same_package(path: object) -> bool:
    """The worker's ``rlblocks`` package directory is this process's."""
    return isinstance(path, str) and os.path.realpath(path) == os.path.realpath(_PACKAGE_DIR)


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def check_importable(fn: object) -> None:
    """Refuse a function a worker could not import: one defined in ``__main__`` (the worker does not re-run the
    caller's script) or a local function / lambda."""
    target = getattr(fn, "func", fn)  # functools.partial
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        raise ArgumentError(
            f"fn: expected a function defined at module level of an importable module (worker processes import it "
            f"by name), got {module}.{qualname}; move it into a module"
        )


class _Child:
    """One worker process and its pipes (owned by one thread at a time)."""

    def __init__(self, proc: subprocess.Popen, stderr_file) -> None:
        self.proc = proc
        self.stderr_file = stderr_file
        self.out_fd = proc.stdout.fileno()
        self.calls = 0

    def send(self, payload: bytes) -> None:
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()

    def recv(self, deadline: float) -> bytes | None:
        """One frame, or None at end of file. Raises ``TimeoutError`` at ``deadline`` (monotonic seconds)."""
        head = self._read(_HEADER.size, deadline)
        if head is None:
            return None
        return self._read(_HEADER.unpack(head)[0], deadline)

    def _read(self, n: int, deadline: float) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.out_fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.out_fd, min(n - len(buf), 1 << 20))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            self.stderr_file.flush()
            self.stderr_file.seek(0, os.SEEK_END)
            size = self.stderr_file.tell()
            self.stderr_file.seek(max(0, size - limit))
            return self.stderr_file.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def trim_stderr(self) -> None:
        # The child writes with O_APPEND, so emptying the file between calls is safe.
        try:
            if os.fstat(self.stderr_file.fileno()).st_size > _STDERR_KEEP:
                os.ftruncate(self.stderr_file.fileno(), 0)
        except (OSError, ValueError):
            pass

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.stderr_file):
            try:
                f.close()
            except (OSError, ValueError, BrokenPipeError):
                pass


def _kill_all(children: set) -> None:
    for child in list(children):
        child.kill()
    children.clear()


class ProcessWorkers:
    """``n`` long-lived worker processes; each call runs in one of them and is killed at its timeout.

    Args:
        n: number of worker processes (= calls running at once).
        memory_bytes: ``RLIMIT_AS`` of each worker (None: unlimited). An allocation beyond it raises
            ``MemoryError`` in the worker, which comes back as :class:`WorkerError`; the worker is replaced.
        preload: modules each worker imports before it reports ready, so their import time is not charged to the
            first call's timeout.
        start_timeout: seconds a new worker may take to import ``preload`` and report ready.
        python: interpreter of the workers (default ``sys.executable``).

    Counters (:meth:`stats`): ``started`` workers, ``calls``, ``timeouts``, ``crashes`` (a worker died during a
    call or failed to start), ``errors`` (the function raised). Call :meth:`close` (or use ``with``) to stop the
    workers; they are also killed when this object is garbage-collected or the interpreter exits, and each worker
    dies with its parent.
    """

    def __init__(
        self,
        n: int,
        *,
        memory_bytes: int | None = None,
        preload: Sequence[str] = (),
        start_timeout: float = 60.0,
        python: str | None = None,
    ) -> None:
        n = check_int("n", n, minimum=1, what="an int >= 1 (worker processes)")
        memory_bytes = check_optional_int("memory_bytes", memory_bytes, minimum=1)
        if isinstance(preload, str) or not all(isinstance(m, str) for m in preload):
            raise ArgumentError(f"preload: expected a sequence of module names, got {preload!r}")
        if python is not None and not isinstance(python, (str, os.PathLike)):
            raise ArgumentError(f"python: expected None or the path of an interpreter, got {type(python).__name__}")
        self.n = n
        self.memory_bytes = memory_bytes
        self.preload = tuple(preload)
        # finite: the deadline ``now + start_timeout`` goes to select(), which cannot wait an infinite time
        self.start_timeout = check_seconds("start_timeout", start_timeout)
        self.python = python or sys.executable
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._children: set[_Child] = set()
        self._closed = False
        self._counts = {"started": 0, "calls": 0, "timeouts": 0, "crashes": 0, "errors": 0}
        self._finalizer = weakref.finalize(self, _kill_all, self._children)

    # ------------------------------------------------------------------ public
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> Any:
        """Blocking: ``fn(*args, **kwargs)`` in a worker; its return value, or the exceptions of this module."""
        return self._submit(fn, args, kwargs, timeout).result()

    async def arun(self, fn: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any) -> Any:
        """Awaitable :meth:`run`. Cancelling it before a worker took the call withdraws the call."""
        return await asyncio.wrap_future(self._submit(fn, args, kwargs, timeout))

    def stats(self) -> dict[str, int]:
        """Counters: ``started``, ``calls``, ``timeouts``, ``crashes``, ``errors``, and ``alive`` workers now."""
        with self._lock:
            out = dict(self._counts)
            out["alive"] = sum(1 for c in self._children if c.proc.poll() is None)
        return out

    def close(self) -> None:
        """Stop every worker (idempotent). Calls still queued are cancelled; a call running now ends as a crash.

        A later call starts fresh workers, so closing a shared instance never leaves it unusable."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        _kill_all(self._children)

    def __enter__(self) -> ProcessWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, fn, args, kwargs, timeout):
        timeout = check_seconds("timeout", timeout)  # finite: timeout=inf overflowed select() in the worker thread
        check_importable(fn)
        # Pickle here, in the caller, so an unpicklable argument is the caller's error, raised at once.
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise ArgumentError(
                f"fn/args: expected a function importable by name and picklable arguments, got {fn!r}: {e}"
            ) from e
        with self._lock:
            if self._executor is None:  # first call, or the first after close(): fresh threads, fresh workers
                self._closed = False
                self._executor = ThreadPoolExecutor(max_workers=self.n, thread_name_prefix="rlblocks-reward-worker")
            return self._executor.submit(self._call, payload, float(timeout))

    def _start(self) -> _Child:
        cfg = json.dumps({"memory_bytes": self.memory_bytes, "preload": list(self.preload)})
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        stderr_file = tempfile.TemporaryFile(prefix="rlblocks-reward-worker-", mode="a+b")
        try:
            proc = subprocess.Popen(
                [self.python, "-c", _BOOTSTRAP, cfg],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr_file, env=env,
                start_new_session=True, close_fds=True,
            )
        except OSError as e:
            stderr_file.close()
            raise WorkerCrashed(f"could not start a worker process ({self.python}): {e}") from e
        child = _Child(proc, stderr_file)
        with self._lock:
            self._children.add(child)
            self._counts["started"] += 1
        try:
            frame = child.recv(time.monotonic() + self.start_timeout)
        except TimeoutError:
            frame = b""
        reply = pickle.loads(frame) if frame else None
        if reply and reply[0] == "ready" and not _same_package(reply[2]):
            self._discard(child)
            self._count("crashes")
            raise WorkerCrashed(f"worker process imported rlblocks from {reply[2]}, this process from "
                                f"{_PACKAGE_DIR}: give the worker this process's sys.path (PYTHONPATH) or python")
        if not reply or reply[0] != "ready":
            detail = reply[3] if reply and reply[0] == "error" else child.stderr_tail()
            self._discard(child)
            self._count("crashes")
            why = "did not report ready" if frame == b"" else f"exited ({_describe_exit(child.proc.returncode)})"
            raise WorkerCrashed(f"worker process {why} within {self.start_timeout:g}s: {detail}")
        return child

    def _discard(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._children.discard(child)
        if getattr(self._local, "child", None) is child:
            self._local.child = None

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def _call(self, payload: bytes, timeout: float) -> Any:  # runs in one of the executor's threads
        child = getattr(self._local, "child", None)
        if child is None or child.proc.poll() is not None:
            if child is not None:
                self._discard(child)
            child = self._local.child = self._start()
        self._count("calls")
        try:
            child.send(payload)
            frame = child.recv(time.monotonic() + timeout)
        except TimeoutError:
            self._discard(child)
            self._count("timeouts")
            raise RewardTimeout(f"no answer within {timeout:g}s; the worker process was killed") from None
        except (BrokenPipeError, ConnectionResetError, OSError, ValueError):
            frame = None
        if frame is None:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            tail = child.stderr_tail()
            rc = child.proc.returncode
            self._discard(child)
            self._count("crashes")
            if self._closed:
                raise WorkerCrashed("ProcessWorkers was closed during the call")
            raise WorkerCrashed(f"worker process died during the call ({_describe_exit(rc)})"
                                + (f": {tail}" if tail else ""))
        child.calls += 1
        child.trim_stderr()
        try:
            reply = pickle.loads(frame)
        except Exception as e:  # e.g. the result's class is not importable here
            self._count("errors")
            raise WorkerError(f"the result could not be unpickled: {type(e).__name__}: {e}") from e
        if reply[0] == "ok":
            return reply[1]
        _, name, message, tb = reply
        self._count("errors")
        if name == "MemoryError":
            self._discard(child)  # a worker that ran out of memory may be left half-initialised: replace it
        raise WorkerError(f"{name}: {message}", remote_type=name, remote_traceback=tb)
