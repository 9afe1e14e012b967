"""Weight-sync time calculator for large models: full, bucketed, delta, P2P and colocated handoff, side by side.

Run: .venv/bin/python benchmarks/sync/sync_plan.py                   # 1T parameters, the default layout
     .venv/bin/python benchmarks/sync/sync_plan.py --presets         # the published setups, next to their figures
     .venv/bin/python benchmarks/sync/sync_plan.py --params 671e9 --infer-gpus-per-replica 16 --nic-gbs 50

Model (bandwidth-bound; every figure is a lower bound that a real system approaches, never beats):
  B   = params * infer_bytes               bytes of one inference copy (weights may be cast, e.g. to fp8, at send)
  g   = inference GPUs per replica,  R = infer_gpus / g replicas,  G_t = training GPUs
  bw  = nic_gbs * efficiency               what one GPU's network link achieves (GB/s)
  o   = per-collective latency (s),  n = buckets per stream = ceil(bytes / bucket)
  full       one sender broadcasts every weight to all receivers (a single WeightSender on trainer rank 0):
             B / bw + n * o                (the sender's one link carries the whole model)
  bucketed   g senders, one per inference shard position, each broadcasting its B / g shard to the R replicas
             (one WeightSender per inference TP/EP rank, sharded with rlblocks.sync.reshard): B / g / bw + n * o
  delta      the same g streams carrying delta packets: wire = B / g * d * (infer_bytes + 2) / infer_bytes (uint16
             gaps + values). "delta (wire)" is the bandwidth-bound limit wire / bw + n * o; "delta" adds encode on
             every training host (its B / train_hosts at enc_gbs) and verified apply on every inference host (its
             R * B / infer_hosts at apply_gbs), not overlapped (rlblocks encodes a packet, sends it, then applies it)
  p2p        every training GPU writes its slice straight into every inference GPU that needs it (RDMA, as in
             Perplexity's and checkpoint-engine's P2P modes): max(R * B / G_t, B / g) / bw
  handoff    colocated: trainer and engine share each GPU (CUDA IPC, rlblocks.sync.handoff): the engine's one copy
             of its P * infer_bytes / G_t share at device-memory speed hbm_gbs; the raw-bytes RPC path instead
             crosses the host bus twice plus pickling: ~ 2 * share / pcie_gbs + share / host_copy_gbs
Training-side resharding (all-gathers inside the training job, on NVLink) overlaps with sending in every path and
is left out. Defaults: H100/H200 class nodes (400 Gb/s NIC per GPU = 50 GB/s, 0.8 efficiency, 50 us per
collective, 64 MB buckets, 3 % delta density, delta encode / apply 2 GB/s per host: what rlblocks measured on 2
shared cores; a many-core host with RLBLOCKS_SYNC_THREADS raised runs them several times faster).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Setup:
    params: float = 1e12
    infer_dtype: str = "bf16"
    train_gpus: int = 256
    infer_gpus: int = 128
    infer_gpus_per_replica: int = 16
    nic_gbs: float = 50.0
    efficiency: float = 0.8
    collective_us: float = 50.0
    bucket_mb: float = 64.0
    delta_density: float = 0.03
    enc_gbs: float = 2.0
    apply_gbs: float = 2.0
    gpus_per_node: int = 8
    hbm_gbs: float = 2000.0
    pcie_gbs: float = 50.0
    host_copy_gbs: float = 10.0


def predict(s: Setup) -> dict[str, float]:
    """Predicted seconds per path (see the module docstring for the formulas)."""
    ib = DTYPE_BYTES[s.infer_dtype]
    big_b = s.params * ib
    g = s.infer_gpus_per_replica
    replicas = max(1, s.infer_gpus // g)
    bw = s.nic_gbs * 1e9 * s.efficiency
    o = s.collective_us * 1e-6
    bucket = s.bucket_mb * 2**20
    shard = big_b / g
    wire = shard * s.delta_density * (ib + 2) / ib
    share = s.params * ib / s.train_gpus
    train_hosts = max(1, s.train_gpus // s.gpus_per_node)
    infer_hosts = max(1, s.infer_gpus // s.gpus_per_node)
    delta_wire = wire / bw + math.ceil(wire / bucket) * o
    encode = big_b / train_hosts / (s.enc_gbs * 1e9)
    apply = replicas * big_b / infer_hosts / (s.apply_gbs * 1e9)
    return {
        "full": big_b / bw + math.ceil(big_b / bucket) * o,
        "bucketed": shard / bw + math.ceil(shard / bucket) * o,
        "delta (wire)": delta_wire,
        "delta": encode + delta_wire + apply,
        "p2p": max(replicas * big_b / s.train_gpus, shard) / bw,
        "handoff": share / (s.hbm_gbs * 1e9),
        "handoff (rpc bytes)": 2 * share / (s.pcie_gbs * 1e9) + share / (s.host_copy_gbs * 1e9),
    }


def pick(s: Setup, t: dict[str, float], colocated: bool) -> str:
    if colocated:
        return "colocated: HandoffSender + update_from_handoff (CUDA IPC, one copy on the device)"
    best = min(("bucketed", "delta"), key=t.__getitem__)  # delta including its encode and apply
    if best == "delta":
        return ("delta: DeltaEncoder per shard stream + GroupDeltaTransport / DirectoryTransport (the link, not "
                "the encode, is the bottleneck here)")
    return ("bucketed: one WeightSender per inference shard position (its TP/EP rank), weights resharded on the "
            "trainer (rlblocks.sync.reshard); delta would be slower: encode/apply exceed the wire time")


PRESETS = {
    # name: (setup, published seconds, what was published)
    "Kimi-K2 1T, 256 -> 128 GPUs, fp8 inference (Perplexity, P2P RDMA)": (
        Setup(params=1.04e12, infer_dtype="fp8", train_gpus=256, infer_gpus=128, infer_gpus_per_replica=16),
        1.3,
        "p2p",
    ),
    "1T, broadcast to many inference GPUs (checkpoint-engine, broadcast mode)": (
        Setup(params=1.04e12, infer_dtype="bf16", train_gpus=256, infer_gpus=1024, infer_gpus_per_replica=16),
        20.0,
        "full",
    ),
    "DeepSeek-V3 671B, NCCL reshard (NeMo-RL)": (
        Setup(params=671e9, infer_dtype="bf16", train_gpus=128, infer_gpus=64, infer_gpus_per_replica=16),
        2.5,
        "bucketed",
    ),
    "Qwen3-235B delta vs full over a slow link (verl delta_sharded: 21x)": (
        Setup(params=235e9, infer_dtype="bf16", train_gpus=64, infer_gpus=64, infer_gpus_per_replica=8,
              nic_gbs=1.25, delta_density=0.024),
        21.0,
        "ratio bucketed/delta (wire)",
    ),
}


def table(s: Setup, colocated: bool) -> None:
    t = predict(s)
    ib = DTYPE_BYTES[s.infer_dtype]
    print(f"{s.params / 1e9:.0f}B params, {s.infer_dtype} on the wire ({s.params * ib / 1e12:.2f} TB per copy); "
          f"train {s.train_gpus} GPUs, infer {s.infer_gpus} GPUs in replicas of {s.infer_gpus_per_replica}; "
          f"NIC {s.nic_gbs:g} GB/s x {s.efficiency:g}, delta density {s.delta_density:g}, "
          f"encode/apply {s.enc_gbs:g}/{s.apply_gbs:g} GB/s")
    for name, sec in t.items():
        print(f"  {name:<22}{sec:10.3f} s")
    print(f"  pick: {pick(s, t, colocated)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = Setup()
    for field, value in vars(defaults).items():
        flag = "--" + field.replace("_", "-")
        if field == "infer_dtype":
            ap.add_argument(flag, default=value, choices=sorted(DTYPE_BYTES))
        else:
            ap.add_argument(flag, type=type(value), default=value)
    ap.add_argument("--colocated", action="store_true", help="trainer and engine share the GPUs")
    ap.add_argument("--presets", action="store_true", help="the published setups, next to their figures")
    a = ap.parse_args()
    if a.presets:
        for name, (s, published, path) in PRESETS.items():
            t = predict(s)
            if path.startswith("ratio"):
                got, unit = t["bucketed"] / t["delta (wire)"], "x"
            else:
                got, unit = t[path], " s"
            print(f"{name}\n  published {published:g}{unit}; predicted ({path}) {got:.2f}{unit}")
            table(s, colocated=False)
            print()
        return
    s = replace(defaults, **{k: getattr(a, k) for k in vars(defaults)})
    table(s, a.colocated)


if __name__ == "__main__":
    main()
