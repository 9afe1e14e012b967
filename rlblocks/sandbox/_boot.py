"""The first code the sandboxed interpreter runs: ``python -I -S -B -c <this file's text> <config JSON>``.

It runs single-threaded, before any untrusted byte is read, and imports only the standard library (rlblocks
itself is not visible inside the sandbox). In order it

1. checks the kernel layers the host asked for (PID, user and network namespaces, seccomp, a read-only root, a
   size-limited scratch directory, no capabilities) and reports what it found on the status pipe; a missing
   required layer stops it here, before the program is even read;
2. sets the rlimits;
3. with checks, forks: the parent becomes the **checker**, the child the **program's process**;
4. installs the audit hooks (PEP 578, they cannot be removed from Python) and runs the program.

**Checks run where the program is not.** The checker reads the checks only after the fork and makes itself
non-dumpable; it runs them against proxies of the program's top-level names, each use of a proxy one request over a
pipe answered with plain data, so no ``__eq__`` of the program runs there; the verdict goes on a status pipe the
program's process closed at the fork. The protocol in full: ``docs/sandbox.md`` (Checks).

One file: the host passes this file's text to ``python -c`` inside the sandbox, where rlblocks cannot be imported,
so everything that runs there before and around the program (layer checks, rlimits, the checker and its proxies,
the audit hooks) must be this one self-contained source.
"""


def _site(os, sys):
    """What ``site`` does at start-up (the interpreter runs with ``-S``), except running the import lines of
    ``.pth`` files and ``sitecustomize``: they configure the host's environment (an editable install's import
    finder, for one, pulls in pathlib, re and urllib at every start) and are no part of the program's."""
    import site

    def addpackage(sitedir, name, known_paths, _site=site):
        try:
            with open(os.path.join(sitedir, name), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError):
            return known_paths
        for line in lines:
            line = line.rstrip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            path, case = _site.makepath(sitedir, line)
            if known_paths is not None and case not in known_paths and os.path.exists(path):
                sys.path.append(path)
                known_paths.add(case)
        return known_paths

    site.addpackage = addpackage
    site.execsitecustomize = site.execusercustomize = lambda: None
    site.main()


def _main():
    import os
    import sys

    _site(os, sys)
    import json
    import resource
    import stat

    cfg = json.loads(sys.argv[1])
    with_checks = cfg["secret_fd"] >= 0
    root = os.path.realpath(os.getcwd())
    lim = cfg["limits"]
    strict_layers = cfg["bwrap"]

    # -- 2. what is really in force ------------------------------------------------------------------------------
    def read(path):
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    proc_status = dict(line.split(":\t", 1) for line in read("/proc/self/status").splitlines() if ":\t" in line)
    status = {"mode": cfg["mode"], "tool": cfg["tool"], "audit_hook": "on"}
    found = {}
    if strict_layers:
        uid_map = read("/proc/self/uid_map").split()
        found["user_namespace"] = len(uid_map) >= 3 and uid_map[:3] != ["0", "0", "4294967295"]
        # (the map names the parent namespace's ids, and --disable-userns nests one namespace more: the host's
        # uid is what the host says it is, bubblewrap not being setuid)
        host_uid = cfg["host_uid"]
        found["pid_namespace"] = os.getpid() == 2  # bubblewrap's init is 1, the program 2
        found["seccomp"] = proc_status.get("Seccomp", "").strip() == "2"
        found["no_capabilities"] = all(int(proc_status.get(k, "1"), 16) == 0 for k in ("CapEff", "CapPrm", "CapBnd"))
        found["no_new_privs"] = proc_status.get("NoNewPrivs", "").strip() == "1"
        found["read_only_root"] = bool(os.statvfs("/").f_flag & os.ST_RDONLY)
        vfs = os.statvfs(root)
        scratch_bytes = vfs.f_blocks * vfs.f_frsize
        found["scratch_limit"] = 0 < scratch_bytes <= lim["disk_bytes"] + 65536
        ifaces = {line.split(":")[0].strip() for line in read("/proc/net/dev").splitlines()[2:]}
        found["network_namespace"] = cfg["allow_network"] or ifaces == {"lo"}
    else:
        host_uid = os.getuid()
    if strict_layers and host_uid != 0:
        # In a fresh user namespace the kernel (5.14+) counts RLIMIT_NPROC per namespace, so this is the
        # sandbox's own budget; for the host's uid 0 the limit is not enforced at all, hence the cgroup.
        nproc = lim["max_processes"] + 1 + with_checks  # + bubblewrap's init (+ the checker)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2] if x.isdigit())
        found["process_limit"] = cfg["cgroup"] or kernel >= (5, 14)
        processes = "cgroup" if cfg["cgroup"] else "rlimit-userns"
    else:
        found["process_limit"] = cfg["cgroup"]
        processes = "cgroup" if cfg["cgroup"] else ("audit" if not cfg["allow_subprocesses"] else "none")
    if strict_layers:
        status.update({
            "namespaces": "user,pid,mount,ipc,uts" + ("" if cfg["allow_network"] else ",net"),
            "seccomp": "filter" if found["seccomp"] else "none",
            "capabilities": "none" if found["no_capabilities"] else "some",
            "network": "host" if cfg["allow_network"] else ("namespace" if found["network_namespace"] else "audit"),
            "files": "read-only-root" if found["read_only_root"] else "audit",
            "disk": f"tmpfs {scratch_bytes}" if found["scratch_limit"] else "none",
            "proc": "private" if found["pid_namespace"] else "host",
        })
    else:
        status.update({"namespaces": "none", "seccomp": "none", "capabilities": "kept",
                       "network": "host" if cfg["allow_network"] else "audit", "files": "audit",
                       "disk": "audit (file count, size polled)", "proc": "host (audit)"})
    status["processes"] = processes
    missing = sorted(k for k in cfg["require"] if not found.get(k, False))
    status["missing"] = missing
    os.write(cfg["status_fd"], json.dumps(status).encode() + b"\n")
    if not with_checks:
        os.close(cfg["status_fd"])
    if missing:
        os.write(2, f"rlblocks sandbox: refusing to run: layers not in force: {', '.join(missing)}\n".encode())
        os._exit(97)

    # -- 3. rlimits ----------------------------------------------------------------------------------------------
    cpu = max(1, int(-(-lim["cpu_seconds"] // 1)))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))

    # -- 4. with checks, the checker and the program's process ---------------------------------------------------
    chan = None
    if with_checks:
        req_r, req_w = os.pipe()  # checker -> program: requests
        resp_r, resp_w = os.pipe()  # program -> checker: replies
        pid = os.fork()
        if pid:
            for fd in (req_r, resp_w):
                os.close(fd)
            _checker(os, sys, json, cfg, pid, req_w, resp_r)  # never returns
        for fd in (cfg["secret_fd"], cfg["status_fd"], req_w, resp_r):  # first: this process never reads them
            os.close(fd)
        chan = (req_r, resp_w, _message_cap(cfg))

    # -- 5. the program ------------------------------------------------------------------------------------------
    program = cfg["program"]
    with open(program, "rb") as f:
        src = f.read()
    _install_policy(sys, os, stat, cfg, root, checks=with_checks)
    sys.argv = [program, *cfg["args"]]
    code = compile(src, program, "exec", dont_inherit=True)
    import types

    main = types.ModuleType("__main__")
    main.__file__ = program
    sys.modules["__main__"] = main
    return code, main.__dict__, chan


def _install_policy(sys, os, stat, cfg, root, checks):
    """The policy hook: refuses what the layers below do not cover, or what only Python can see.

    Every name the hook and its helpers use is bound as a default argument and the functions refuse to have
    their attributes set, so a program that replaces a builtin or a module attribute, or that reaches this
    hook's frame through the traceback of a refusal, cannot change its decisions. It calls no code the program
    wrote, except ``os.fspath`` on a path object that is not a str or bytes."""
    import importlib._bootstrap_external as ibe
    import time

    allow_proc, allow_net = cfg["allow_subprocesses"], cfg["allow_network"]
    weak = not cfg["bwrap"]
    # The interpreter's prefixes, bound read-only (strict mode): a venv that lives below the scratch mount point on the
    # host (e.g. under /tmp) is still the host's, and the program cannot write into it.
    ro_prefixes = tuple(cfg.get("ro_prefixes", ()))
    blocked_imports = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_testcapi", "_testinternalcapi",
                       "_xxsubinterpreters", "_xxinterpchannels"}
    if not allow_proc:
        blocked_imports.add("_posixsubprocess")
    proc_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                   "subprocess.Popen"}
    # (argument indices written, indices created); a link's source is written to through the new name
    fs_events = {"os.remove": ((0,), ()), "os.rmdir": ((0,), ()), "os.mkdir": ((0,), (0,)),
                 "os.rename": ((0, 1), (1,)), "os.link": ((0, 1), (1,)), "os.chmod": ((0,), ()),
                 "os.chown": ((0,), ()), "os.truncate": ((0,), ()), "os.utime": ((0,), ()),
                 "os.mkfifo": ((0,), (0,)), "os.mknod": ((0,), (0,)), "os.chflags": ((0,), ()),
                 "os.lchflags": ((0,), ()), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
                 "shutil.rmtree": ((0,), ()), "shutil.copyfile": ((1,), (1,)), "shutil.copytree": ((1,), (1,)),
                 "shutil.move": ((0, 1), (1,)), "shutil.copymode": ((1,), ()), "shutil.copystat": ((1,), ())}
    refused = {"sys.addaudithook", "code.__new__", "marshal.load"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    counters = [0]  # files created (weak mode)
    scratch_prefix = root.rstrip("/") + "/"

    def _resolve(p, _lstat=os.lstat, _readlink=os.readlink, _islnk=stat.S_ISLNK, _getcwd=os.getcwd,
                 _OSError=OSError):
        """``p`` (a str) as an absolute path with every symlink followed, by C functions only."""
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        todo = p.split("/")
        todo.reverse()
        done = []
        links = 0
        while todo:
            c = todo.pop()
            if c == "" or c == ".":
                continue
            if c == "..":
                if done:
                    done.pop()
                continue
            cand = "/" + "/".join([*done, c])
            try:
                is_link = _islnk(_lstat(cand).st_mode) and links <= 40
                t = _readlink(cand) if is_link else ""
            except _OSError:
                is_link = False
            if not is_link or (not t.startswith("/") and ":" in t and "/" not in t):  # pipe:[12], socket:[..]
                done.append(c)
                continue
            links += 1
            if t.startswith("/"):
                done = []
            more = t.split("/")
            more.reverse()
            todo.extend(more)
        return "/" + "/".join(done)

    def _as_str(p, _type=type, _str=str, _bytes=bytes, _fspath=os.fspath, _PE=PermissionError):
        t = _type(p)
        if t is not _str and t is not _bytes:
            p = _fspath(p)
            t = _type(p)
        if t is _bytes:
            return _bytes.decode(p, "utf-8", "surrogateescape")
        if t is _str:
            return p
        raise _PE(f"sandbox: a path must be str or bytes, got {t.__name__}")

    def _is_dir(real, _stat=os.stat, _isdir=stat.S_ISDIR, _OSError=OSError):
        try:
            return _isdir(_stat(real).st_mode)
        except _OSError:
            return False

    def _check_proc(real, _weak=weak, _others=weak or checks, _getpid=os.getpid, _int=int, _len=len,
                    _is_dir=_is_dir, _PE=PermissionError,
                    _host_ok=frozenset({"cpuinfo", "meminfo", "stat", "uptime", "loadavg", "version"})):
        parts = real.split("/")  # ["", "proc", ...]
        if _len(parts) < 3 or parts[2] == "":
            raise _PE("sandbox: opening /proc itself is not allowed")
        if "mem" in parts or "pagemap" in parts or "map_files" in parts:
            raise _PE(f"sandbox: reading process memory is not allowed: {real!r}")
        if parts[2].isdigit():
            if _others and _int(parts[2]) != _getpid():  # the host's processes, or the checker
                raise _PE(f"sandbox: another process's /proc entry is not visible: {real!r}")
        elif _weak and not (_len(parts) == 3 and parts[2] in _host_ok):
            raise _PE(f"sandbox: the host's {real!r} is not visible")
        if _is_dir(real):
            raise _PE(f"sandbox: opening a directory under /proc is not allowed: {real!r}")

    def _check_path(p, writing, creating, _root=root, _prefix=scratch_prefix, _weak=weak, _type=type, _int=int,
                    _as_str=_as_str, _resolve=_resolve, _is_dir=_is_dir, _check_proc=_check_proc, _stat=os.stat,
                    _counters=counters, _max_created=cfg["max_created_files"], _OSError=OSError,
                    _PE=PermissionError):
        if _type(p) is _int:  # an open descriptor: it was checked when it was opened
            return
        p = _as_str(p)
        if not p.startswith("/") and ".." in p.split("/"):
            # the kernel may resolve it from a directory descriptor this hook cannot see
            raise _PE(f"sandbox: a relative path with '..' is not allowed: {p!r}")
        real = _resolve(p)
        if real == _root or real.startswith(_prefix):
            if real.endswith(".pyc"):  # bytecode written by the program would be unmarshalled unchecked
                raise _PE(f"sandbox: bytecode files in the sandbox directory are not used: {p!r}")
            if creating and _weak:
                try:
                    _stat(real)
                except _OSError:
                    _counters[0] += 1
                    if _counters[0] > _max_created:
                        raise _PE(f"sandbox: more than {_max_created} files created") from None
            return
        if writing:
            raise _PE(f"sandbox: writing outside the sandbox directory is not allowed: {p!r}")
        if real == "/proc" or real.startswith("/proc/"):
            _check_proc(real)
        elif _is_dir(real):
            # a directory descriptor would let a later relative path escape every check above
            raise _PE(f"sandbox: opening a directory outside the sandbox directory is not allowed: {p!r}")

    def _check_marshal(data, _getframe=sys._getframe, _cb=ibe._compile_bytecode.__code__, _type=type,
                       _str=str, _bytes=bytes, _mv=memoryview, _resolve=_resolve, _root=root,
                       _prefix=scratch_prefix, _open=os.open, _read=os.read, _close=os.close, _fstat=os.fstat,
                       _len=len, _PE=PermissionError, _OSError=OSError):
        # Crafted code objects read and write arbitrary memory. The import system unmarshals .pyc files; allow
        # exactly that: the caller is importlib's _compile_bytecode and the bytes are those of a .pyc file
        # outside the sandbox directory (read again here and compared).
        f = _getframe(2)  # 0: this helper, 1: the hook, 2: the caller of marshal.loads
        if f.f_code is not _cb:
            raise _PE("sandbox: marshal.loads is not allowed outside the import system")
        path = f.f_locals.get("bytecode_path")
        if _type(data) is _mv:
            if _type(data.obj) is not _bytes:
                raise _PE("sandbox: marshal.loads of a mutable buffer is not allowed")
            data = _bytes(data)
        if _type(data) is not _bytes or _type(path) is not _str:
            raise _PE("sandbox: marshal.loads is not allowed here")
        real = _resolve(path)
        if real == _root or real.startswith(_prefix):
            raise _PE("sandbox: bytecode from the sandbox directory is not used")
        try:
            fd = _open(real, 0)
            try:
                want = _fstat(fd).st_size
                blob = b""
                while _len(blob) < want:
                    chunk = _read(fd, want - _len(blob))
                    if not chunk:
                        break
                    blob += chunk
            finally:
                _close(fd)
        except _OSError:
            raise _PE("sandbox: marshal.loads of bytes that are not a .pyc file") from None
        if blob[16:] != data:
            raise _PE("sandbox: marshal.loads of bytes that are not the named .pyc file")

    def _policy(event, args, _allow_proc=allow_proc, _allow_net=allow_net, _weak=weak, _root=root, _ro=ro_prefixes,
                _prefix=scratch_prefix, _proc_events=frozenset(proc_events), _fs_events=fs_events,
                _blocked=frozenset(blocked_imports), _refused=frozenset(refused), _wflags=write_flags,
                _check_path=_check_path, _check_marshal=_check_marshal, _resolve=_resolve, _as_str=_as_str,
                _ours=None, _type=type, _int=int, _str=str, _len=len, _bool=bool, _PE=PermissionError,
                _IE=ImportError, _OSError=OSError, _getpgid=os.getpgid, _getpgrp=os.getpgrp, _getpid=os.getpid):
        if event == "open":
            path, mode, flags = args
            if _type(flags) is _int and flags >= 0:
                writing, creating = _bool(flags & _wflags), _bool(flags & 0o100)  # O_CREAT
            else:
                writing = _type(mode) is _str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
                creating = writing and ("w" in mode or "a" in mode or "x" in mode)
            if path is not None:
                _check_path(path, writing, creating)
        elif event in _fs_events:
            written, created = _fs_events[event]
            for i in written:
                if i < _len(args) and args[i] is not None:
                    _check_path(args[i], True, i in created)
        elif event == "os.symlink":
            target = _as_str(args[0])
            _check_path(args[1], True, True)
            if ".." in target.split("/") or (target.startswith("/") and not (target == _root
                                                                               or target.startswith(_prefix))):
                raise _PE(f"sandbox: a symlink may only point inside the sandbox directory: {target!r}")
        elif event in _proc_events:
            if not _allow_proc:
                raise _PE(f"sandbox: {event} is not allowed (no subprocesses)")
        elif event.startswith("socket."):
            if not _allow_net:
                raise _PE(f"sandbox: {event} is not allowed (no network)")
        elif event == "import":
            if args[0] in _blocked:
                raise _IE(f"sandbox: importing {args[0]} is not allowed")
            if _type(args[1]) is _str:  # a native extension (source modules come with None)
                real = _resolve(args[1])
                if (real == _root or real.startswith(_prefix)) and not real.startswith(_ro):
                    raise _IE(f"sandbox: loading a native extension from the sandbox directory is not allowed: "
                              f"{args[1]!r}")
        elif event in _refused or event.startswith("ctypes."):
            raise _PE(f"sandbox: {event} is not allowed")
        elif event == "marshal.loads":
            _check_marshal(args[0])
        elif event == "object.__setattr__" or event == "object.__delattr__":
            for o in _ours:
                if o is args[0]:
                    raise _PE(f"sandbox: changing the sandbox's own functions ({args[1]}) is not allowed")
        elif _weak and (event == "os.kill" or event == "os.killpg"):
            target = args[0]
            if _type(target) is not _int:
                raise _PE(f"sandbox: {event} of {target!r} is not allowed")
            if event == "os.kill" and target > 0:
                if target != _getpid():
                    try:
                        same = _getpgid(target) == _getpgrp()
                    except _OSError:
                        same = False
                    if not same:
                        raise _PE(f"sandbox: signalling process {target} is not allowed")
            else:
                group = target if event == "os.killpg" else -target
                if group not in (0, _getpgrp()):
                    raise _PE(f"sandbox: signalling process group {group} is not allowed")

    ours = (_policy, _resolve, _as_str, _is_dir, _check_proc, _check_path, _check_marshal)
    defaults = list(_policy.__defaults__)
    defaults[list(_policy.__code__.co_varnames[2:]).index("_ours")] = ours
    _policy.__defaults__ = tuple(defaults)

    if weak:
        # No PID namespace: keep the program away from its parent (pidfds have no audit event), and stop it if
        # the parent dies or the wall clock passes without the parent's kill arriving.
        import _thread
        import signal

        for mod in (os, sys.modules.get("posix")):
            if mod is not None and hasattr(mod, "pidfd_open"):
                delattr(mod, "pidfd_open")
        if hasattr(signal, "pidfd_send_signal"):
            del signal.pidfd_send_signal
        ppid, deadline = os.getppid(), time.monotonic() + cfg["limits"]["wall_seconds"] + 2.0

        def _watch(_sleep=time.sleep, _mono=time.monotonic, _getppid=os.getppid, _killpg=os.killpg,
                   _getpgrp=os.getpgrp, _exit=os._exit):
            while _getppid() == ppid and _mono() < deadline:
                _sleep(0.25)
            try:
                _killpg(_getpgrp(), 9)
            finally:
                _exit(137)

        _thread.start_new_thread(_watch, ())
    sys.addaudithook(_policy)


# -- the channel between the checker and the program's process ------------------------------------------------
# A message is 4 bytes of length (big-endian) and that many bytes of JSON. Values travel as plain JSON (None, bool,
# int, float, str, list) or as {"$": tag, "v": ...} for the other built-in types; {"$": "ref", "id": n} names an
# object that stays in the program's process.

_BIG_BITS = 8192  # larger ints travel as hex: JSON ints are read from decimal digits, whose length Python caps
_DEPTH = 100  # nesting of one value
_OPS = ("call", "getattr", "getitem", "len", "bool", "iter", "next", "repr", "str")
_VIEWS = {type({}.keys()): "dict_keys", type({}.values()): "dict_values", type({}.items()): "dict_items"}


class _TooBig(Exception):
    """A value larger than the budget it was encoded with."""


class _ProgramGone(BaseException):
    """The program's process no longer answers (it ended, or broke the channel). A BaseException, so that no
    ``except Exception`` of the checks can hide it; the checks fail whatever they do with it."""


def _message_cap(cfg):
    """The longest message either side reads: a quarter of the memory limit (at least 1 MiB)."""
    return max(1 << 20, cfg["limits"]["memory_bytes"] // 4)


def _dumps(json, obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def _send(os, fd, data):
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(os, fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(os, json, fd, cap):
    """The next message; None at the end of the stream. ValueError for a message longer than ``cap`` bytes or
    one that is not JSON."""
    head = _read_exact(os, fd, 4)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > cap:
        raise ValueError(f"a message of {n} bytes, more than the {cap} read")
    body = _read_exact(os, fd, n)
    return None if body is None else json.loads(body)


def _encode(x, ref, budget, depth=0):
    """``x`` as JSON-able data; ``ref(x)`` stands for what is not plain data. Subclasses of built-in types are
    encoded as their base type (a namedtuple as a tuple, a Counter as a dict), numpy scalars as Python numbers.
    ``budget``: ``[nodes left]``, or None for no limit (:class:`_TooBig` when spent)."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooBig
    if depth > _DEPTH:
        raise ValueError(f"a value nested more than {_DEPTH} levels deep cannot be sent")
    t = type(x)
    if x is None or t is bool or t is str or t is float:
        return x
    if t is int:
        return x if x.bit_length() <= _BIG_BITS else {"$": "int", "v": hex(x)}
    d = depth + 1
    if t is list:
        return [_encode(e, ref, budget, d) for e in x]
    if t is tuple or t is set or t is frozenset:
        return {"$": t.__name__, "v": [_encode(e, ref, budget, d) for e in x]}
    if t is dict:
        return {"$": "dict", "v": [[_encode(k, ref, budget, d), _encode(v, ref, budget, d)] for k, v in x.items()]}
    if t is bytes or t is bytearray:
        return {"$": t.__name__, "v": x.hex()}
    if t is complex:
        return {"$": "complex", "v": [x.real, x.imag]}
    if t is slice or t is range:
        return {"$": t.__name__, "v": [_encode(e, ref, budget, d) for e in (x.start, x.stop, x.step)]}
    if t in _VIEWS:
        return {"$": _VIEWS[t], "v": [_encode(e, ref, budget, d) for e in x]}
    try:
        kind, base = _as_builtin(x, t)
    except Exception:  # (code of the value's own type failed: it stays where it is)
        kind = None
    if kind is None:
        return ref(x)
    if kind == "tagged":
        if base["$"] != "decimal":
            base["v"] = _encode(base["v"], ref, budget, d)
        return base
    return _encode(base, ref, budget, depth)


def _as_builtin(x, t):
    """``("value", v)``: a value of a subclass of a built-in type as that type (by the base type's own methods),
    a numpy scalar as a Python number; ``("tagged", {"$": ...})``: a fraction, a decimal or a numpy array;
    ``(None, None)``: anything else."""
    import sys

    for base in (int, float, str, complex, list, tuple, dict, set, frozenset, bytes, bytearray):
        if issubclass(t, base):
            if base is int:
                return "value", int.__int__(x)
            if base is float:
                return "value", float.__float__(x)
            if base is str:
                return "value", str.__str__(x)
            if base is complex:
                return "value", complex(float(x.real), float(x.imag))
            if base is dict:
                return "value", dict(dict.items(x))
            if base is bytes or base is bytearray:
                return "value", base(x)
            return "value", base(base.__iter__(x))
    mod, name = getattr(t, "__module__", None), getattr(t, "__qualname__", None)
    if mod == "fractions" and name == "Fraction":
        return "tagged", {"$": "fraction", "v": [int.__int__(x.numerator), int.__int__(x.denominator)]}
    if mod == "decimal" and name == "Decimal":
        return "tagged", {"$": "decimal", "v": str.__str__(str(x))}
    np = sys.modules.get("numpy")
    if np is not None and issubclass(t, np.generic):
        return "value", x.item()
    if np is not None and t is np.ndarray and x.dtype.kind in "biufcUS":
        return "tagged", {"$": "ndarray", "dtype": str.__str__(str(x.dtype.str)), "shape": [int(n) for n in x.shape],
                          "v": x.tolist()}
    return None, None


def _decode(j, deref, depth=0):
    """The built-in value of the JSON ``j`` (its references through ``deref``); ValueError for what no encoder
    writes. Only built-in types are constructed: no code of the other side runs here."""
    t = type(j)
    if j is None or t is bool or t is int or t is float or t is str:
        return j
    if depth > _DEPTH + 2:
        raise ValueError("a value nested too deeply")
    d = depth + 1
    if t is list:
        return [_decode(e, deref, d) for e in j]
    if t is not dict:
        raise ValueError(f"not a value: {t.__name__}")
    tag, v = j.get("$"), j.get("v")
    if tag == "ref":
        return deref(j)
    if tag in ("tuple", "set", "frozenset"):
        if type(v) is not list:
            raise ValueError(f"{tag}: expected a list")
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](_decode(e, deref, d) for e in v)
    if tag == "dict":
        if type(v) is not list or any(type(kv) is not list or len(kv) != 2 for kv in v):
            raise ValueError("dict: expected a list of pairs")
        return {_decode(k, deref, d): _decode(w, deref, d) for k, w in v}
    if tag in ("slice", "range", "dict_keys", "dict_values", "dict_items"):
        if type(v) is not list:
            raise ValueError(f"{tag}: expected a list")
        items = [_decode(e, deref, d) for e in v]
        if tag == "slice" or tag == "range":
            if len(items) != 3 or (tag == "range" and any(type(e) is not int for e in items)):
                raise ValueError(f"{tag}: expected start, stop and step")
            return slice(*items) if tag == "slice" else range(*items)
        if tag == "dict_keys":  # (views of a fresh dict: ordered, set-like, as the program's were)
            return dict.fromkeys(items).keys()
        if tag == "dict_values":
            return dict(enumerate(items)).values()
        if any(type(kv) is not tuple or len(kv) != 2 for kv in items):
            raise ValueError("dict_items: expected pairs")
        return dict(items).items()
    if tag in ("bytes", "bytearray", "int", "decimal") and type(v) is not str:
        raise ValueError(f"{tag}: expected a str")
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "bytearray":
        return bytearray.fromhex(v)
    if tag == "int":
        return int(v, 16)
    if tag == "decimal":
        from decimal import Decimal

        return Decimal(v)
    if tag == "complex" or tag == "fraction":
        kinds = (int, float) if tag == "complex" else (int,)
        if type(v) is not list or len(v) != 2:
            raise ValueError(f"{tag}: expected two numbers")
        a, b = (_decode(e, deref, d) for e in v)
        if type(a) not in kinds or type(b) not in kinds:
            raise ValueError(f"{tag}: expected two numbers")
        if tag == "complex":
            return complex(a, b)
        from fractions import Fraction

        return Fraction(a, b)
    if tag == "ndarray":
        value = _decode(v, deref, d)
        try:
            import numpy
        except ImportError:  # the checks cannot use numpy either: the nested lists
            return value
        shape = j.get("shape")
        if type(shape) is not list or any(type(n) is not int for n in shape) or type(j.get("dtype")) is not str:
            raise ValueError("ndarray: expected a shape and a dtype")
        return numpy.array(value, dtype=numpy.dtype(j["dtype"])).reshape(shape)
    raise ValueError(f"unknown tag {tag!r}")


def _exception(err):
    """The checker's exception for the program's ``[type name, message]``: the built-in exception of that name
    (so that ``except ValueError`` in the checks works), else an ``Exception`` naming it."""
    import builtins

    name, msg = [*err, "", ""][:2] if type(err) is list else ("", "")
    name, msg = str(name)[:200], str(msg)[:2000]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(msg)
        except Exception:
            pass
    return Exception(f"{name}: {msg}" if name else msg)


class _Remote:
    """An object that stays in the program's process, seen from the checks: calling it, reading an attribute or
    an item, ``len``, ``bool``, iterating, ``repr`` and ``str`` are requests answered by the program. Equality,
    hashing and ordering are the checker's own (identity): the program never sees a value it is compared with,
    and no ``__eq__`` of its own decides a comparison."""

    __slots__ = ("__weakref__", "_rid", "_rtype")
    _link = None
    _NAMES = frozenset({"__name__", "__qualname__", "__doc__", "__module__"})

    def __init__(self, rid, rtype):
        self._rid = rid
        self._rtype = rtype

    def _ask(self, op, **kw):
        return _Remote._link.ask({"op": op, "ref": self._rid, **kw})

    def __call__(self, *args, **kwargs):
        return _Remote._link.call(self._rid, args, kwargs)

    def __getattr__(self, name):
        if name in _Remote.__slots__:  # (a copy made without __init__: no id to ask with)
            raise AttributeError(name)
        if name.startswith("__") and name.endswith("__") and name not in _Remote._NAMES:
            raise AttributeError(name)  # protocol probes (copy, numpy, ...) stay here
        return self._ask("getattr", name=name)

    def __getitem__(self, key):
        return self._ask("getitem", key=_Remote._link.encode(key))

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool")

    def __iter__(self):
        return self._ask("iter")

    def __next__(self):
        return self._ask("next")

    def __repr__(self):
        return self._text("repr")

    def __str__(self):
        return self._text("str")

    def _text(self, op):
        try:
            text = self._ask(op)
        except BaseException:
            text = None
        return text if type(text) is str else f"<{self._rtype} object of the program>"


class _Link:
    """The checker's end of the channel."""

    _MUTABLE = (list, dict, set, bytearray)

    def __init__(self, os, json, sys, wfd, rfd, cap):
        self.os, self.json, self.sys, self.wfd, self.rfd, self.cap = os, json, sys, wfd, rfd, cap
        self.dead = None  # why the program can no longer answer
        self.proxies = {}

    def _proxy(self, j):
        rid = j.get("id")
        if type(rid) is not int:
            raise ValueError("ref: expected an int id")
        if rid not in self.proxies:
            self.proxies[rid] = _Remote(rid, str(j.get("t", "?"))[:100])
        return self.proxies[rid]

    def encode(self, value):
        def ref(x):
            if type(x) is _Remote:
                return {"$": "ref", "id": x._rid}
            raise TypeError(f"a {type(x).__name__} cannot be passed to the program (only built-in values and "
                            f"the program's own objects can)")

        return _encode(value, ref, None)

    def exchange(self, msg):
        """Send ``msg``, return the program's reply (a dict); :class:`_ProgramGone` when there is none."""
        if self.dead is not None:
            raise _ProgramGone(self.dead)
        _flush(self.sys)  # the checks' output before the program's next output
        try:
            _send(self.os, self.wfd, _dumps(self.json, msg))
            reply = _recv(self.os, self.json, self.rfd, self.cap)
            if reply is None:
                self.dead = "ended"
            elif type(reply) is not dict:
                raise ValueError("a reply that is not an object")
        except OSError:
            self.dead = "ended"
        except Exception as e:
            self.dead = f"the program's process broke the checker's channel ({type(e).__name__}: {e})"
        if self.dead is not None:
            raise _ProgramGone(self.dead)
        return reply

    def value(self, reply, key="ok"):
        try:
            return _decode(reply.get(key), self._proxy)
        except Exception as e:
            self.dead = f"the program's process broke the checker's channel ({type(e).__name__}: {e})"
            raise _ProgramGone(self.dead) from None

    def ask(self, msg):
        reply = self.exchange(msg)
        if "err" in reply:
            raise _exception(reply["err"])
        if reply.get("stop") is True:
            raise StopIteration
        return self.value(reply)

    def call(self, rid, args, kwargs):
        back = [i for i, a in enumerate(args) if type(a) in self._MUTABLE]
        back += [k for k, a in kwargs.items() if type(a) in self._MUTABLE]
        reply = self.exchange({"op": "call", "ref": rid, "args": [self.encode(a) for a in args],
                               "kwargs": [[k, self.encode(a)] for k, a in kwargs.items()], "back": back})
        if "err" in reply:
            raise _exception(reply["err"])
        result = self.value(reply)
        after = self.value(reply, "back") if back else []
        if type(after) is not list or len(after) != len(back):
            self.dead = "the program's process broke the checker's channel (arguments not sent back)"
            raise _ProgramGone(self.dead)
        for where, new in zip(back, after):  # the program's in-place changes, onto the checks' own objects
            old = args[where] if type(where) is int else kwargs[where]
            if type(new) is type(old):
                if type(old) is list or type(old) is bytearray:
                    old[:] = new
                else:
                    old.clear()
                    old.update(new)
        return result


def _checker(os, sys, json, cfg, pid, req_w, resp_r):
    """The parent after the fork: reads the checks, runs them against the program's process, writes the verdict
    on the status pipe and exits. Never returns."""
    import builtins
    import time

    try:  # not dumpable: the program's process (same user) cannot read this one's memory or descriptors
        import ctypes

        dumpable = ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0  # PR_SET_DUMPABLE
    except Exception:
        dumpable = True
    data = b""
    while True:
        chunk = os.read(cfg["secret_fd"], 65536)
        if not chunk:
            break
        data += chunk
    os.close(cfg["secret_fd"])
    secret = json.loads(data)
    del data, chunk
    link = _Link(os, json, sys, req_w, resp_r, _message_cap(cfg))
    _Remote._link = link
    passed = False
    try:
        checks = compile("\n\n".join(secret["checks"]) + "\n", "<checks>", "exec", dont_inherit=True)
        ready = link.exchange({"op": "go"}).get("ready")
        if type(ready) is not list:
            link.dead = "the program's process broke the checker's channel (no list of its names)"
            raise _ProgramGone(link.dead)
        ns = {"__name__": "__main__", "__builtins__": builtins}
        for item in ready:
            name = item[0] if type(item) is list and len(item) == 2 else None
            # the program's top-level names, less dunders and built-in names: the checks' builtins are their own
            if type(name) is str and name.isidentifier() and not name.startswith("__") and not hasattr(builtins, name):
                ns[name] = link.value({"ok": item[1]})
        exec(checks, ns)
        passed = link.dead is None
    except _ProgramGone:
        pass
    except BaseException as e:
        sys.__excepthook__(type(e), e, e.__traceback__)
    _flush(sys)
    if link.dead == "ended":  # the program ended (or closed its channel) before the checks did: its exit status
        status, killed = _reap(os, time, pid, 2.0)
    elif link.dead is not None:  # it broke the channel: nothing more of it is run, or shown
        _reap(os, time, pid, 0.0)
    else:
        # The program's process flushed its output before its last reply and has nothing left to do: tell it to
        # end, and end now (the sandbox's teardown, or the host, kills what is left of the run).
        try:
            _send(os, req_w, _dumps(json, {"op": "end"}))
        except OSError:
            pass
    how = "separate process" + ("" if dumpable else ", not dumpable")
    verdict = {"marker": secret["marker"], "checks": "passed" if passed else "failed", "checker": how}
    os.write(cfg["status_fd"], json.dumps(verdict).encode() + b"\n")
    if passed:
        os._exit(0)
    if link.dead not in (None, "ended"):
        os.write(2, f"rlblocks sandbox: {link.dead}\n".encode())
    elif link.dead == "ended" and killed:
        os.write(2, b"rlblocks sandbox: the program's process closed the checker's channel and did not end\n")
    elif link.dead == "ended":
        _end_like(os, status)
    os._exit(1)


def _flush(sys):
    """Flush the standard streams, the current ones and the original ones (a program may have replaced them)."""
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            s.flush()
        except BaseException:
            pass


def _reap(os, time, pid, timeout):
    """Wait for the child ``pid`` (at most ``timeout`` s, then kill it): (wait status, whether it was killed)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            return os.waitpid(pid, 0)[1], True
        time.sleep(0.001)


def _end_like(os, status):
    """Exit the way a process with wait status ``status`` ended: the same exit status, or the same signal."""
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status))


def _serve(code, globals_, req_r, resp_w, cap):
    """The program's process: runs the program when the checker says so, then answers the checker's requests
    until it says the end (or goes). The program may change anything here: nothing here is secret, and every
    answer it could forge is one it could have returned."""
    import json
    import os
    import sys

    def leave(rc):
        # the end of the program: its output flushed, then the process ends at once (no atexit handlers, as
        # when the checks end it)
        _flush(sys)
        if rc is None:
            os._exit(0)
        if isinstance(rc, int):
            os._exit(int.__int__(rc) & 0xFF)
        try:
            os.write(2, f"{rc}\n".encode("utf-8", "replace"))
        except BaseException:
            pass
        os._exit(1)

    def send(obj):
        try:
            data = _dumps(json, obj)
        except BaseException as e:
            data = _dumps(json, {"err": [type(e).__name__, f"the result cannot be sent to the checker: {e}"[:2000]]})
        if len(data) > cap:
            data = _dumps(json, {"err": ["MemoryError", f"the result is {len(data)} bytes of data, more than the "
                                                        f"{cap} the checker reads"]})
        try:
            _send(os, resp_w, data)
        except OSError:  # the checker is gone
            leave(0)

    objs, ids = [], {}

    def ref(x):
        key = id(x)
        if key not in ids:
            ids[key] = len(objs)
            objs.append(x)  # kept alive: its id names it until the end
        try:
            name = str(type(x).__name__)
        except Exception:
            name = "object"
        return {"$": "ref", "id": ids[key], "t": name[:100]}

    def deref(j):
        return objs[j["id"]]

    def answer(msg):
        op, obj = msg["op"], deref({"id": msg["ref"]})
        if op == "call":
            args = [_decode(a, deref) for a in msg["args"]]
            kwargs = {k: _decode(a, deref) for k, a in msg["kwargs"]}
            result = obj(*args, **kwargs)
            out = {"ok": _encode(result, ref, None)}
            if msg["back"]:
                out["back"] = [_encode(args[w] if type(w) is int else kwargs[w], ref, None) for w in msg["back"]]
            return out
        if op == "next":
            try:
                value = next(obj)
            except StopIteration:
                return {"stop": True}
        elif op == "getattr":
            value = getattr(obj, msg["name"])
        elif op == "getitem":
            value = obj[_decode(msg["key"], deref)]
        else:
            value = {"len": len, "bool": bool, "iter": iter, "repr": repr, "str": str}[op](obj)
        return {"ok": _encode(value, ref, None)}

    first = _recv(os, json, req_r, cap)
    if first is None or first.get("op") != "go":  # the checker is gone, or ends before the start
        leave(0)
    try:
        exec(code, globals_)
    except SystemExit as e:
        leave(e.code)
    except BaseException as e:
        sys.__excepthook__(type(e), e, e.__traceback__)
        leave(1)
    names = []
    for k, v in list(globals_.items()):
        if type(k) is str and not (k.startswith("__") and k.endswith("__")):
            try:
                names.append([k, _encode(v, ref, [10000])])  # small data as values, the rest by reference
            except BaseException:
                names.append([k, ref(v)])
    _flush(sys)  # (the program's output is out before each message: the checker may end the run after any)
    send({"ready": names})
    while True:
        msg = _recv(os, json, req_r, cap)
        if msg is None or msg.get("op") not in _OPS:
            leave(0)
        try:
            out = answer(msg)
        except SystemExit as e:
            leave(e.code)
        except BaseException as e:
            try:
                text = str(e)
            except BaseException:
                text = "(unprintable)"
            out = {"err": [type(e).__name__, text[:2000]]}
        _flush(sys)
        send(out)


if __name__ == "__main__":
    _code, _globals, _chan = _main()
    del _main
    if _chan is None:
        exec(_code, _globals)
    else:
        _serve(_code, _globals, *_chan)
