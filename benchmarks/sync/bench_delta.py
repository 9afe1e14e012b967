"""Delta sync throughput next to memcpy, and wire size, at densities 0.1 %, 3 %, 50 % (bf16 and fp32).

Run: .venv/bin/python benchmarks/sync/bench_delta.py [--melems 32] [--reps 5] [--sync-threads 2]
     [--baseline OLD_DELTA_PY]

For each (dtype, density): a model of --melems million elements in 8 tensors and one random sparse update. Timed,
with the methods interleaved rep by rep (load changes on a shared machine hit all of them alike):
  memcpy       dst.copy_(src) of every tensor: the memory-bandwidth yardstick, on the same bytes
  encode       DeltaEncoder.encode (compare with the snapshot, pick encodings, update the snapshot, CRC)
  apply        DeltaDecoder.apply(verify=True): base CRC of the current contents, writes, CRC after writing
  apply*       DeltaDecoder.apply(verify=False)
  old encode / old apply   the same with the implementation in --baseline (e.g. an older rlblocks/sync/delta.py,
               `git show REV:rlblocks/sync/delta.py > old.py`), loaded as a separate module; its packets must be
               byte-identical to the new ones (the wire format is unchanged), which is asserted.
GB/s are model bytes / time (best of --reps; every rep starts from fresh copies, made outside the timed region).
wire/full = len(to_bytes()) / model bytes; bound = 1.1 * density * (itemsize + 2) / itemsize (gap16 positions +
values, plus 10 %); zstd = the same with compress=True.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings

import torch


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("rlblocks_sync_delta_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is being built
    spec.loader.exec_module(mod)
    return mod


def timed(c: str, base: dict, new: dict, dst: dict, parsed, old, old_parsed) -> float:
    """Seconds of one run of method ``c`` (set-up outside the timed region; applied weights checked after)."""
    from rlblocks.sync import DeltaDecoder, DeltaEncoder

    if c == "memcpy":
        t0 = time.perf_counter()
        for k, v in new.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0
    if c in ("encode", "old enc"):
        enc = DeltaEncoder(base) if c == "encode" else old.DeltaEncoder(base)
        t0 = time.perf_counter()
        if c == "encode":
            enc.encode(new, version=1)
        else:
            enc.encode(new, 1)
        return time.perf_counter() - t0
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
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of this process (default 1)")
    ap.add_argument("--sync-threads", type=int, default=2, help="rlblocks.sync worker threads (chunks in parallel)")
    ap.add_argument("--baseline", default=None, help="path of an older delta.py to time side by side")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.03, 0.5])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ["RLBLOCKS_SYNC_THREADS"] = str(a.sync_threads)
    from rlblocks.sync import DeltaEncoder, DeltaPacket
    from rlblocks.sync._bits import CRC_BACKEND

    old = load_baseline(a.baseline) if a.baseline else None
    warnings.simplefilter("ignore", RuntimeWarning)  # "delta not smaller than full" at high density: expected here
    n_t = 8
    per = a.melems * 1_000_000 // n_t
    print(f"model {a.melems}M elements in {n_t} tensors; torch threads {a.threads}, sync threads {a.sync_threads}, "
          f"CRC {CRC_BACKEND}; best of {a.reps} interleaved reps, GB/s of model bytes (median in brackets)")
    cols = ["memcpy", "encode", "apply", "apply*"] + (["old enc", "old apply"] if old else [])
    print(f"{'dtype':<9}{'density':>8}" + "".join(f"{c:>14}" for c in cols)
          + f"{'enc/memcpy':>11}{'apply/memcpy':>13}{'wire/full':>10}{'bound':>8}{'zstd':>8}")
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
                old_wire = old.DeltaEncoder(base).encode(new, 1).to_bytes()
                assert old_wire == wire, "the baseline's packet differs from the new one: wire format changed"
                old_parsed = old.DeltaPacket.from_bytes(wire)
            dst = {k: torch.empty_like(v) for k, v in base.items()}
            times: dict[str, list[float]] = {c: [] for c in cols}
            for _ in range(a.reps):
                for c in cols:
                    times[c].append(timed(c, base, new, dst, parsed, old, old_parsed if old else None))
            best = {c: full / min(ts) / 1e9 for c, ts in times.items()}
            med = {c: full / statistics.median(ts) / 1e9 for c, ts in times.items()}
            zwire = len(DeltaEncoder(base, compress=True).encode(new, version=1).to_bytes())
            es = base["t0"].element_size()
            bound = 1.1 * density * (es + 2) / es
            print(
                f"{str(dtype).split('.')[-1]:<9}{density:>8.3f}"
                + "".join(f"{best[c]:>7.2f} ({med[c]:4.2f})" for c in cols)
                + f"{best['encode'] / best['memcpy']:>11.2f}{best['apply'] / best['memcpy']:>13.2f}"
                + f"{len(wire) / full:>10.4f}{bound:>8.4f}{zwire / full:>8.4f}"
            )
            del base, new, dst, parsed, wire


if __name__ == "__main__":
    main()
