"""The delta kernels (rlblocks.sync._bits) against independent references: zlib.crc32 of the same bytes, and a
plain element-wise comparison (torch.ne on integer views + nonzero) for the changed-element search."""

from __future__ import annotations

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
