"""The first code the sandboxed interpreter runs: ``python -I -S -B -c <this file's text> <config JSON>``.

It runs single-threaded, before any untrusted byte is read, and imports only the standard library (rlblocks
itself is not visible inside the sandbox). In order it

1. reads the run's secret (a per-run marker and the checks, see below) from an inherited in-memory file and
   closes it;
2. checks the kernel layers the host asked for (PID, user and network namespaces, seccomp, a read-only root, a
   size-limited scratch directory, no capabilities) and reports what it found on the status pipe; a missing
   required layer stops it here, before the program is even read;
3. sets the rlimits;
4. installs the audit hooks (PEP 578, they cannot be removed from Python) and runs the program.

**Checks and the marker.** With checks (assertion tests), the program runs in a worker thread, then the checks
in the same namespace, then a last statement the checks end with raises the audit event
``rlblocks.sandbox.finish``. A first audit hook, the only holder of the marker, writes the marker to stdout and
ends the process at once, but only when that event comes from the frame of the checks' own code object: the
program cannot forge it by exiting early (no marker), by raising the event itself (wrong frame; the marker is
then withheld for good), by patching ``print`` or ``sys.stdout`` (the hook writes with ``os.write``), or by
reading the marker (it is in no file, argument, environment variable, global or frame the program can reach:
``gc`` and frame-walking of other threads are refused, the program runs outside the main thread so no signal
handler of its own can see a frame, ``/proc/*/mem`` cannot be opened, and no native code can be loaded).
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
    secret = None
    if cfg["secret_fd"] >= 0:
        data = b""
        while True:
            chunk = os.read(cfg["secret_fd"], 65536)
            if not chunk:
                break
            data += chunk
        os.close(cfg["secret_fd"])
        secret = json.loads(data)
        del data, chunk
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
        nproc = lim["max_processes"] + 1 + (1 if secret else 0)  # + bubblewrap's init (+ the checks' thread)
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
    os.write(cfg["status_fd"], json.dumps(status).encode())
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

    # -- 4. the program and its checks ---------------------------------------------------------------------------
    program = cfg["program"]
    with open(program, "rb") as f:
        src = f.read()
    checks_code = None
    if secret is not None:
        import ast

        # The checks run as one code object that ends by flushing stdout and raising the finish event; the
        # event's line is past every line of the checks, so no other statement of that code object carries it.
        tree = ast.parse("\n\n".join(secret["checks"]) + "\n", filename="<checks>")
        finish_line = max([getattr(n, "end_lineno", 0) or 0 for n in ast.walk(tree)] + [0]) + 6
        tail = ast.parse('try:\n    __import__("sys").stdout.flush()\nexcept BaseException:\n    pass\n'
                         '__import__("sys").audit("rlblocks.sandbox.finish")\n')
        for node in tail.body:
            ast.increment_lineno(node, finish_line - 5)
        tree.body.extend(tail.body)
        checks_code = compile(tree, "<checks>", "exec", dont_inherit=True)
        _install_finisher(sys, os, checks_code, finish_line, ("\n" + secret["marker"] + "\n").encode())
        secret = None  # the marker now lives only in the finisher hook

    _install_policy(sys, os, stat, cfg, root, checks=checks_code is not None)
    sys.argv = [program, *cfg["args"]]
    code = compile(src, program, "exec", dont_inherit=True)
    import types

    main = types.ModuleType("__main__")
    main.__file__ = program
    sys.modules["__main__"] = main
    return code, main.__dict__, checks_code


def _install_finisher(sys, os, checks_code, finish_line, marker):
    """The hook that holds the marker. It never raises (an exception would carry its frame to the program), calls
    nothing the program can replace (every name it uses is a default argument bound here), and acts on one event
    only."""
    state = [checks_code, finish_line, marker, False]  # [code, line, marker bytes, withheld for good]

    def _finisher(event, args, _st=state, _getframe=sys._getframe, _write=os.write, _exit=os._exit,
                  _fin="rlblocks.sandbox.finish", _BE=BaseException):
        if event != _fin:
            return
        try:
            if _st[3]:
                return
            f = _getframe(1)
            if f.f_code is _st[0] and f.f_lineno == _st[1]:
                _write(1, _st[2])
                _exit(0)
            _st[3] = True  # raised from anywhere else: the program tried to forge the end of the checks
        except _BE:
            _st[3] = True

    sys.addaudithook(_finisher)


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
    # With checks the marker lives in this process: refuse every way Python has to see another thread's frames
    # or every object (the program's own frames stay visible: tracebacks, warnings and namedtuple need them).
    introspection = {"sys.settrace", "sys.setprofile", "sys._settraceallthreads", "sys._setprofileallthreads",
                     "sys._current_frames", "sys._current_exceptions", "gc.get_objects", "gc.get_referrers",
                     "gc.get_referents", "sys.monitoring.register_callback"} if checks else set()
    refused = {"sys.addaudithook", "code.__new__", "marshal.load"} | introspection
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

    def _check_proc(real, _weak=weak, _getpid=os.getpid, _int=int, _len=len, _is_dir=_is_dir, _PE=PermissionError,
                    _host_ok=frozenset({"cpuinfo", "meminfo", "stat", "uptime", "loadavg", "version"})):
        parts = real.split("/")  # ["", "proc", ...]
        if _len(parts) < 3 or parts[2] == "":
            raise _PE("sandbox: opening /proc itself is not allowed")
        if "mem" in parts or "pagemap" in parts or "map_files" in parts:
            raise _PE(f"sandbox: reading process memory is not allowed: {real!r}")
        if parts[2].isdigit():
            if _weak and _int(parts[2]) != _getpid():
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

    def _policy(event, args, _allow_proc=allow_proc, _allow_net=allow_net, _weak=weak, _root=root,
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
                if real == _root or real.startswith(_prefix):
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


def _run_checks(code, globals_, checks_code):
    """Worker thread: the program, then its checks (which end with the finish event). Reaching the end here
    means the finish event did not end the process: something in the program interfered."""
    import sys

    try:
        exec(code, globals_)
        exec(checks_code, globals_)
        sys.stderr.write("rlblocks sandbox: the checks ended without their marker (the program interfered)\n")
        _RESULT.append(1)
    except SystemExit as e:
        _RESULT.append(e.code)
    except BaseException as e:
        sys.__excepthook__(type(e), e, e.__traceback__)
        _RESULT.append(1)
    finally:
        _DONE.release()


if __name__ == "__main__":
    _code, _globals, _checks = _main()
    del _main
    if _checks is None:
        exec(_code, _globals)
    else:
        import _thread
        import os as _os
        import sys as _sys

        _RESULT = []
        _DONE = _thread.allocate_lock()
        _DONE.acquire()
        _thread.start_new_thread(_run_checks, (_code, _globals, _checks))
        del _code, _globals, _checks
        while True:
            try:
                if _DONE.acquire(timeout=0.5) or _RESULT:
                    break
            except BaseException:
                continue
        _rc = _RESULT[0] if _RESULT else 1
        for _s in (_sys.stdout, _sys.stderr):
            try:
                _s.flush()
            except BaseException:
                pass
        if _rc is None:
            _rc = 0
        elif not isinstance(_rc, int):
            _sys.stderr.write(f"{_rc}\n")
            _sys.stderr.flush()
            _rc = 1
        _os._exit(_rc & 0xFF)
