"""Worker process for the multi-process sync tests (launched with subprocess by the tests, never by pytest).

Usage: python _worker.py '<json config>'. Writes a JSON result to config["out"]. Each process forms its own
sync group with init_sync_group: the two sides share no torchrun world and no default process group.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    GroupDeltaTransport,
    WeightReceiver,
    WeightSender,
    init_sync_group,
)
from rlblocks.sync.delta import crc32_tensor


def random_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed-dtype tensors with NaN payloads and -0.0; one larger than the bucket size used below."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "w32": torch.randn(300, 70, generator=g),
        "w16": torch.randn(129, 33, generator=g).half(),
        "wbf": torch.randn(4096, 8, generator=g).bfloat16(),
        "big": torch.randn(70_000, generator=g),  # 280 kB > bucket_bytes
        "ids": torch.randint(-5, 5, (17,), generator=g),
        "flag": torch.rand(9, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
    }
    out["w32"].view(-1).view(torch.int32)[:3] = torch.tensor([0x7FC01234, 0x7F800001, -(2**31)], dtype=torch.int32)
    out["wbf"].view(-1).view(torch.int16)[:2] = torch.tensor([0x7FC5, -32768], dtype=torch.int16)
    return out


def crcs(named) -> dict[str, int]:
    return {n: crc32_tensor(t) for n, t in named.items()}


def tiny_state(path: str) -> dict[str, torch.Tensor]:
    """The tiny HF Llama's weights read with safetensors (no transformers import: fast start-up)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def session_trainer(cfg, group, res):
    """Full sync of the tiny HF model's weights, a refused mismatch, then 3 deltas over the group."""
    sd = tiny_state(cfg["model_dir"])
    for t in sd.values():
        t.add_(torch.randn_like(t) * 0.01)
    sender = WeightSender(group, bucket_bytes=64 << 10)
    sender.send(sd.items(), version=7)
    res["full_crc"] = crcs(sd)
    try:  # the receiver expects different shapes this time
        sender.send(sd.items(), version=8)
        res["mismatch"] = "not raised"
    except Exception as e:
        res["mismatch"] = f"{type(e).__name__}: {e}"
    enc = DeltaEncoder(sd, version=7, compress="auto")
    tr = GroupDeltaTransport(group)
    res["wire"] = []
    for v in (8, 9, 10):
        for t in sd.values():
            m = torch.rand_like(t) < 0.03
            t[m] += 0.5
        res["wire"].append(tr.send(enc.encode(sd, version=v)))
    res["full_bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
    res["delta_crc"] = crcs(sd)


def session_rollout(cfg, group, res):
    """Starts from different weights (zeros) of the same layout; receives, then applies deltas in place."""
    sd = {n: torch.zeros_like(t) for n, t in tiny_state(cfg["model_dir"]).items()}
    version, it = WeightReceiver(group, expected=sd).receive()
    for name, t in it:
        sd[name].copy_(t)
    res["version"] = version
    res["full_crc"] = crcs(sd)
    wrong = {n: (torch.zeros(3) if n.endswith("norm.weight") else t) for n, t in sd.items()}
    try:
        WeightReceiver(group, expected=wrong).receive()
        res["mismatch"] = "not raised"
    except Exception as e:
        res["mismatch"] = f"{type(e).__name__}: {e}"
    dec = DeltaDecoder(sd, version=version)
    tr = GroupDeltaTransport(group)
    res["versions"] = [dec.apply(tr.receive()) for _ in range(3)]
    res["delta_crc"] = crcs(sd)


def loop_sender(cfg, group, res):
    """Send random states forever (until the peer dies); records how long the failure took to surface."""
    sender = WeightSender(group, bucket_bytes=100 << 10)
    state = random_state(0)
    v = 0
    while True:
        v += 1
        t0 = time.monotonic()
        try:
            sender.send(state.items(), version=v)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            res["fail_after_s"] = time.monotonic() - t0
            return
        if v == 1:
            print("READY", flush=True)


def loop_receiver(cfg, group, res):
    recv = WeightReceiver(group, expected=random_state(1))
    ref = crcs(random_state(0))
    v = 0
    while True:
        t0 = time.monotonic()
        try:
            version, it = recv.receive()
            got = dict(it)
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
            res["fail_after_s"] = time.monotonic() - t0
            return
        v += 1
        res["equal"] = crcs(got) == ref and version == v
        if v == 1:
            print("READY", flush=True)


def fp8_state(seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights of LM-like names: partial 128-blocks, one tensor above the bucket size, kept-in-bf16 ones."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 260, generator=g).bfloat16(),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(260, 260, generator=g).bfloat16(),
        "model.layers.0.mlp.down_proj.weight": torch.randn(260, 700, generator=g).bfloat16(),  # 182 kB of FP8
        "model.layers.0.mlp.up_proj.weight": (torch.randn(700, 260, generator=g) * 1e-3).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.ones(260).bfloat16(),
        "lm_head.weight": torch.randn(64, 260, generator=g).bfloat16(),
    }


def fp8_trainer(cfg, group, res):
    """FP8 over WeightSender (streamed with a manifest, small and direct buckets), then two FP8 deltas."""
    from rlblocks.sync import quantize_named, quantized_specs
    from rlblocks.sync.buckets import tensor_spec

    sd = fp8_state(0)
    specs = quantized_specs([tensor_spec(n, t) for n, t in sd.items()])
    WeightSender(group, bucket_bytes=64 << 10, direct_bytes=100 << 10).send(
        quantize_named(iter(sd.items())), version=1, manifest=specs
    )
    fp8 = dict(quantize_named(sd))
    res["full_crc"] = crcs(fp8)
    enc = DeltaEncoder(fp8, version=1)
    tr = GroupDeltaTransport(group)
    g = torch.Generator().manual_seed(1)
    for v in (2, 3):
        for t in sd.values():
            t.add_((torch.randn(t.shape, generator=g) * 1e-2).bfloat16())
        fp8 = dict(quantize_named(sd))
        tr.send(enc.encode(fp8, version=v))
    res["delta_crc"] = crcs(fp8)


def fp8_rollout(cfg, group, res):
    """Receives the FP8 stream (checked against the FP8 manifest), then applies the deltas to it in place."""
    from rlblocks.sync import quantized_specs
    from rlblocks.sync.buckets import tensor_spec

    expected = quantized_specs([tensor_spec(n, t) for n, t in fp8_state(5).items()])  # layout only
    version, it = WeightReceiver(group, expected=expected).receive()
    got = {n: t.clone() for n, t in it}
    res["version"] = version
    res["full_crc"] = crcs(got)
    res["dtypes"] = {n: str(t.dtype) for n, t in got.items()}
    dec = DeltaDecoder(got, version=version)
    tr = GroupDeltaTransport(group)
    res["versions"] = [dec.apply(tr.receive()) for _ in range(2)]
    res["delta_crc"] = crcs(got)


ROLES = {
    "fp8_trainer": fp8_trainer,
    "fp8_rollout": fp8_rollout,
    "session_trainer": session_trainer,
    "session_rollout": session_rollout,
    "loop_sender": loop_sender,
    "loop_receiver": loop_receiver,
}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    res: dict = {"role": cfg["role"]}
    try:
        group = init_sync_group(
            master_addr="127.0.0.1",
            master_port=cfg["port"],
            world_size=cfg["world_size"],
            rank=cfg["rank"],
            timeout=cfg["timeout"],
        )
        res["default_pg_initialized"] = dist.is_initialized()
        ROLES[cfg["role"]](cfg, group, res)
        res["ok"] = True
    except Exception as e:
        res["ok"] = False
        res["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(cfg["out"], "w") as f:
        json.dump(res, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
