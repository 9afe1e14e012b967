"""A pids cgroup per sandboxed run, where the hierarchy is writable: a process budget of its own and a kill list.

A cgroup is the one process limit that holds for root (``RLIMIT_NPROC`` is not enforced for the host's uid 0, user
namespace or not), and it reaches every process of the run whatever it did: a child that called ``setsid()`` or
was re-parented is still a member. Supported: the v1 ``pids`` hierarchy, and a v2 hierarchy whose current cgroup
delegates the ``pids`` controller to its children (``cgroup.subtree_control``). The run's cgroup is created under
the caller's own cgroup (so any limit above still applies), named ``rlblocks-sandbox-<pid>-<n>``; it is removed
after the run, and directories left by a process that died before it could remove them are swept at the next
creation.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

__all__ = ["PidsCgroup"]

_PREFIX = "rlblocks-sandbox-"
_counter = itertools.count()


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, root inside the hierarchy, fstype, super options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    out.append((fields[4].replace("\\040", " "), fields[3], rfields[0], rfields[2]))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under the key ``""`` its v2 path."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for ctl in parts[1].split(",") if parts[1] else [""]:
                        out[ctl] = parts[2]
    except OSError:
        pass
    return out


def _parent_dir() -> tuple[Path, str] | None:
    """The directory to create run cgroups in, and ``"v1"`` or ``"v2"``; None where no writable one exists."""
    own = _own_paths()
    for mnt, root, fstype, opts in _mounts():
        if fstype == "cgroup" and "pids" in opts.split(","):
            rel = own.get("pids")
        elif fstype == "cgroup2":
            rel = own.get("")
        else:
            continue
        if rel is None:
            continue
        if root == "/":
            d = Path(mnt) / rel.lstrip("/")
        elif rel == root or rel.startswith(root + "/"):
            d = Path(mnt) / rel[len(root):].lstrip("/")
        else:  # this process's cgroup is outside what the mount shows
            continue
        if fstype == "cgroup2":
            try:
                if "pids" not in (d / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        if d.is_dir() and os.access(d, os.W_OK):
            return d, "v1" if fstype == "cgroup" else "v2"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PidsCgroup:
    """One run's pids cgroup: ``create()``, the shell prefix that joins it before ``exec``, ``kill()``,
    ``remove()``."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, max_tasks: int) -> PidsCgroup | None:
        """A fresh cgroup limited to ``max_tasks`` tasks (processes and threads), or None where none can be made."""
        found = _parent_dir()
        if found is None:
            return None
        parent, version = found
        cls._sweep(parent)
        path = parent / f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_tasks))
        except OSError:
            try:
                path.rmdir()
            except OSError:
                pass
            return None
        return cls(path, version)

    @staticmethod
    def _sweep(parent: Path) -> None:
        # A run whose process was killed (SIGKILL, OOM) before its cleanup leaves an empty directory behind.
        try:
            entries = list(parent.iterdir())
        except OSError:
            return
        for d in entries:
            if not d.name.startswith(_PREFIX):
                continue
            try:
                owner = int(d.name[len(_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner != os.getpid() and not _alive(owner):
                try:
                    d.rmdir()
                except OSError:
                    pass

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into this cgroup, then ``exec``s it: every process of
        the run starts inside, before any untrusted byte runs."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self, timeout: float = 1.0) -> None:
        """SIGKILL every member until none is left (or ``timeout`` passes); a fork racing the kill is caught by
        the next round, and the pids limit bounds how many there can be."""
        if self.version == "v2":
            try:
                (self.path / "cgroup.kill").write_text("1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the directory (retried briefly: the kernel frees exiting tasks
        asynchronously)."""
        self.kill(timeout=0.2)
        for _ in range(40):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
