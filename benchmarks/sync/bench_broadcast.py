"""Broadcast of a ~500 MB model over gloo between 2 local processes (separately started, own sync group).

Run: .venv/bin/python benchmarks/sync/bench_broadcast.py [--mb 500] [--reps 7] [--threads 1]
Compares, in one run (methods interleaved rep by rep, so that load changes on the machine hit all alike):
  raw single buffer          one broadcast of one pre-allocated uint8 buffer holding every byte, the same already
                             faulted-in buffer every rep on both sides (the ceiling; a receiver that keeps the
                             tensors cannot reuse it)
  raw + sender pack          the same, but the sender first copies every tensor into that buffer (what a sender
                             whose weights are separate tensors pays to use one raw broadcast)
  raw fresh torch.empty      the raw single buffer, but the receiver allocates a fresh torch.empty buffer each
                             time (what a receiver that keeps the tensors pays with 4 KiB page faults)
  per-tensor                 one broadcast per tensor into the receiver's existing tensors (what naive weight sync does)
  bucketed N MB              WeightSender.send / WeightReceiver.receive (defaults): manifest handshake, one
                             broadcast per bucket (pipelined), tensors >= 1 MiB (gloo's DIRECT_BYTES) sent from
                             their own memory,
                             the small ones packed (double-buffered); the receiver keeps every tensor (dict(it)) and
                             drops them after the timed region; its buffer pool reuses them, faulted in, next time
  ... direct 4 MB            the same with WeightSender(direct_bytes=4 MiB)
  ... all packed             WeightSender(direct_bytes=None): every tensor packed into the buckets (the layout and
                             sender before direct sends)
  ... reuse                  the default sender, WeightReceiver(reuse_buffers=True) (recycled receive buffers;
                             tensors only iterated, not kept: the consumer's own copy is not counted)
Each is timed on the sender from a barrier to the end of the transfer (plus a closing barrier for the raw
methods, so that the receiver's page faults count), best of --reps (median also shown). Prints seconds, GB/s and
the ratio to the raw single buffer and to the raw fresh torch.empty broadcast.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def run(rank: int, port: int, mb: int, reps: int, buckets: list[int], threads: int) -> None:
    torch.set_num_threads(threads)
    g = init_sync_group(master_addr="127.0.0.1", master_port=port, world_size=2, rank=rank, timeout=600)
    gen = torch.Generator().manual_seed(0)
    state = {
        n: torch.randn(s, generator=gen).to(dt) if rank == 0 else torch.empty(s, dtype=dt) for n, s, dt in layout(mb)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    flat = torch.empty(nbytes, dtype=torch.uint8)
    flat.fill_(0)  # fault it in once: this buffer is reused every rep
    if rank == 0:
        off = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n

    def raw():
        g.broadcast(flat, 0)
        g.barrier()

    def raw_packed():
        if rank == 0:
            off = 0
            for t in state.values():
                n = t.numel() * t.element_size()
                flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
                off += n
        raw()

    def raw_fresh(alloc):
        def fn():
            buf = flat if rank == 0 else alloc()
            g.broadcast(buf, 0)
            g.barrier()
            return buf  # kept (and freed) outside the timed region, like a receiver that keeps its weights

        return fn

    def per_tensor():
        for t in state.values():
            g.broadcast(t, 0)
        g.barrier()

    methods = {
        "raw single buffer": raw,
        "raw + sender pack": raw_packed,
        "raw fresh torch.empty": raw_fresh(lambda: torch.empty(nbytes, dtype=torch.uint8)),
        "per-tensor": per_tensor,
    }
    variants = {"": "auto", " direct 4 MB": 4 << 20, " all packed": None}  # direct_bytes of the sender
    for bmb in buckets:
        if rank == 0:
            senders = {suffix: WeightSender(g, bucket_bytes=bmb << 20, direct_bytes=direct)  # long-lived: staging
                       for suffix, direct in variants.items()}  # buffers persist across sends
            for suffix, sender in senders.items():
                methods[f"bucketed {bmb} MB{suffix}"] = lambda s=sender: s.send(state.items(), version=1)
            methods[f"bucketed {bmb} MB reuse"] = lambda s=senders[""]: s.send(state.items(), version=1)
        else:
            safe = WeightReceiver(g, expected=state)
            reuse = WeightReceiver(g, expected=state, reuse_buffers=True)

            def keep_all(r=safe):
                return dict(r.receive()[1])  # every tensor kept: load_state_dict(dict(it)) / update_weights

            def stream(r=reuse):
                for _ in r.receive()[1]:
                    pass

            for suffix in variants:
                methods[f"bucketed {bmb} MB{suffix}"] = keep_all
            methods[f"bucketed {bmb} MB reuse"] = stream

    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            g.barrier()
            t0 = time.perf_counter()
            kept = fn()
            times[name].append(time.perf_counter() - t0)
            del kept
    if rank == 0:
        best = {name: min(ts) for name, ts in times.items()}
        med = {name: statistics.median(ts) for name, ts in times.items()}
        raw_t, fresh_t = best["raw single buffer"], best["raw fresh torch.empty"]
        print(f"model {nbytes / 1e6:.0f} MB in {len(state)} tensors, gloo, 2 processes on one host", end="")
        print(f", {threads} thread(s) each")
        print(f"best of {reps} interleaved reps (median in brackets)")
        print(f"{'method':<30}{'s':>8}{'(median)':>10}{'GB/s':>8}{'vs raw':>8}{'vs fresh':>10}")
        for name, t in best.items():
            row = f"{name:<30}{t:8.3f}{f'({med[name]:.3f})':>10}{nbytes / t / 1e9:8.2f}"
            print(f"{row}{raw_t / t:8.2f}{fresh_t / t:10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process")
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    a = ap.parse_args()
    if a.rank is not None:
        run(a.rank, a.port, a.mb, a.reps, a.buckets, a.threads)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, __file__, "--mb", str(a.mb), "--reps", str(a.reps), "--port", str(port)]
    args += ["--threads", str(a.threads), "--buckets"]
    args += [str(b) for b in a.buckets]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    procs = [subprocess.Popen([*args, "--rank", str(r)], env=env) for r in (0, 1)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"workers exited with {codes}")


if __name__ == "__main__":
    main()
