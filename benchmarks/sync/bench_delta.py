"""Delta sync throughput next to memcpy, and wire size, at densities 0.1 %, 3 %, 50 % (bf16 and fp32).

Run: .venv/bin/python benchmarks/sync/bench_delta.py [--melems 32] [--reps 5] [--threads N] [--sync-threads N]
     [--baseline OLD_DELTA_PY | --baseline-rev GIT_REV]

For each (dtype, density): a model of --melems million elements in 8 tensors and one random sparse update. Timed,
with the methods interleaved rep by rep (load changes on a shared machine hit all of them alike):
  memcpy       dst.copy_(src) of every tensor: the memory-bandwidth yardstick, on the same bytes (torch intra-op
               threads: --threads, default every CPU this process may use)
  encode       DeltaEncoder.encode (compare with the snapshot, pick encodings, update the snapshot, CRC), with the
               native word loop of rlblocks.sync._bits when numba is installed
  enc torch    the same with the torch path (RLBLOCKS_SYNC_NATIVE=0)
  apply        DeltaDecoder.apply(verify=True): base CRC of the current contents, writes, CRC after writing
  apply*       DeltaDecoder.apply(verify=False)
  old enc / old apply   the same with an older implementation, loaded as separate modules: --baseline names an
               older rlblocks/sync/delta.py (a _bits.py beside it is loaded as its _bits, else today's is used), and
               --baseline-rev REV takes both files from git (`--baseline-rev main`); its packets must be
               byte-identical to the new ones (the wire format is unchanged), which is asserted.
Sync threads (--sync-threads) default to every CPU too. The load average is printed before and after.
GB/s are model bytes / time (best of --reps, median in brackets; every rep starts from fresh copies, made outside
the timed region; memcpy's time is the mean of 4 copies, so that it is exposed to other jobs' load about as long
as the methods it is compared with). x/memcpy = the median over reps of memcpy's time / x's time within the rep.
wire/full = len(to_bytes()) / model bytes; bound = 1.1 * density * (itemsize + 2) / itemsize (gap16 positions +
values, plus 10 %); zstd = the same with compress=True.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import torch


def _load_source(name: str, source: str, path: str):
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod  # dataclasses look their module up while the class is being built
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod


def load_baseline(path: str):
    """An older delta.py as a module of its own; a _bits.py beside it becomes its ``rlblocks.sync._bits``."""
    src = Path(path).read_text()
    bits = Path(path).with_name("_bits.py")
    if bits.is_file():
        _load_source("rlblocks_sync_bits_baseline", bits.read_text(), str(bits))
        src = src.replace("from rlblocks.sync._bits import", "from rlblocks_sync_bits_baseline import")
    return _load_source("rlblocks_sync_delta_baseline", src, path)


def baseline_from_git(rev: str) -> str:
    """``rlblocks/sync/delta.py`` and ``_bits.py`` of ``rev`` written to a temporary directory; the delta.py path."""
    out = Path(tempfile.mkdtemp(prefix="bench_delta_baseline_"))
    root = Path(__file__).resolve().parents[2]
    for f in ("delta.py", "_bits.py"):
        text = subprocess.run(["git", "show", f"{rev}:rlblocks/sync/{f}"], cwd=root, check=True, capture_output=True,
                              text=True).stdout
        (out / f).write_text(text)
    return str(out / "delta.py")


MEMCPY_REPEATS = 4


def timed(c: str, base: dict, new: dict, dst: dict, parsed, old, old_parsed) -> float:
    """Seconds of one run of method ``c`` (set-up outside the timed region; applied weights checked after)."""
    from rlblocks.sync import DeltaDecoder, DeltaEncoder

    if c == "memcpy":  # MEMCPY_REPEATS copies per sample: exposed to the machine's load about as long as the others
        t0 = time.perf_counter()
        for _ in range(MEMCPY_REPEATS):
            for k, v in new.items():
                dst[k].copy_(v)
        return (time.perf_counter() - t0) / MEMCPY_REPEATS
    if c in ("encode", "enc torch", "old enc"):
        enc = old.DeltaEncoder(base) if c == "old enc" else DeltaEncoder(base)
        os.environ["RLBLOCKS_SYNC_NATIVE"] = "0" if c == "enc torch" else "1"
        t0 = time.perf_counter()
        if c == "old enc":
            enc.encode(new, version=1)
        else:
            enc.encode(new, version=1)
        dt = time.perf_counter() - t0
        os.environ["RLBLOCKS_SYNC_NATIVE"] = "1"
        return dt
    recv = {k: v.clone() for k, v in base.items()}
    dec = old.DeltaDecoder(recv) if c == "old apply" else DeltaDecoder(recv)
    t0 = time.perf_counter()
    if c == "old apply":
        dec.apply(old_parsed)
    else:
        dec.apply(parsed, verify=c == "apply")
    dt = time.perf_counter() - t0
    assert all(torch.equal(recv[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--melems", type=int, default=32, help="model size in million elements (default 32)")
    ap.add_argument("--reps", type=int, default=5)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cpus, help=f"torch intra-op threads (default: the {cpus} CPUs)")
    ap.add_argument("--sync-threads", type=int, default=cpus, help="rlblocks.sync worker threads (chunks in "
                                                                     "parallel; default: every CPU)")
    ap.add_argument("--baseline", default=None, help="path of an older delta.py to time side by side")
    ap.add_argument("--baseline-rev", default=None, help="git revision whose delta.py and _bits.py are the baseline")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.03, 0.5])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ["RLBLOCKS_SYNC_THREADS"] = str(a.sync_threads)
    from rlblocks.sync import DeltaEncoder, DeltaPacket
    from rlblocks.sync._bits import CRC_BACKEND, native_available

    path = baseline_from_git(a.baseline_rev) if a.baseline_rev else a.baseline
    old = load_baseline(path) if path else None
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1/5/15 min) at "
          f"start; native word loop: {'yes (numba)' if native_available() else 'no (torch path)'}")
    warnings.simplefilter("ignore", RuntimeWarning)  # "delta not smaller than full" at high density: expected here
    n_t = 8
    per = a.melems * 1_000_000 // n_t
    print(f"model {a.melems}M elements in {n_t} tensors; torch threads {a.threads}, sync threads {a.sync_threads}, "
          f"CRC {CRC_BACKEND}; best of {a.reps} interleaved reps, GB/s of model bytes (median in brackets)")
    cols = ["memcpy", "encode", "enc torch", "apply", "apply*"] + (["old enc", "old apply"] if old else [])
    print(f"{'dtype':<9}{'density':>8}" + "".join(f"{c:>14}" for c in cols)
          + f"{'enc/memcpy':>11}{'apply/memcpy':>13}" + (f"{'old e/m':>9}{'old a/m':>9}" if old else "")
          + f"{'wire/full':>10}{'bound':>8}{'zstd':>8}")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for density in a.densities:
            base = {f"t{i}": torch.randn(per, generator=g).to(dtype) for i in range(n_t)}
            new = {k: v.clone() for k, v in base.items()}
            for t in new.values():
                idx = torch.randperm(per, generator=g)[: int(density * per)]
                t[idx] = -t[idx] - 1
            full = sum(t.numel() * t.element_size() for t in base.values())
            wire = DeltaEncoder(base).encode(new, version=1).to_bytes()
            parsed = DeltaPacket.from_bytes(wire)
            if old is not None:
                old_wire = old.DeltaEncoder(base).encode(new, version=1).to_bytes()
                assert old_wire == wire, "the baseline's packet differs from the new one: wire format changed"
                old_parsed = old.DeltaPacket.from_bytes(wire)
            dst = {k: torch.empty_like(v) for k, v in base.items()}
            times: dict[str, list[float]] = {c: [] for c in cols}
            for _ in range(a.reps):
                for c in cols:
                    times[c].append(timed(c, base, new, dst, parsed, old, old_parsed if old else None))
            best = {c: full / min(ts) / 1e9 for c, ts in times.items()}
            med = {c: full / statistics.median(ts) / 1e9 for c, ts in times.items()}
            # x/memcpy: the median over reps of the ratio within each rep (timed next to each other)
            ratio = {c: statistics.median(m / t for m, t in zip(times["memcpy"], ts)) for c, ts in times.items()}
            zwire = len(DeltaEncoder(base, compress=True).encode(new, version=1).to_bytes())
            es = base["t0"].element_size()
            bound = 1.1 * density * (es + 2) / es
            print(
                f"{str(dtype).split('.')[-1]:<9}{density:>8.3f}"
                + "".join(f"{best[c]:>7.2f} ({med[c]:4.2f})" for c in cols)
                + f"{ratio['encode']:>11.2f}{ratio['apply']:>13.2f}"
                + (f"{ratio['old enc']:>9.2f}{ratio['old apply']:>9.2f}" if old else "")
                + f"{len(wire) / full:>10.4f}{bound:>8.4f}{zwire / full:>8.4f}"
            )
            del base, new, dst, parsed, wire
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} at the end")


if __name__ == "__main__":
    main()
