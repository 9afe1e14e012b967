"""Bucket packing: bit-exact round trips, layout rules, metadata serialisation. Reference: the input tensors' bytes."""

from __future__ import annotations

import pytest
import torch

from rlblocks.sync import Bucket, TensorMeta, pack_buckets, unpack_bucket
from rlblocks.sync.buckets import ALIGN, metadata_from_bytes, plan_buckets


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d = {
        "a.fp32": torch.randn(7, 5, generator=g),
        "b.bf16": torch.randn(33, generator=g).bfloat16(),
        "c.fp16": torch.randn(3, 3, 3, generator=g).half(),
        "d.i64": torch.arange(5),
        "e.bool": torch.tensor([True, False, True]),
        "f.big": torch.randn(3000, generator=g),  # 12000 bytes > bucket
        "g.empty": torch.zeros(0, 4),
        "h.scalar": torch.tensor(2.5, dtype=torch.float64),
        "i.strided": torch.randn(6, 4, generator=g).t(),  # non-contiguous input
    }
    d["a.fp32"].view(-1).view(torch.int32)[:3] = torch.tensor([0x7FC0ABCD, -(2**31), 0x7F800001], dtype=torch.int32)
    d["b.bf16"].view(-1).view(torch.int16)[:2] = torch.tensor([0x7FC3, -32768], dtype=torch.int16)
    return d


def test_round_trip_bit_exact_mixed_dtypes():
    src = _mixed()
    buckets = list(pack_buckets(src.items(), bucket_bytes=1024))
    got = [(n, t) for b in buckets for n, t in unpack_bucket(b)]
    assert [n for n, _ in got] == list(src)  # nothing dropped, order kept
    for name, t in got:
        assert t.dtype == src[name].dtype and t.shape == src[name].shape
        assert _bits(t) == _bits(src[name]), name


def test_layout_alignment_oversize_and_views():
    src = _mixed()
    buckets = list(pack_buckets(src.items(), bucket_bytes=1024))
    for b in buckets:
        assert all(m.offset % ALIGN == 0 for m in b.metas)
        ends = [m.offset + m.nbytes for m in b.metas]
        assert b.buffer.numel() == max(ends)
        if b.buffer.numel() > 1024:
            assert len(b.metas) == 1  # an oversize tensor travels alone
        for (_, view), m in zip(unpack_bucket(b), b.metas):
            if m.nbytes:
                assert view.data_ptr() == b.buffer.data_ptr() + m.offset  # a view, not a copy
    big = [b for b in buckets if b.metas[0].name == "f.big"]
    assert len(big) == 1 and len(big[0].metas) == 1
    # Layout equals the pure planner's (what a receiver computes from the manifest alone).
    specs = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in src.items()]
    assert [b.metas for b in buckets] == plan_buckets(specs, bucket_bytes=1024)


def test_metadata_bytes_round_trip_names_dtypes():
    b = next(pack_buckets(_mixed().items(), bucket_bytes=1 << 20))
    raw = b.metadata_bytes()
    assert b'"bfloat16"' in raw and b'"float16"' in raw and b'"bool"' in raw
    nbytes, metas = metadata_from_bytes(raw)
    assert nbytes == b.buffer.numel() and metas == b.metas
    rebuilt = Bucket.from_metadata(raw, b.buffer.clone())
    for (n1, t1), (n2, t2) in zip(unpack_bucket(b), unpack_bucket(rebuilt)):
        assert n1 == n2 and _bits(t1) == _bits(t2)


def test_greedy_packing_matches_hand_layout():
    # 3 x 400-byte fp32 tensors into 1000-byte buckets: [0, 448] then [0].  (400 rounded up to 448 = 7 * 64.)
    src = [(f"t{i}", torch.full((100,), float(i))) for i in range(3)]
    buckets = list(pack_buckets(src, bucket_bytes=1000))
    assert [[(m.name, m.offset) for m in b.metas] for b in buckets] == [[("t0", 0), ("t1", 448)], [("t2", 0)]]
    assert [b.buffer.numel() for b in buckets] == [848, 400]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack_buckets([("a", torch.zeros(1))], bucket_bytes=0))
    with pytest.raises(ValueError, match="duplicate name 'a'"):
        list(pack_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], bucket_bytes=64))
    with pytest.raises(ValueError, match=r"expected a torch\.Tensor"):
        list(pack_buckets([("a", [1.0])], bucket_bytes=64))
    b = next(pack_buckets([("a", torch.zeros(4))], bucket_bytes=64))
    with pytest.raises(ValueError, match="buffer"):
        Bucket.from_metadata(b.metadata_bytes(), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        list(unpack_bucket(Bucket(torch.zeros(8, dtype=torch.uint8), b.metas)))


def _meta_bytes(tensors, nbytes=64) -> bytes:
    import json

    return json.dumps({"nbytes": nbytes, "tensors": tensors}).encode()


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([{"name": "a", "shape": [-1, 4], "dtype": "float32", "offset": 0}], "non-negative int, got -1"),
        ([{"name": "a", "shape": [2.5], "dtype": "float32", "offset": 0}], "non-negative int, got 2.5"),
        ([{"name": "a", "shape": [2.0], "dtype": "float32", "offset": 0}], "non-negative int, got 2.0"),
        ([{"name": "a", "shape": ["4"], "dtype": "float32", "offset": 0}], "non-negative int, got '4'"),
        ([{"name": "a", "shape": [True], "dtype": "float32", "offset": 0}], "non-negative int, got True"),
        ([{"name": "a", "shape": [4], "dtype": "float32", "offset": 8.0}], "offset: expected a non-negative int"),
        ([{"name": "a", "shape": [4], "dtype": "float32", "offset": -4}], "offset: expected a non-negative int"),
        ([{"name": 3, "shape": [4], "dtype": "float32", "offset": 0}], "name: expected a str"),
        (
            [{"name": "a", "shape": [4], "dtype": "float32", "offset": 0},
             {"name": "b", "shape": [4], "dtype": "float32", "offset": 8}],
            "'a' and 'b' overlap",
        ),
        (
            [{"name": "a", "shape": [2], "dtype": "float32", "offset": 0},
             {"name": "a", "shape": [2], "dtype": "float32", "offset": 8}],
            "duplicate tensor name 'a'",
        ),
    ],
)
def test_metadata_with_bad_dims_overlaps_or_duplicates_is_refused(tensors, match):
    with pytest.raises(ValueError, match=match):
        metadata_from_bytes(_meta_bytes(tensors))


def test_bucket_views_refuse_overlapping_or_duplicate_metas():
    buf = torch.zeros(64, dtype=torch.uint8)
    overlap = [TensorMeta("a", (4,), torch.float32, 0), TensorMeta("b", (4,), torch.float32, 4)]
    with pytest.raises(ValueError, match="overlap"):
        list(unpack_bucket(Bucket(buf, overlap)))
    dup = [TensorMeta("a", (2,), torch.float32, 0), TensorMeta("a", (2,), torch.float32, 8)]
    with pytest.raises(ValueError, match="duplicate"):
        list(unpack_bucket(Bucket(buf, dup)))
    with pytest.raises(ValueError, match="non-negative int"):
        TensorMeta("a", (-3,), torch.float32, 0)
    # Empty tensors take no bytes: two of them at the same offset are fine (plan_buckets produces that).
    empty = [TensorMeta("e1", (0, 4), torch.float32, 0), TensorMeta("e2", (0,), torch.float32, 0)]
    assert [n for n, _ in unpack_bucket(Bucket(buf, empty))] == ["e1", "e2"]


def test_weight_manifest_with_bad_dims_or_duplicates_is_refused():
    import json

    from rlblocks.errors import SyncMismatchError, WeightUpdateError
    from rlblocks.sync.broadcast import _MAGIC, _parse_manifest

    def manifest(tensors):
        return json.dumps({"magic": _MAGIC, "version": 1, "bucket_bytes": 64, "tensors": tensors}).encode()

    assert _parse_manifest(manifest([["a", [2, 3], "float32"]]))[3][0].shape == (2, 3)
    for tensors, match in (
        ([["a", [2.5], "float32"]], "got 2.5"),
        ([["a", [-2], "float32"]], "got -2"),
        ([["a", [2], "float32"], ["a", [2], "float32"]], "duplicate"),
    ):
        with pytest.raises(SyncMismatchError, match=match) as e:
            _parse_manifest(manifest(tensors))
        assert isinstance(e.value, WeightUpdateError)


def test_direct_bytes_layout_puts_large_tensors_alone_where_they_come():
    sizes = [("s0", 10), ("big1", 300), ("s1", 20), ("s2", 30), ("big2", 256), ("s3", 200), ("s4", 100)]
    specs = [TensorMeta(n, (k,), torch.uint8) for n, k in sizes]
    plan = plan_buckets(specs, bucket_bytes=256, direct_bytes=256)
    assert [[(m.name, m.offset) for m in b] for b in plan] == [
        [("big1", 0)],
        [("big2", 0)],
        [("s0", 0), ("s1", 64), ("s2", 128)],  # filled around the direct ones, emitted when s3 overflows it
        [("s3", 0)],
        [("s4", 0)],
    ]
    assert sorted(m.name for b in plan for m in b) == sorted(n for n, _ in sizes)
    assert plan_buckets(specs, bucket_bytes=256) == plan_buckets(specs, bucket_bytes=256, direct_bytes=None)
    with pytest.raises(ValueError, match="direct_bytes"):
        plan_buckets(specs, bucket_bytes=256, direct_bytes=0)
