"""Bad input to the sync blocks, tried as an attacker and as a new user would: bools and floats where byte counts
and versions are expected, truthy strings where flags are expected (``allow_rollback="no"`` must not roll the
weights back), and generators that used to check their arguments only at the first ``next()``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    DirectoryTransport,
    HandoffSender,
    LoraSyncer,
    full_tensors,
    merge_lora,
    pack_buckets,
    unpack_bucket,
)
from rlblocks.sync.buckets import plan_buckets, tensor_spec


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g), "step": torch.arange(3)}


# -------------------------------------------------------------------------------------------------- buckets
@pytest.mark.parametrize("bad", [True, False, 2.0, 0, -64, "64", None])
def test_bucket_bytes_is_a_positive_int_checked_at_the_call(bad):
    """``pack_buckets(..., bucket_bytes=True)`` used to be accepted as 1 byte; and as a generator it checked
    nothing until the first ``next()``, far from the call. It raises at the call now, like ``plan_buckets``."""
    with pytest.raises(ArgumentError, match=r"^bucket_bytes: expected an int >= 1"):
        pack_buckets(_weights().items(), bucket_bytes=bad)
    with pytest.raises(ArgumentError, match=r"^bucket_bytes: expected an int >= 1"):
        plan_buckets([], bucket_bytes=bad)
    with pytest.raises(ArgumentError, match=r"^bucket_bytes: expected an int >= 1"):
        HandoffSender(bucket_bytes=bad)


def test_bucket_bytes_numpy_int_gives_the_same_buckets_bit_for_bit():
    w = _weights()
    want = list(pack_buckets(w.items(), bucket_bytes=128))
    got = list(pack_buckets(w.items(), bucket_bytes=np.int64(128)))
    assert [b.metas for b in got] == [b.metas for b in want]
    back = {n: t for b in got for n, t in unpack_bucket(b)}  # (alignment gaps between tensors are not data)
    assert all(torch.equal(back[n], w[n]) for n in w)
    assert [m.offset for bucket in plan_buckets([tensor_spec(n, t) for n, t in w.items()],
                                                bucket_bytes=np.int32(128)) for m in bucket] == \
        [m.offset for b in want for m in b.metas]


def test_pack_buckets_device_and_items_are_checked():
    with pytest.raises(ArgumentError, match=r"^device: expected a torch.device or a device string, got 'gpu0'"):
        pack_buckets(_weights().items(), bucket_bytes=64, device="gpu0")
    with pytest.raises(ArgumentError, match=r"^named_tensors\[0\]: expected a \(name, tensor\) pair"):
        list(pack_buckets([torch.zeros(2)], bucket_bytes=64))


# ---------------------------------------------------------------------------------------- versions and flags
def test_versions_are_ints_numpy_included():
    w = _weights()
    enc = DeltaEncoder(w, version=np.int64(3))
    assert enc.version == 3 and type(enc.version) is int
    for bad in (3.0, True, "3", None):
        with pytest.raises(ArgumentError, match=r"^version: expected an int"):
            DeltaEncoder(w, version=bad)
    packet = enc.full(w, version=np.int32(4))
    assert packet.version == 4
    with pytest.raises(ArgumentError, match=r"^compress: expected False, True or 'auto', got 1"):
        DeltaEncoder(w, compress=1)


def test_truthy_strings_do_not_roll_weights_back(tmp_path):
    """``allow_rollback="no"`` used to be truthy, so it allowed the rollback it meant to forbid; every flag of
    the delta path is a real bool now, and a refused call leaves weights and versions as they were."""
    w = _weights()
    enc = DeltaEncoder(w, version=5)
    with pytest.raises(ArgumentError, match=r"^allow_rollback: expected True or False, got 'no'"):
        enc.full(w, version=2, allow_rollback="no")
    assert enc.version == 5
    dec_w = {n: t.clone() for n, t in w.items()}
    dec = DeltaDecoder(dec_w, version=5)
    old = enc.full(_weights(1), version=6)
    dec.apply(old)
    before = {n: t.clone() for n, t in dec_w.items()}
    rollback = DeltaEncoder(w, version=0).full(w, version=3)
    for kw in ({"allow_rollback": "no"}, {"allow_rollback": 1}, {"verify": "no"}, {"verify": 0}):
        with pytest.raises(ArgumentError, match=rf"^{next(iter(kw))}: expected True or False"):
            dec.apply(rollback, **kw)
        assert dec.version == 6 and all(torch.equal(dec_w[n], before[n]) for n in w)
    tr = DirectoryTransport(tmp_path, keep=np.int64(2))
    tr.publish(old)
    with pytest.raises(ArgumentError, match=r"^allow_rollback: expected True or False"):
        tr.publish(rollback, allow_rollback="yes")
    assert tr.versions() == [6]
    for bad in (True, 0, 2.5):
        with pytest.raises(ArgumentError, match=r"^keep: expected an int >= 1"):
            DirectoryTransport(tmp_path, keep=bad)


def test_lora_syncer_and_full_tensors_flags():
    def send(named, *, version):
        return None

    with pytest.raises(ArgumentError, match=r"^merge: expected None, True or False, got 1"):
        LoraSyncer(send, merge=1)
    with pytest.raises(ArgumentError, match=r"^keep: expected an int >= 1"):
        LoraSyncer(send, keep=True)
    assert LoraSyncer(send, keep=np.int64(3)).live_versions.maxlen == 3
    model = torch.nn.Linear(3, 2)
    for flag in ("buffers", "cpu_offload", "remove_duplicate"):
        with pytest.raises(ArgumentError, match=rf"^{flag}: expected True or False"):
            full_tensors(model, **{flag: "no"})  # raised at the call, before any iteration
    got = dict(full_tensors(model))
    assert got.keys() == {"weight", "bias"} and torch.equal(got["weight"], model.weight)


def test_merge_lora_checks_its_state_at_the_call():
    for bad in ({}, {"tensors": [], "config": {}}, None):
        with pytest.raises(ArgumentError, match=r"^lora_state: expected the dict returned by lora_state"):
            merge_lora({"w.weight": torch.zeros(2, 2)}, bad)


# ------------------------------------------------------------------------------------------------------ FP8
@pytest.mark.parametrize("shape", [(0, 128), (128, 0), (4, 0, 128), (0, 0)])
def test_fp8_of_a_matrix_without_rows_or_columns_is_refused_by_name(shape):
    """It used to raise torch's ``cannot reshape tensor of 0 elements``; a weight with no rows or columns has no
    blocks to scale (an empty leading dimension is a batch of 0 matrices: empty results, checked below)."""
    from rlblocks.sync.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8, scale_shape

    msg = r"^layer\.weight: expected a \[\.\.\., M, N\] weight with M > 0 and N > 0, got " + re.escape(str(list(shape)))
    with pytest.raises(ArgumentError, match=msg):
        quantize_fp8(torch.zeros(shape), name="layer.weight")
    with pytest.raises(ArgumentError, match=r"^layer\.weight: expected a \[\.\.\., M, N\] weight with M > 0"):
        dequantize_fp8(torch.zeros(shape).to(FP8_DTYPE), torch.ones(scale_shape(shape)), name="layer.weight")
    q, s = quantize_fp8(torch.zeros(0, 128, 128))
    assert q.shape == (0, 128, 128) and q.dtype == FP8_DTYPE and s.shape == (0, 1, 1)
    assert dequantize_fp8(q, s).shape == (0, 128, 128)
