"""Pack + unpack throughput of rlblocks.sync buckets versus a plain torch.cat copy of the same bytes.

Run: .venv/bin/python benchmarks/sync/bench_buckets.py [--mb 256]
Both sides do the same work: gather every tensor's bytes into flat buffer(s), then copy each tensor back out
into a destination model (what a receiver's load does). Prints GB/s (model bytes / time) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from rlblocks.sync import pack_buckets, unpack_bucket


def model(mb: int) -> dict[str, torch.Tensor]:
    out, total, i = {}, 0, 0
    while total < mb << 20:
        big = torch.randn(512, 1024) if i % 2 else torch.randn(1024, 1024).bfloat16()
        out[f"l{i}.w"] = big
        out[f"l{i}.norm"] = torch.randn(1024)
        total += big.numel() * big.element_size() + 4096
        i += 1
    return out


def best(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared, loaded machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    src = model(a.mb)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())

    def rl():
        for b in pack_buckets(src.items(), bucket_bytes=a.bucket_mb << 20):
            for name, view in unpack_bucket(b):
                dst[name].copy_(view)

    def cat():
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in src.values()])
        off = 0
        for name, t in src.items():
            n = t.numel() * t.element_size()
            dst[name].reshape(-1).view(torch.uint8).copy_(flat[off : off + n])
            off += n

    t_rl, t_cat = best(rl, a.reps), best(cat, a.reps)
    assert all(torch.equal(dst[k].view(torch.uint8), src[k].view(torch.uint8)) for k in src)
    print(f"model {nbytes / 1e6:.0f} MB, {len(src)} tensors, buckets {a.bucket_mb} MB")
    print(f"{'method':<24}{'s':>8}{'GB/s':>8}")
    print(f"{'pack+unpack (buckets)':<24}{t_rl:8.3f}{nbytes / t_rl / 1e9:8.2f}")
    print(f"{'torch.cat + split copy':<24}{t_cat:8.3f}{nbytes / t_cat / 1e9:8.2f}")
    print(f"ratio buckets / cat throughput: {t_cat / t_rl:.2f}")


if __name__ == "__main__":
    main()
