"""Colocated weight update between two processes on one host: raw bytes through an RPC pipe vs shared-memory handoff.

Run: .venv/bin/python benchmarks/sync/bench_handoff.py [--mb 256] [--reps 5]

The engine process holds a state dict of the same layout (already faulted in) and copies every received tensor
into it, as an engine's ``update_weights`` does. Per update, methods interleaved rep by rep:
  rpc bytes   what an engine adapter that ships tensors as raw bytes does (``tensor -> bytes``, pickled, written
              to a pipe, read, unpickled, ``bytes -> tensor``, copied into the weights)
  handoff     HandoffSender.prepare (one copy into shared memory) -> a pickled HandoffMessage through the same
              pipe -> open_handoff views -> copied into the weights -> acknowledged -> release
Printed per method: seconds (best of --reps, median in brackets), bytes through read/write system calls on both
sides (``/proc/self/io`` wchar + rchar: the kernel copies of a pipe or socket), bytes copied in user space (counted
by construction: each full pass over the weights), and both together as multiples of the model's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import struct
import subprocess
import sys
import time

import torch


def layout(mb: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out, total, i = [], 0, 0
    while total < mb << 20:
        out += [(f"l{i}.w", (1024, 1024), torch.bfloat16), (f"l{i}.n", (1024,), torch.float32)]
        total += (2 << 20) + 4096
        i += 1
    return out


def io_bytes() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["rchar"]), int(d["wchar"])


def _read(stream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def child(mb: int) -> None:
    from rlblocks.sync import open_handoff
    from rlblocks.sync.broadcast import bytes_to_tensor

    torch.set_num_threads(1)
    state = {n: torch.zeros(s, dtype=dt) for n, s, dt in layout(mb)}
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(b"R")
    out.flush()
    while True:
        try:
            kind, n = struct.unpack("<cQ", _read(inp, 9))
        except EOFError:
            return
        r0, _ = io_bytes()
        payload = pickle.loads(_read(inp, n))
        if kind == b"O":
            for name, raw in payload:
                t = state[name]
                state[name].copy_(bytes_to_tensor(raw).view(t.dtype).view(t.shape))
            user = 3 * sum(len(raw) for _, raw in payload)  # unpickled bytes, bytes -> tensor, copy into weights
        else:
            with open_handoff(payload) as named:
                for name, t in named:
                    state[name].copy_(t)
            user = payload.nbytes  # the copy into the weights only
        del payload
        r1, _ = io_bytes()
        out.write(json.dumps({"rchar": r1 - r0, "user": user}).encode() + b"\n")
        out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.mb)
        return
    from rlblocks.sync import HandoffSender
    from rlblocks.sync.broadcast import tensor_to_bytes

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g).to(dt) for n, s, dt in layout(a.mb)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--mb", str(a.mb)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdout.read(1) == b"R"
    sender = HandoffSender(bucket_bytes=64 << 20)

    def rpc() -> tuple[int, int]:
        payload = [(n, tensor_to_bytes(t)) for n, t in state.items()]  # copy 1: tensor -> bytes
        data = pickle.dumps(payload, protocol=5)  # copy 2: into the pickle
        del payload
        proc.stdin.write(struct.pack("<cQ", b"O", len(data)) + data)  # + the pipe: kernel copies in and out
        proc.stdin.flush()
        return 2 * nbytes, len(data)

    def handoff() -> tuple[int, int]:
        before = sender.stats()["bytes_packed"]
        msg = sender.prepare(state, version=1)  # copy 1: into shared memory
        data = pickle.dumps(msg)
        proc.stdin.write(struct.pack("<cQ", b"N", len(data)) + data)
        proc.stdin.flush()
        handoff.msg = msg
        return sender.stats()["bytes_packed"] - before, len(data)

    methods = {"rpc bytes": rpc, "handoff": handoff}
    rows: dict[str, list[tuple[float, int, int]]] = {m: [] for m in methods}
    for _ in range(a.reps):
        for name, fn in methods.items():
            _, w0 = io_bytes()
            t0 = time.perf_counter()
            user_sender, _ = fn()
            reply = json.loads(proc.stdout.readline())  # the engine confirmed: its weights hold the update
            dt = time.perf_counter() - t0
            _, w1 = io_bytes()
            if name == "handoff":
                sender.release(handoff.msg)
            rows[name].append((dt, (w1 - w0) + reply["rchar"], user_sender + reply["user"]))
    proc.stdin.close()
    proc.wait()
    sender.close()
    print(f"model {nbytes / 1e6:.0f} MB in {len(state)} tensors, 2 processes on one host, 1 thread each; "
          f"best of {a.reps} interleaved reps")
    print(f"{'method':<12}{'s':>8}{'(median)':>10}{'GB/s':>8}{'syscall MB':>12}{'user-copy MB':>14}{'copies':>8}")
    for name, rs in rows.items():
        best = min(r[0] for r in rs)
        med = statistics.median(r[0] for r in rs)
        sys_b, user_b = rs[-1][1], rs[-1][2]
        print(f"{name:<12}{best:8.3f}{f'({med:.3f})':>10}{nbytes / best / 1e9:8.2f}{sys_b / 1e6:12.1f}"
              f"{user_b / 1e6:14.1f}{(sys_b + user_b) / nbytes:8.2f}")


if __name__ == "__main__":
    main()
