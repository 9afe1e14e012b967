"""Delta sync: bit-exact chains, size bounds, refusal of bad packets with weights unchanged.

Reference: the sender's tensors compared byte for byte (int views), independent of the codec.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from rlblocks.errors import DeltaError
from rlblocks.sync import DeltaDecoder, DeltaEncoder, DeltaPacket

INT = {4: torch.int32, 2: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(INT[t.element_size()]).clone()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _state(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(300, 64, generator=g).to(dtype),
        "w": torch.randn(97, 31, generator=g).to(dtype),
        "b": torch.randn(5, generator=g).to(dtype),
    }


def _special_bits(esize: int) -> torch.Tensor:
    """-0.0, +0.0, +inf, quiet NaN with payload, signalling NaN, negative NaN, smallest subnormal."""
    if esize == 4:
        vals = [-(2**31), 0, 0x7F800000, 0x7FC01234, 0x7F800001, -0x003FFFFF, 1]
    else:
        vals = [-32768, 0, 0x7C00, 0x7E55, 0x7C01, -0x0101, 1]  # fp16 / bf16 patterns alike are just 16-bit words
    return torch.tensor(vals, dtype=torch.int64).to(INT[esize])


def _mutate(state: dict, density: float, g: torch.Generator) -> None:
    """Overwrite a random ``density`` fraction of each tensor with random bit patterns (NaNs, -0.0 included)."""
    for t in state.values():
        iv = t.reshape(-1).view(INT[t.element_size()])
        m = torch.rand(iv.numel(), generator=g) < density
        k = int(m.sum())
        lo, hi = (-(2**31), 2**31 - 1) if t.element_size() == 4 else (-(2**15), 2**15 - 1)
        new = torch.randint(lo, hi, (k,), generator=g, dtype=torch.int64).to(iv.dtype)
        sp = _special_bits(t.element_size())
        new[: min(k, sp.numel())] = sp[: min(k, sp.numel())]
        iv[m] = new


@pytest.mark.filterwarnings("ignore:DeltaEncoder. the delta:RuntimeWarning")  # density 1.0: not smaller
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("density", [0.001, 0.03, 0.5, 1.0])
def test_chain_of_20_updates_is_bit_exact(dtype, density):
    g = torch.Generator().manual_seed(1)
    sender = _state(dtype)
    receiver = {k: v.clone() for k, v in sender.items()}
    enc = DeltaEncoder(sender, version=0, compress="auto" if density == 0.03 else False)
    dec = DeltaDecoder(receiver, version=0)
    for v in range(1, 21):
        _mutate(sender, density, g)
        packet = DeltaPacket.from_bytes(enc.encode(sender, version=v).to_bytes())
        assert packet.base_version == v - 1 and packet.version == v
        assert dec.apply(packet) == v
        assert _same(sender, receiver), f"step {v}"


@pytest.mark.filterwarnings("ignore:DeltaEncoder. the delta:RuntimeWarning")  # every element changes
def test_signed_zero_and_nan_payload_changes_are_seen():
    a = {"x": torch.tensor([0.0, float("nan"), 1.0])}
    enc = DeltaEncoder(a)
    b = {"x": a["x"].clone()}
    b["x"].view(torch.int32)[0] = -(2**31)  # +0.0 -> -0.0 (equal as floats)
    b["x"].view(torch.int32)[1] = 0x7FC00001  # NaN -> another NaN payload
    p = enc.encode(b, version=1)
    assert p.changed == 2
    r = {"x": torch.tensor([0.0, float("nan"), 1.0])}
    DeltaDecoder(r).apply(DeltaPacket.from_bytes(p.to_bytes()))
    assert torch.equal(r["x"].view(torch.int32), b["x"].view(torch.int32))


@pytest.mark.parametrize(
    ("dtype", "density"), [(torch.bfloat16, 0.03), (torch.float32, 0.03), (torch.bfloat16, 0.001), (torch.float32, 0.5)]
)
def test_wire_size_within_gap16_bound(dtype, density):
    n = 1 << 20
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(n, generator=g).to(dtype)}
    enc = DeltaEncoder(a)
    b = {"w": a["w"].clone()}
    idx = torch.randperm(n, generator=g)[: int(density * n)]
    b["w"].view(-1)[idx] = -b["w"].view(-1)[idx] - 1  # every chosen element really changes
    wire = len(enc.encode(b, version=1).to_bytes())
    esize = a["w"].element_size()
    assert wire <= 1.1 * density * (esize + 2) * n
    if dtype == torch.bfloat16 and density == 0.03:
        assert wire <= 0.066 * n * esize  # the target: 3 % of a bf16 model travels in <= 6.6 % of its bytes


def test_encodings_chosen_and_exact_including_wide_gaps():
    n = 200_000
    base = {"gap": torch.zeros(n), "bit": torch.zeros(4096), "dense": torch.zeros(100), "idx": torch.zeros(n)}
    new = {k: v.clone() for k, v in base.items()}
    new["gap"][:100] = 1.0
    new["gap"][150_000] = 2.0  # one gap >= 0xFFFF: escaped
    new["bit"][::2] = 3.0
    new["dense"][:] = 4.0
    new["idx"][[5, 190_000]] = 5.0  # two far-apart changes: int32 indices are smaller than gaps + escape
    p = DeltaEncoder(base).encode(new, version=1)
    rec = {t.name: t for t in p.tensors}
    assert rec["gap"].encoding == "gap16" and rec["gap"].nwide == 1
    assert rec["bit"].encoding == "bitmap"
    assert rec["dense"].encoding == "dense"
    assert rec["idx"].encoding == "idx32"
    r = {k: v.clone() for k, v in base.items()}
    DeltaDecoder(r).apply(DeltaPacket.from_bytes(p.to_bytes()))
    assert _same(r, new)
    p2 = DeltaEncoder(new).encode({k: v.clone() for k, v in new.items()}, version=1)
    assert all(t.encoding == "none" for t in p2.tensors)


def _chain():
    g = torch.Generator().manual_seed(3)
    s = _state(torch.bfloat16)
    enc = DeltaEncoder(s)
    packets = []
    for v in (1, 2):
        _mutate(s, 0.03, g)
        packets.append(enc.encode(s, version=v).to_bytes())
    return _state(torch.bfloat16), packets, s


def test_out_of_order_packet_refused_weights_unchanged():
    r, (p1, p2), _ = _chain()
    before = {k: v.clone() for k, v in r.items()}
    dec = DeltaDecoder(r)
    with pytest.raises(DeltaError, match="base_version 1 does not match the current version 0"):
        dec.apply(DeltaPacket.from_bytes(p2))
    assert _same(r, before) and dec.version == 0
    dec.apply(DeltaPacket.from_bytes(p1))
    after1 = {k: v.clone() for k, v in r.items()}
    with pytest.raises(DeltaError, match="base_version 0"):
        dec.apply(DeltaPacket.from_bytes(p1))  # replay
    assert _same(r, after1) and dec.version == 1


def test_every_flipped_byte_is_refused():
    r, (p1, _), _ = _chain()
    before = {k: v.clone() for k, v in r.items()}
    dec = DeltaDecoder(r)
    positions = sorted(set(range(0, 64)) | set(range(64, len(p1), max(1, len(p1) // 300))) | {len(p1) - 1})
    for i in positions:
        bad = bytearray(p1)
        bad[i] ^= 0x10
        with pytest.raises(DeltaError):
            dec.apply(DeltaPacket.from_bytes(bytes(bad)))
    with pytest.raises(DeltaError):
        DeltaPacket.from_bytes(p1[:-1])  # truncated
    assert _same(r, before) and dec.version == 0


def test_tampered_in_memory_packet_rolled_back():
    """A packet object altered after encoding (no bytes checksum involved): the post-write CRC catches it."""
    r, (p1, _), _ = _chain()
    before = {k: v.clone() for k, v in r.items()}
    packet = DeltaPacket.from_bytes(p1)
    first, second = packet.tensors[0], packet.tensors[1]  # "emb" is written before "w" fails: must be undone
    assert first.encoding != "none" and second.encoding != "none"
    second.values = second.values.clone()
    second.values[0] ^= 1
    with pytest.raises(DeltaError, match="undone"):
        DeltaDecoder(r).apply(packet)
    assert _same(r, before)


def test_wrong_base_state_refused():
    r, (p1, _), _ = _chain()
    r["b"].view(torch.int16)[0] ^= 1  # receiver diverged although it claims version 0
    before = {k: v.clone() for k, v in r.items()}
    with pytest.raises(DeltaError, match="not this delta's base"):
        DeltaDecoder(r).apply(DeltaPacket.from_bytes(p1))
    assert _same(r, before)


def test_full_packet_resets_chain():
    g = torch.Generator().manual_seed(5)
    s = _state(torch.float32)
    enc = DeltaEncoder(s)
    r = _state(torch.float32, seed=9)  # unrelated weights: only a full packet can fix them
    dec = DeltaDecoder(r, version=3)
    _mutate(s, 0.5, g)
    full = DeltaPacket.from_bytes(enc.full(s, version=10).to_bytes())
    assert full.is_full and all(t.encoding == "dense" for t in full.tensors)
    assert dec.apply(full) == 10 and _same(r, s)
    _mutate(s, 0.03, g)
    assert dec.apply(DeltaPacket.from_bytes(enc.encode(s, version=11).to_bytes())) == 11 and _same(r, s)


@pytest.mark.filterwarnings("ignore:DeltaEncoder. the delta:RuntimeWarning")  # every element changes
def test_layout_mismatch_refused():
    a = {"x": torch.zeros(4)}
    p = DeltaEncoder(a).encode({"x": torch.ones(4)}, version=1)
    with pytest.raises(DeltaError, match="names differ"):
        DeltaDecoder({"y": torch.zeros(4)}).apply(p)
    with pytest.raises(DeltaError, match="does not match ours"):
        DeltaDecoder({"x": torch.zeros(5)}).apply(p)
    with pytest.raises(ValueError, match="version: expected > 0"):
        DeltaEncoder(a).encode(a, version=0)
    with pytest.raises(ValueError, match="contiguous"):
        DeltaDecoder({"x": torch.zeros(4, 2).t()})


@pytest.mark.filterwarnings("ignore:DeltaEncoder. the delta:RuntimeWarning")  # every element changes
def test_works_without_zstandard(monkeypatch):
    a = {"x": torch.zeros(10_000)}
    zpacket = DeltaEncoder(a, compress=True).encode({"x": torch.ones(10_000)}, version=1).to_bytes()
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    enc = DeltaEncoder(a, compress="auto")
    assert enc.compression == "none"
    b = {"x": a["x"].clone()}
    b["x"][::7] = 2.0
    r = {"x": torch.zeros(10_000)}
    DeltaDecoder(r).apply(DeltaPacket.from_bytes(enc.encode(b, version=1).to_bytes()))
    assert _same(r, b)
    with pytest.raises(DeltaError, match="zstandard"):
        DeltaEncoder(a, compress=True)
    with pytest.raises(DeltaError, match="zstandard"):
        DeltaPacket.from_bytes(zpacket)


def test_old_full_packet_does_not_roll_back():
    """A decoder at version 3 refuses a full packet of version 1 (or 3): versions only move forward."""
    g = torch.Generator().manual_seed(7)
    s = _state(torch.float32)
    enc = DeltaEncoder(s)
    old_full = DeltaPacket.from_bytes(enc.full(s, version=1).to_bytes())
    r = {k: v.clone() for k, v in s.items()}
    dec = DeltaDecoder(r, version=1)
    for v in (2, 3):
        _mutate(s, 0.03, g)
        dec.apply(DeltaPacket.from_bytes(enc.encode(s, version=v).to_bytes()))
    at3 = {k: v.clone() for k, v in r.items()}
    same_version_full = DeltaPacket.from_bytes(DeltaEncoder(s).full(s, version=3).to_bytes())
    for p in (old_full, same_version_full):
        with pytest.raises(DeltaError, match="not newer than the current version 3"):
            dec.apply(p)
        assert dec.version == 3 and _same(r, at3)
    assert dec.apply(old_full, allow_rollback=True) == 1  # going back on purpose
    assert not _same(r, at3)
    with pytest.raises(ValueError, match="allow_rollback"):
        enc.full(s, version=2)  # the encoder is at 3
    assert enc.full(s, version=2, allow_rollback=True).version == 2


def test_local_edit_since_last_apply_is_detected():
    """The base check reads the tensors' current contents: an edit made behind the decoder's back is refused."""
    r, (p1, p2), _ = _chain()
    dec = DeltaDecoder(r)
    dec.apply(DeltaPacket.from_bytes(p1))
    r["w"].view(-1)[3] += 1.0  # local edit after the decoder last wrote "w"
    edited = {k: v.clone() for k, v in r.items()}
    with pytest.raises(DeltaError, match=r"'w'.*not this delta's base"):
        dec.apply(DeltaPacket.from_bytes(p2))
    assert _same(r, edited) and dec.version == 1


def test_delta_not_smaller_than_full_is_reported_or_replaced():
    base = {"a": torch.zeros(1000), "b": torch.zeros(300, dtype=torch.bfloat16)}
    new = {"a": torch.ones(1000), "b": torch.ones(300, dtype=torch.bfloat16)}  # every element changes
    enc = DeltaEncoder(base)
    with pytest.warns(RuntimeWarning, match="not fewer than a full packet"):
        p = enc.encode(new, version=1)
    assert not p.is_full and enc.stats() == {"deltas": 1, "fulls": 0, "not_smaller": 1, "full_fallbacks": 0}
    enc = DeltaEncoder(base, full_fallback=True)
    p = enc.encode(new, version=1)
    assert p.is_full and p.version == 1
    assert enc.stats() == {"deltas": 0, "fulls": 1, "not_smaller": 1, "full_fallbacks": 1}
    r = {k: torch.full_like(v, 5.0) for k, v in base.items()}  # any state: a full packet needs no base
    assert DeltaDecoder(r).apply(DeltaPacket.from_bytes(p.to_bytes())) == 1 and _same(r, new)
    sparse = {k: v.clone() for k, v in new.items()}
    sparse["a"][0] = 2.0
    p2 = enc.encode(sparse, version=2)  # a small delta is still a delta, based on the fallback's version
    assert p2.base_version == 1 and enc.stats()["deltas"] == 1


def test_version_is_keyword_only():
    x = torch.zeros(1000)
    enc = DeltaEncoder({"x": x})
    x[0] = 1.0
    for call in (lambda: enc.encode({"x": x}, 1), lambda: enc.full({"x": x}, 1)):
        with pytest.raises(TypeError):
            call()
    assert enc.stats()["deltas"] == 0 and enc.version == 0  # nothing was encoded
    assert enc.encode({"x": x}, version=1).version == 1


@pytest.mark.gpu
def test_cuda_snapshot_encodes_the_same_bytes_as_the_cpu_one():
    g = torch.Generator().manual_seed(11)
    s = _state(torch.bfloat16)
    new = {k: v.clone() for k, v in s.items()}
    _mutate(new, 0.03, g)
    cpu = DeltaEncoder(s).encode(new, version=1).to_bytes()
    gpu = DeltaEncoder({k: v.cuda() for k, v in s.items()}, device="cuda")
    assert gpu.encode({k: v.cuda() for k, v in new.items()}, version=1).to_bytes() == cpu
    r = {k: v.cuda() for k, v in s.items()}
    DeltaDecoder(r).apply(DeltaPacket.from_bytes(cpu))
    assert _same({k: v.cpu() for k, v in r.items()}, new)


def test_non_increasing_or_out_of_range_positions_refused_weights_unchanged():
    """Records altered in memory (so no packet CRC is involved): each malformed position list is refused."""
    n = 50_000
    base = {"w": torch.zeros(n)}
    new = {"w": torch.zeros(n)}
    new["w"][[3, 10, 20]] = 1.0
    for mutate, match in (
        (lambda pos: pos.view(torch.int16).__setitem__(1, 0), "not strictly increasing"),  # second gap 0
        (lambda pos: pos.view(torch.int16).__setitem__(2, -5536), "out of range"),  # gap 60000: past the end
    ):
        p = DeltaEncoder(base).encode(new, version=1)
        rec = p.tensors[0]
        assert rec.encoding == "gap16"
        rec.positions = rec.positions.clone()
        mutate(rec.positions)
        r = {"w": torch.zeros(n)}
        with pytest.raises(DeltaError, match=match):
            DeltaDecoder(r).apply(p)
        assert torch.equal(r["w"], base["w"])


@pytest.mark.parametrize("density", [0.02, 0.07, 0.3, 0.9, 1.0])
def test_mask_and_index_paths_encode_identical_packets(monkeypatch, density):
    """The encoder picks an element-mask path when a sample says many elements changed; both paths must give the
    same bytes (the sample only chooses how to compute, never what is sent)."""
    import warnings

    import rlblocks.sync.delta as delta

    g = torch.Generator().manual_seed(5)
    base = {"a": torch.randn(40_000, generator=g).bfloat16(), "b": torch.randn(9_999, generator=g)}
    new = {k: v.clone() for k, v in base.items()}
    _mutate(new, density, g)
    out = []
    for forced in (0.0, 1.0):
        monkeypatch.setattr(delta, "sampled_density", lambda old, new, f=forced: f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out.append(DeltaEncoder(base).encode(new, version=1).to_bytes())
    assert out[0] == out[1]
    r = {k: v.clone() for k, v in base.items()}
    DeltaDecoder(r).apply(DeltaPacket.from_bytes(out[1]))
    assert _same(r, new)


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba is not installed (native loop optional)")
@pytest.mark.filterwarnings("ignore:DeltaEncoder. the delta:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("density", [1e-5, 0.001, 0.03, 0.2])
def test_native_and_torch_encoders_give_identical_packets(monkeypatch, dtype, density):
    """The compiled encoder loop and the torch path: the same bytes on the wire and the same snapshot."""
    from rlblocks.sync import _bits

    monkeypatch.setattr(_bits, "CHUNK_BYTES", 8192)  # many chunks: gaps fixed up across their boundaries
    g = torch.Generator().manual_seed(11)
    base = {"a": torch.randn(200_003, generator=g).to(dtype), "b": torch.randn(64, 33, generator=g).to(dtype)}
    new = {k: v.clone() for k, v in base.items()}
    for t in new.values():
        iv = t.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
        iv[torch.rand(iv.numel(), generator=g) < density] ^= 3
    out = {}
    for native in ("1", "0"):
        monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
        enc = DeltaEncoder(base, version=0)
        out[native] = (enc.encode(new, version=1).to_bytes(), {k: _bits_u8(v) for k, v in enc._snap.items()})
    assert out["1"][0] == out["0"][0]
    assert all(torch.equal(out["1"][1][k], out["0"][1][k]) for k in base)
    dec = DeltaDecoder({k: v.clone() for k, v in base.items()})
    dec.apply(DeltaPacket.from_bytes(out["1"][0]))
    assert all(torch.equal(_bits_u8(dec.tensors[k]), _bits_u8(new[k])) for k in base)


def _bits_u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


NATIVE = importlib.util.find_spec("numba") is not None and importlib.util.find_spec("isal") is not None


def _model(g: torch.Generator) -> dict:
    """Many tensors of two element sizes (batched by size), one large enough to be encoded on its own, one
    empty, so that every path of the encoder and decoder runs."""
    out = {f"l{i}.w": torch.randn(257 + 37 * i, generator=g).to(torch.bfloat16) for i in range(9)}
    out |= {f"l{i}.n": torch.randn(65 + i, generator=g) for i in range(4)}
    out["embed"] = torch.randn(60_000, generator=g).to(torch.bfloat16)
    out["empty"] = torch.empty(0)
    return out


def _step(state: dict, density: float, g: torch.Generator) -> dict:
    new = {k: v.clone() for k, v in state.items()}
    for t in new.values():
        iv = t.view(-1).view(INT[t.element_size()])
        iv[torch.rand(iv.numel(), generator=g) < density] ^= 1
    return new


@pytest.mark.parametrize("batch_bytes", [None, 2048])
@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_encode_and_apply_equal_with_any_number_of_sync_threads(monkeypatch, threads, native, batch_bytes):
    """Tensors batched and spread over the sync pool: the packet's bytes and the applied weights do not depend on
    how many threads there are (the one-thread packet is the reference), with or without the compiled loops, and
    with batches capped at 2 KiB (one or two tensors each) as with the default cap."""
    import rlblocks.sync.delta as delta

    if batch_bytes is not None:
        monkeypatch.setattr(delta, "_BATCH_BYTES", batch_bytes)
    monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
    g = torch.Generator().manual_seed(21)
    base = _model(g)
    new = _step(base, 0.03, g)
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", "1")
    ref = DeltaEncoder(base).encode(new, version=1).to_bytes()
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", threads)
    enc = DeltaEncoder(base)
    wire = enc.encode(new, version=1).to_bytes()
    assert wire == ref and _same(enc._snap, new)
    for verify in (True, False):
        r = {k: v.clone() for k, v in base.items()}
        DeltaDecoder(r).apply(DeltaPacket.from_bytes(wire), verify=verify)
        assert _same(r, new)


@pytest.mark.parametrize("verify", [True, False])
def test_decoder_writes_into_a_parameter_whose_data_was_replaced(verify):
    """The decoder keeps its tensors' views between packets; a parameter whose ``.data`` was swapped for another
    tensor in between (as optimizer wrappers and loaders do) receives the next packet's writes in its new storage,
    and its old storage is left alone."""
    g = torch.Generator().manual_seed(12)
    lin = torch.nn.Linear(96, 64).to(torch.bfloat16)
    sender = {k: v.detach().clone() for k, v in lin.state_dict().items()}
    enc = DeltaEncoder(sender)
    dec = DeltaDecoder(dict(lin.named_parameters()))
    for version in (1, 2):
        sender = _step(sender, 0.05, g)
        packet = enc.encode(sender, version=version)
        if version == 2:
            old = lin.weight.data
            lin.weight.data = old.clone()
            kept = old.clone()
        dec.apply(DeltaPacket.from_bytes(packet.to_bytes()), verify=verify)
        assert _same({k: v.detach() for k, v in lin.named_parameters()}, sender)
    assert torch.equal(old.view(torch.int16), kept.view(torch.int16))


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_tensor_transposed_in_place_since_is_refused(monkeypatch, native):
    """A square tensor transposed in place after the decoder took it keeps its address and size but not its
    layout: the packet is refused, nothing written (a flat view of it would be a copy, or the wrong elements)."""
    monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
    g = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    new = _step(base, 0.03, g)
    p = DeltaEncoder(base).encode(new, version=1)
    r = {k: v.clone() for k, v in base.items()}
    dec = DeltaDecoder(r)
    r["w"].t_()
    before = {k: v.clone() for k, v in r.items()}
    with pytest.raises(DeltaError, match=r"packet\['w'\]: our tensor is no longer contiguous"):
        dec.apply(p)
    assert _same(r, before) and dec.version == 0


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
@pytest.mark.parametrize("threads", ["2", "3"])
def test_batches_with_staged_and_dense_tensors_equal_one_thread(monkeypatch, threads):
    """The pooled batches when some inputs need a staging copy (not contiguous: staged on the worker) and some are
    found dense by the compiled call (half their elements changed: the mask path, on the worker): the same packet
    bytes and snapshot as one thread; a batch that fails raises its error once every batch has finished."""
    import rlblocks.sync.delta as delta

    monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", "1")
    monkeypatch.setattr(delta, "_BATCH_BYTES", 30_000)  # several batches per thread
    g = torch.Generator().manual_seed(31)
    base = {f"m{i}": torch.randn(64, 80, generator=g).to(torch.bfloat16) for i in range(12)}
    base |= {f"v{i}": torch.randn(96, 50, generator=g) for i in range(6)}
    new = _step(base, 0.03, g)
    new["m3"] = _step({"x": base["m3"]}, 0.5, g)["x"]  # dense: over 1 in 8 of its sample changed
    new["v2"] = _step({"x": base["v2"]}, 0.5, g)["x"]
    for k in ("m5", "v4", "m3"):
        new[k] = new[k].t().contiguous().t()  # the same values, not contiguous
        assert not new[k].is_contiguous()
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", "1")
    one = DeltaEncoder(base)
    ref = one.encode(new, version=1)
    assert {t.name: t.encoding for t in ref.tensors}["m3"] != "gap16"
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", threads)
    enc = DeltaEncoder(base)
    assert enc.encode(new, version=1).to_bytes() == ref.to_bytes() and _same(enc._snap, one._snap)

    calls, finished = [], []
    real = delta.delta_batch_run

    def flaky(batch, **kw):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("batch failed")
        out = real(batch, **kw)
        finished.append(True)
        return out

    monkeypatch.setattr(delta, "delta_batch_run", flaky)
    enc = DeltaEncoder(base)
    with pytest.raises(RuntimeError, match="batch failed"):
        enc.encode(new, version=2)
    assert len(calls) > 2 and len(finished) == len(calls) - 1  # every other batch ran to its end first


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda rec: rec.positions.view(torch.int16).__setitem__(1, 0), "not strictly increasing"),
        (lambda rec: rec.positions.view(torch.int16).__setitem__(0, -1), "escapes"),  # an escape with no value
        (lambda rec: rec.positions.view(torch.int16).__setitem__(-1, 30_000), "out of range"),
        (lambda rec: setattr(rec, "nwide", 1), "expected"),  # sizes no longer add up
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_native_and_torch_decoders_refuse_alike(monkeypatch, mutate, match, verify):
    """A gap16 record altered in memory: the compiled loops (checking as they write with ``verify``, their writes
    undone; before writing without it) and the torch decode refuse it with the same message, and the weights stay
    unchanged (on two sync threads: the other batches were written, then undone)."""
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", "2")
    g = torch.Generator().manual_seed(4)
    base = _model(g)
    new = _step(base, 0.01, g)
    msgs = {}
    for native in ("1", "0"):
        monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
        p = DeltaEncoder(base).encode(new, version=1)
        rec = next(t for t in p.tensors if t.name == "l5.w")
        assert rec.encoding == "gap16" and rec.count > 2
        rec.positions = rec.positions.clone()
        mutate(rec)
        r = {k: v.clone() for k, v in base.items()}
        with pytest.raises(DeltaError, match=match) as err:
            DeltaDecoder(r).apply(p, verify=verify)
        msgs[native] = str(err.value)
        assert _same(r, base)
    assert msgs["1"] == msgs["0"]


@pytest.mark.parametrize("order", [(2, 9), (9, 2), (5, None)])
def test_several_faults_one_report_whatever_the_path(monkeypatch, order):
    """Faults in one packet: a gap16 record whose positions run past its tensor (found as it is written, with
    ``verify``, when no record's check failed first: the other batches are then written and undone), maybe a record
    with a size fault (found by its check, before any write), and a receiver tensor that is not the base. Two sync
    threads over many batches, one thread, and the torch path report the same record's fault, the records' own
    faults first in packet order, and every tensor is left as it was."""
    import rlblocks.sync.delta as delta

    monkeypatch.setattr(delta, "_BATCH_BYTES", 2048)
    g = torch.Generator().manual_seed(9)
    base = {f"t{i:02d}": torch.randn(1000 + 40 * i, generator=g).to(torch.bfloat16) for i in range(16)}
    new = _step(base, 0.02, g)
    positions_at, size_at = order
    msgs = set()
    for native, threads in (("1", "2"), ("1", "1"), ("0", "2")):
        monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
        monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", threads)
        p = DeltaPacket.from_bytes(DeltaEncoder(base).encode(new, version=1).to_bytes())
        assert all(t.encoding == "gap16" for t in p.tensors)
        bad = p.tensors[positions_at]
        bad.positions = bad.positions.clone()
        bad.positions.view(torch.int16)[-1] = 30_000  # the last position past the end
        if size_at is not None:
            odd = p.tensors[size_at]
            odd.values = odd.values[:-2].clone()  # one value short
        r = {k: v.clone() for k, v in base.items()}
        r["t12"].view(torch.int16)[0] ^= 1  # not the base
        before = {k: v.clone() for k, v in r.items()}
        with pytest.raises(DeltaError) as err:
            DeltaDecoder(r).apply(p)
        assert _same(r, before)
        msgs.add(str(err.value))
    assert len(msgs) == 1, msgs
    (msg,) = msgs
    first = min(i for i in order if i is not None)
    assert f"'t{first:02d}'" in msg  # the first faulty record in packet order, not the base mismatch


@pytest.mark.parametrize("native", ["1", "0"])
def test_base_mismatch_reported_first_and_every_write_undone(monkeypatch, native):
    """Two faults in one packet, on tensors written by different tasks: a tampered value (its CRC after writing
    fails) and a receiver tensor that is not the delta's base. The base mismatch is what is reported, and every
    tensor, including those written correctly, is back to its old contents."""
    monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", native)
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", "2")
    g = torch.Generator().manual_seed(8)
    base = _model(g)
    new = _step(base, 0.02, g)
    p = DeltaEncoder(base).encode(new, version=1)
    rec = next(t for t in p.tensors if t.name == "l0.w")
    rec.values = rec.values.clone()
    rec.values[0] ^= 1
    r = {k: v.clone() for k, v in base.items()}
    r["l7.w"].view(torch.int16)[3] ^= 1  # diverged
    before = {k: v.clone() for k, v in r.items()}
    with pytest.raises(DeltaError, match=r"packet\['l7.w'\].*not this delta's base"):
        DeltaDecoder(r).apply(p)
    assert _same(r, before)
    del r["l7.w"]
    r2 = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaError, match=r"'l0.w' has CRC .* after applying"):
        DeltaDecoder(r2).apply(p)
    assert _same(r2, base)


def test_batches_balance_bytes_and_respect_the_cap(monkeypatch):
    """Two batches per thread, more when one would pass the cap; every item in exactly one batch; the largest
    first into the lightest (the spread of loads is at most the largest item)."""
    import rlblocks.sync.delta as delta

    size = {i: s for i, s in enumerate([900, 50, 300, 300, 20, 700, 10, 10, 450, 5])}
    for threads, cap, want in ((1, 1 << 30, 2), (2, 1 << 30, 4), (2, 600, 5), (8, 1 << 30, 10)):
        monkeypatch.setattr(delta, "_BATCH_BYTES", cap)
        parts = delta._batches(list(size), size, threads)
        assert len(parts) == want
        assert sorted(i for p in parts for i in p) == list(size)
        loads = [sum(size[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(size.values())
        assert all(p == sorted(p) for p in parts)
