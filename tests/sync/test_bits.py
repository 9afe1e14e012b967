"""The delta kernels (rlblocks.sync._bits) against independent references: zlib.crc32 of the same bytes, and a
plain element-wise comparison (torch.ne on integer views + nonzero) for the changed-element search."""

from __future__ import annotations

import importlib.util
import os
import zlib

import pytest
import torch

from rlblocks.sync import _bits
from rlblocks.sync._bits import changed_indices, crc32_combine, crc32_tensor

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zlib(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(("la", "lb"), [(0, 1), (1, 0), (1, 1), (7, 1000), (4096, 4096), (3, (1 << 20) + 5)])
def test_crc32_combine_equals_zlib_of_the_concatenation(la, lb):
    a, b = os.urandom(la), os.urandom(lb)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 KiB and two worker threads, so that small tensors exercise the chunked, threaded paths."""
    monkeypatch.setattr(_bits, "CHUNK_BYTES", 4096)
    monkeypatch.setenv("RLBLOCKS_SYNC_THREADS", "2")


@pytest.mark.parametrize("numel", [0, 1, 1023, 4096, 100_003])
def test_crc32_tensor_equals_zlib(small_chunks, numel):
    t = torch.randn(numel, dtype=torch.float64).to(torch.float32)
    assert crc32_tensor(t) == _zlib(t)
    assert crc32_tensor(t[1:]) == _zlib(t[1:])  # unaligned start
    assert crc32_tensor(t.reshape(1, -1).t().t()) == _zlib(t)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("offset", [0, 1])
def test_changed_indices_equals_elementwise_reference(small_chunks, dtype, density, offset):
    g = torch.Generator().manual_seed(0)
    n = 20_011
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, ((n + 1) * es,), generator=g, dtype=torch.uint8)
    old = raw.view(dtype)[offset : offset + n]  # offset 1: not 8-byte aligned, element path
    new = old.clone()
    m = torch.rand(n, generator=g) < density
    new.view(INT[es])[m] ^= 1  # flips one bit: -0.0/+0.0 and NaN payload changes look like this too
    ref = torch.ne(old.view(INT[es]), new.view(INT[es])).nonzero().squeeze(1)
    snap = old.clone()
    idx, vals, crc = changed_indices(snap, new, update=True, with_crc=True)
    assert torch.equal(idx, ref)
    assert torch.equal(vals.view(INT[es]), new.view(INT[es])[ref])
    assert torch.equal(snap.view(INT[es]), new.view(INT[es]))  # snapshot brought up to date
    assert crc == _zlib(new)


NUMBA = importlib.util.find_spec("numba") is not None


@pytest.mark.skipif(not NUMBA, reason="numba is not installed (the native loop is optional)")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 2e-5, 0.001, 0.03, 0.3])
@pytest.mark.parametrize("n", [5, 20_011, 300_001])
def test_native_delta_equals_elementwise_reference(small_chunks, dtype, density, n):
    """gap16 positions (escapes across chunk boundaries included: 4 kB chunks), values, snapshot update and CRC
    of the compiled loop against a plain elementwise reference in int64."""
    g = torch.Generator().manual_seed(n)
    es = torch.empty(0, dtype=dtype).element_size()
    old = torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8).view(dtype)
    new = old.clone()
    m = torch.rand(n, generator=g) < density
    if density == 2e-5 and n > 70_000:  # escaped gaps for sure: 69997, 129999, 100000 (>= 0xFFFF), across chunks
        m[:] = False
        m[[3, 70_000, 70_001, 200_000]] = True
    m[-1] = density > 0  # a change in the tail after the last whole word
    new.view(INT[es])[m] ^= 1
    snap = old.clone()
    nat = _bits.native_delta(snap, new, update=True, with_crc=True)
    ref = torch.ne(old.view(INT[es]), new.view(INT[es])).nonzero().squeeze(1)
    gaps = torch.diff(ref, prepend=ref.new_full((1,), -1))
    assert nat.count == ref.numel()
    assert torch.equal(nat.gaps.to(torch.int64), gaps.clamp(max=0xFFFF))
    assert torch.equal(nat.wide, gaps[gaps >= 0xFFFF])
    if density == 2e-5 and n > 70_000:
        assert nat.nwide > 0  # the sparse case really has escaped gaps
    assert torch.equal(nat.indices(), ref)
    assert torch.equal(nat.values, new.view(INT[es])[ref])
    assert torch.equal(snap.view(INT[es]), new.view(INT[es]))
    assert nat.crc == _zlib(new)


@pytest.mark.skipif(not NUMBA, reason="numba is not installed (the native loop is optional)")
def test_native_delta_declines_where_it_does_not_apply(monkeypatch):
    raw = torch.zeros(65, dtype=torch.uint8)
    assert _bits.native_delta(raw[1:], raw[1:].clone()) is None  # not 8-byte aligned: the torch path takes it
    monkeypatch.setenv("RLBLOCKS_SYNC_NATIVE", "0")
    assert _bits.native_delta(raw[:64], raw[:64].clone()) is None
