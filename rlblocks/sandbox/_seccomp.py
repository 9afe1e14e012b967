"""The seccomp filter of the sandbox: a small classic-BPF deny list handed to bubblewrap (``--seccomp FD``).

Everything is allowed except the system calls below, which a program checked by a code reward or run by a tool
has no use for and which widen the kernel surface an attacker can reach from inside a user namespace:

- ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``: reading or steering another process;
- ``mount`` and the new mount API, ``umount2``, ``pivot_root``, ``chroot``, ``unshare``, ``setns``, and
  ``clone`` with any ``CLONE_NEW*`` flag: leaving or rebuilding the namespaces (``clone3`` answers ``ENOSYS`` so
  that the C library falls back to ``clone``, whose flags the filter can read; ``clone3`` passes them in memory);
- ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*`` (which also bypasses this filter for the
  operations it queues), ``keyctl``/``add_key``/``request_key``: large kernel interfaces with a history of
  privilege escalations;
- ``kexec_*``, ``init_module``/``finit_module``/``delete_module``, ``reboot``, ``swapon``/``swapoff``, ``acct``,
  ``quotactl``, ``open_by_handle_at``/``name_to_handle_at``, and on x86-64 ``iopl``/``ioperm``: administration;
- ``socket(AF_UNIX, ...)``: no Unix socket can be created, so none on the filesystem can be reached even where a
  bound directory held one (``socketpair`` stays allowed: it connects nothing outside).

A denied call fails with ``EPERM`` (``EACCES`` for ``socket``); a call made through another ABI than the native
one (i386 ``int 0x80`` or x32 on an x86-64 kernel) kills the process, since the numbers above are per ABI.

Why a hand-written filter rather than a library: libseccomp's Python bindings are not published on PyPI as a
maintained wheel, and a ctypes binding needs ``libseccomp.so`` on the host; the program here is a flat deny list
of about 40 instructions, assembled and range-checked below and exercised by the sandbox tests.
"""

from __future__ import annotations

import functools
import platform
import struct

__all__ = ["SUPPORTED", "filter_program"]

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]  (little-endian on both arches)
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000

# (x86_64, aarch64 / asm-generic) numbers, from the kernel's unistd_64.h and asm-generic/unistd.h
_DENY = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "pidfd_getfd": (438, 438),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "reboot": (169, 142), "swapon": (167, 224), "swapoff": (168, 225),
    "acct": (163, 89), "quotactl": (179, 60), "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "iopl": (172, None), "ioperm": (173, None),
}
_CLONE, _CLONE3, _SOCKET = (56, 220), (435, 435), (41, 198)
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NEW_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AF_UNIX = 1
_EPERM, _EACCES, _ENOSYS = 1, 13, 38

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K, _JGE_K, _JSET_K = 0x15, 0x35, 0x45  # BPF_JMP | BPF_JEQ/JGE/JSET | BPF_K
_RET_K = 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000

SUPPORTED = platform.machine() in _AUDIT_ARCH
"""Whether this machine's architecture has a filter (x86-64 and AArch64)."""


def _assemble(program: list[tuple]) -> bytes:
    """``program``: instructions ``(code, k)``, jumps ``(code, k, "label_true", "label_false")`` (``None``: the next
    instruction) and labels ``("label",)``; returns packed ``struct sock_filter`` entries."""
    labels: dict[str, int] = {}
    insns: list[tuple] = []
    for item in program:
        if len(item) == 1:
            labels[item[0]] = len(insns)
        else:
            insns.append(item)
    out = bytearray()
    for pc, ins in enumerate(insns):
        code, k = ins[0], ins[1]
        jt = jf = 0
        if len(ins) == 4:
            offsets = []
            for target in ins[2:]:
                off = 0 if target is None else labels[target] - pc - 1
                if not 0 <= off <= 255:  # classic BPF jumps forward only, by at most 255 instructions
                    raise AssertionError(f"seccomp jump out of range: {off}")
                offsets.append(off)
            jt, jf = offsets
        out += struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)
    return bytes(out)


@functools.lru_cache(maxsize=4)
def filter_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one) as raw ``struct sock_filter`` bytes, the format bubblewrap's
    ``--seccomp FD`` reads. Raises ``ValueError`` for an architecture without a filter."""
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for architecture {machine!r} (have {sorted(_AUDIT_ARCH)})")
    col = 0 if machine == "x86_64" else 1
    prog: list[tuple] = [
        (_LD_W_ABS, _OFF_ARCH),
        (_JEQ_K, _AUDIT_ARCH[machine], None, "kill"),
        (_LD_W_ABS, _OFF_NR),
    ]
    if machine == "x86_64":
        prog.append((_JGE_K, _X32_SYSCALL_BIT, "kill", None))
    for nrs in _DENY.values():
        if nrs[col] is not None:
            prog.append((_JEQ_K, nrs[col], "eperm", None))
    prog += [
        (_JEQ_K, _CLONE3[col], "enosys", None),
        (_JEQ_K, _CLONE[col], "clone", None),
        (_JEQ_K, _SOCKET[col], "socket", None),
        (_RET_K, _RET_ALLOW),
        ("clone",),
        (_LD_W_ABS, _OFF_ARG0),  # the flags (low 32 bits) on both arches
        (_JSET_K, _CLONE_NEW_MASK, "eperm", None),
        (_RET_K, _RET_ALLOW),
        ("socket",),
        (_LD_W_ABS, _OFF_ARG0),  # the address family
        (_JEQ_K, _AF_UNIX, "eacces", None),
        (_RET_K, _RET_ALLOW),
        ("eperm",), (_RET_K, _RET_ERRNO | _EPERM),
        ("eacces",), (_RET_K, _RET_ERRNO | _EACCES),
        ("enosys",), (_RET_K, _RET_ERRNO | _ENOSYS),
        ("kill",), (_RET_K, _RET_KILL_PROCESS),
    ]
    return _assemble(prog)
