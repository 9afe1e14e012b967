"""Broadcast of a ~500 MB model over gloo between 2 local processes (separately started, own sync group).

Run: .venv/bin/python benchmarks/sync/bench_broadcast.py [--mb 500]
Compares, in one run:
  raw single buffer  one broadcast of one pre-allocated uint8 buffer holding every byte (the ceiling)
  per-tensor         one broadcast per tensor (what naive weight sync does)
  bucketed N MB      WeightSender.send / WeightReceiver.receive: manifest handshake, packing, one broadcast per
                     bucket (pipelined), receiver gets views of fresh buffers, final ack
  ... reuse          the same with WeightReceiver(reuse_buffers=True) (recycled receive buffers)
Each is timed on the sender from a barrier to the end of the transfer (plus a closing barrier for the raw
methods), best of --reps. Prints seconds, GB/s and the ratio to the raw single buffer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from rlblocks.sync import WeightReceiver, WeightSender, init_sync_group


def layout(mb: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """~mb MB: per 'layer' one 4 MB fp32 matrix, one 2 MB bf16 matrix and two 4 kB fp32 norms."""
    out, total, i = [], 0, 0
    while total < mb << 20:
        out += [
            (f"l{i}.w1", (1024, 1024), torch.float32),
            (f"l{i}.w2", (1024, 1024), torch.bfloat16),
            (f"l{i}.n1", (1024,), torch.float32),
            (f"l{i}.n2", (1024,), torch.float32),
        ]
        total += (4 << 20) + (2 << 20) + 8192
        i += 1
    return out


def run(rank: int, port: int, mb: int, reps: int, buckets: list[int]) -> None:
    g = init_sync_group(master_addr="127.0.0.1", master_port=port, world_size=2, rank=rank, timeout=600)
    gen = torch.Generator().manual_seed(0)
    state = {
        n: torch.randn(s, generator=gen).to(dt) if rank == 0 else torch.empty(s, dtype=dt) for n, s, dt in layout(mb)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    results = {}

    def timed(name, fn):
        best = float("inf")
        for _ in range(reps):
            g.barrier()
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        results[name] = best

    flat = torch.empty(nbytes, dtype=torch.uint8)
    if rank == 0:
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n

    def raw():
        g.broadcast(flat, 0)
        g.barrier()

    def per_tensor():
        for t in state.values():
            g.broadcast(t, 0)
        g.barrier()

    timed("raw single buffer", raw)
    timed("per-tensor", per_tensor)
    for bmb in buckets:
        for reuse in (False, True):
            name = f"bucketed {bmb} MB{' reuse' if reuse else ''}"
            if rank == 0:
                sender = WeightSender(g, bucket_bytes=bmb << 20)
                timed(name, lambda s=sender: s.send(state.items(), 1))
                sender.release_buffers()
            else:
                recv = WeightReceiver(g, expected=state, reuse_buffers=reuse)

                def consume(r=recv):
                    _, it = r.receive()
                    for _ in it:
                        pass

                timed(name, consume)
                del recv
    if rank == 0:
        raw_t = results["raw single buffer"]
        print(f"model {nbytes / 1e6:.0f} MB in {len(state)} tensors, gloo, 2 processes on one host")
        print(f"{'method':<26}{'s':>8}{'GB/s':>8}{'vs raw':>8}")
        for name, t in results.items():
            print(f"{name:<26}{t:8.3f}{nbytes / t / 1e9:8.2f}{raw_t / t:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    a = ap.parse_args()
    if a.rank is not None:
        run(a.rank, a.port, a.mb, a.reps, a.buckets)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, __file__, "--mb", str(a.mb), "--reps", str(a.reps), "--port", str(port), "--buckets"]
    args += [str(b) for b in a.buckets]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*args, "--rank", str(r)], env=env) for r in (0, 1)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"workers exited with {codes}")


if __name__ == "__main__":
    main()
