"""The child side of :class:`rlblocks.reward.workers.ProcessWorkers`: run pickled calls one at a time, forever.

Started as ``python -c BOOTSTRAP CONFIG_JSON`` (the bootstrap drops the current directory from ``sys.path``, then
calls :func:`main`). Frames on the pipes are an
8-byte big-endian length followed by a pickle. The protocol owns the process's original stdin and stdout; the
called functions see ``/dev/null`` as stdin and the worker's stderr as stdout, so a ``print`` in a verifier cannot
corrupt a frame. This module imports only the standard library, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import traceback

_HEADER = struct.Struct(">Q")


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _die_with_parent() -> None:
    # Linux: SIGKILL this worker when the thread that started it exits (the parent process dying included), so a
    # worker stuck in a pathological input never outlives the trainer. Elsewhere EOF on stdin ends an idle worker.
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main() -> None:
    cfg = json.loads(sys.argv[1])
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    _die_with_parent()
    if cfg.get("memory_bytes"):
        import resource

        m = int(cfg["memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (m, m))
    try:
        for name in cfg.get("preload", []):
            __import__(name)
        # the rlblocks this worker imported (the parent refuses a worker that found another one)
        package = os.path.dirname(os.path.abspath(sys.modules["rlblocks"].__file__))
        _write_frame(proto_out, pickle.dumps(("ready", os.getpid(), package)))
    except BaseException as e:  # a failed preload is reported, then the worker exits
        _write_frame(proto_out, pickle.dumps(("error", type(e).__name__, str(e), traceback.format_exc())))
        return
    while True:
        head = _read_exact(proto_in, _HEADER.size)
        if head is None:
            return  # the parent closed the pipe: shut down
        body = _read_exact(proto_in, _HEADER.unpack(head)[0])
        if body is None:
            return
        try:
            fn, args, kwargs = pickle.loads(body)
            reply = ("ok", fn(*args, **kwargs))
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # report every failure of the call, MemoryError and SystemExit included
            payload = pickle.dumps(("error", type(e).__name__, str(e), traceback.format_exc()))
        _write_frame(proto_out, payload)
        sys.stdout.flush()
        sys.stderr.flush()
