"""Delta sync throughput and wire size at densities 0.1 %, 3 %, 50 % (bf16 and fp32).

Run: .venv/bin/python benchmarks/sync/bench_delta.py [--melems 32]
For each (dtype, density): one random sparse update of a model of --melems million elements in 8 tensors, then
  encode     DeltaEncoder.encode (compare with the snapshot, pick encodings, update snapshot, CRC)
  to_bytes   serialisation incl. whole-packet CRC-32
  from_bytes parsing incl. CRC check
  apply      DeltaDecoder.apply with verify=True (CRC of every touched tensor after writing) and verify=False
GB/s are model bytes / time. wire/full = len(to_bytes) / model bytes; bound = 1.1 * density * (itemsize + 2) /
itemsize, the issue's goal. Also the zstd-compressed wire size.
"""

from __future__ import annotations

import argparse
import time

import torch

from rlblocks.sync import DeltaDecoder, DeltaEncoder, DeltaPacket


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--melems", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared, loaded machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n_t = 8
    per = a.melems * 1_000_000 // n_t
    print(f"model {a.melems}M elements in {n_t} tensors, {torch.get_num_threads()} threads")
    hdr = f"{'dtype':<9}{'density':>8}{'encode':>8}{'to_b':>8}{'from_b':>8}{'apply':>8}{'apply*':>8}"
    print(hdr + f"{'wire/full':>11}{'bound':>8}{'zstd':>8}   (GB/s; apply* = verify=False)")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for density in (0.001, 0.03, 0.5):
            base = {f"t{i}": torch.randn(per, generator=g).to(dtype) for i in range(n_t)}
            new = {k: v.clone() for k, v in base.items()}
            for t in new.values():
                idx = torch.randperm(per, generator=g)[: int(density * per)]
                t[idx] = -t[idx] - 1
            full = sum(t.numel() * t.element_size() for t in base.values())
            enc = DeltaEncoder(base)
            packet, t_enc = timed(lambda e=enc, nw=new: e.encode(nw, 1))
            wire, t_tob = timed(packet.to_bytes)
            parsed, t_fromb = timed(lambda w=wire: DeltaPacket.from_bytes(w))
            recv = {k: v.clone() for k, v in base.items()}
            _, t_apply = timed(lambda r=recv, p=parsed: DeltaDecoder(r).apply(p))
            assert all(torch.equal(recv[k].view(torch.uint8), new[k].view(torch.uint8)) for k in new)
            recv2 = {k: v.clone() for k, v in base.items()}
            _, t_apply2 = timed(lambda r=recv2, p=parsed: DeltaDecoder(r).apply(p, verify=False))
            zwire = len(DeltaEncoder(base, compress=True).encode(new, 1).to_bytes())
            es = base["t0"].element_size()
            bound = 1.1 * density * (es + 2) / es
            gbs = [full / t / 1e9 for t in (t_enc, t_tob, t_fromb, t_apply, t_apply2)]
            print(
                f"{str(dtype).split('.')[-1]:<9}{density:>8.3f}" + "".join(f"{x:8.2f}" for x in gbs)
                + f"{len(wire) / full:11.4f}{bound:8.4f}{zwire / full:8.4f}"
            )
            del base, new, recv, recv2, enc, packet, parsed, wire


if __name__ == "__main__":
    main()
