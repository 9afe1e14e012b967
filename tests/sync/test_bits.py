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


NATIVE = NUMBA and _bits.native_available()


def _ref_gaps(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gap16 lists of ascending positions, by the definition: uint16 gaps clamped to 0xFFFF, escaped true values."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    return gaps.clamp(max=0xFFFF).to(torch.int32).to(torch.uint16), gaps[gaps >= 0xFFFF]


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64])
def test_native_delta_batch_equals_native_delta_per_tensor(monkeypatch, dtype):
    """One compiled call over many tensors (sizes around the 64-word groups, the 4096-element sample threshold,
    escaped gaps, a tensor dense enough for a mask) against native_delta of each alone and the elementwise
    reference; CRC-32 steps of 64 bytes so that the checksum pieces split groups."""
    monkeypatch.setattr(_bits, "SUB_BYTES", 64)
    g = torch.Generator().manual_seed(3)
    es = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, 5, 63, 64, 65, 511, 4095, 4096, 20_011, 300_001, 9_000]
    olds = [torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8).view(dtype) for n in sizes]
    news = [o.clone() for o in olds]
    for i, (n, t) in enumerate(zip(sizes, news)):
        m = torch.rand(n, generator=g) < (0.3 if i == len(sizes) - 1 else 0.03)  # the last one: dense
        if n == 300_001:
            m[:] = False
            m[[3, 70_000, 70_001, 200_000, n - 1]] = True  # gaps >= 0xFFFF: escaped
        m[-1] = True
        t.view(INT[es])[m] ^= 1
    snaps = [o.clone() for o in olds]
    got = _bits.native_delta_batch(list(zip(snaps, news)), update=True, with_crc=True)
    for n, old, new, snap, nat in zip(sizes, olds, news, snaps, got):
        if n == 9_000:
            assert nat is None and torch.equal(snap.view(INT[es]), old.view(INT[es]))  # left for the mask path
            continue
        ref = torch.ne(old.view(INT[es]), new.view(INT[es])).nonzero().squeeze(1)
        gaps, wide = _ref_gaps(ref)
        one = _bits.native_delta(old.clone(), new, update=True, with_crc=True)
        assert nat.count == one.count == ref.numel()
        assert torch.equal(nat.gaps, gaps) and torch.equal(nat.wide, wide)
        assert torch.equal(nat.values, new.view(INT[es])[ref]) and torch.equal(nat.values, one.values)
        assert nat.crc == one.crc == _zlib(new)
        assert torch.equal(snap.view(INT[es]), new.view(INT[es]))
    assert any(nat is not None and nat.nwide for nat in got)


def _check_ref(gaps: list[int], wide: list[int], n: int) -> tuple[int, bool, bool]:
    """gap16_check by the definition, in Python integers."""
    escapes, pos, ok, w = 0, -1, True, 0
    for g in gaps:
        if g == 0xFFFF:
            g = wide[w] if w < len(wide) else 1
            w += 1
            escapes += 1
        ok &= g >= 1
        pos += g
    return escapes, ok, pos < n


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
def test_gap16_check_against_python_reference():
    import numpy as np

    n = 300_000
    cases = [
        ([1, 5, 0xFFFF, 7], [70_000]),  # valid, one escape
        ([1, 0, 3], []),  # a zero gap: not increasing
        ([1, 0xFFFF, 2], []),  # an escape without its value
        ([1, 2], [9]),  # a value without its escape
        ([0xFFFF], [n + 1]),  # past the end
        ([0xFFFF, 1], [2**62]),  # huge: past the end, no overflow
        ([0xFFFF, 1], [-5]),  # negative: not increasing
        ([], []),
        ([0xFFFF], [n]),  # the last element
        ([0xFFFF, 1], [n]),  # one past it
    ]
    lists = []
    for gaps, wide in cases:
        ga, wa = np.array(gaps, np.uint16), np.array(wide, np.int64)
        lists.append((ga, wa, n))
        got = _bits.gap16_check(ga, wa, n)
        want = _check_ref(gaps, wide, n)
        if want[1]:  # with a bad gap the sum is meaningless; only "not increasing" is asserted then
            assert got == want, (gaps, wide)
        else:
            assert got[:2] == want[:2], (gaps, wide)
    assert _bits.gap16_check_many(lists) == [_bits.gap16_check(*x) for x in lists]


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
def test_gap16_apply_refuses_what_gap16_check_refuses_and_leaves_the_target_unchanged(monkeypatch):
    """The write loop checks each position before writing it: the hand-made cases of the check's test, and
    random lists broken at a random place (a zero or negative gap, an escape without its value, a value without
    its escape, a huge or past-the-end gap), are refused exactly when the Python reference refuses them; with
    saved values a refused list leaves the target as it was (its earlier writes undone), over checksum pieces of
    256 bytes; an accepted one writes what index assignment writes."""
    import numpy as np

    monkeypatch.setattr(_bits, "SUB_BYTES", 256)
    n = 300_000
    g = torch.Generator().manual_seed(17)
    rng = np.random.default_rng(17)
    cases = [([1, 5, 0xFFFF, 7], [70_000]), ([1, 0, 3], []), ([1, 0xFFFF, 2], []), ([1, 2], [9]),
             ([0xFFFF], [n + 1]), ([0xFFFF, 1], [2**62]), ([0xFFFF, 1], [-5]), ([0xFFFF], [n]), ([0xFFFF, 1], [n])]
    for _ in range(60):  # a valid list of ~1 % of the positions with escapes, then maybe one fault
        m = torch.rand(n, generator=g) < 0.01
        m[int(rng.integers(1000, n - 100_000)):][:int(rng.integers(0, 90_000))] = False
        gaps, wide = (x.tolist() for x in _ref_gaps(m.nonzero().squeeze(1)))
        q = int(rng.integers(0, len(gaps)))
        fault = int(rng.integers(0, 6))
        if fault == 1:
            gaps[q] = 0
        elif fault == 2:
            gaps[q] = 0xFFFF  # an escape whose value is missing (or shifted onto a later escape)
        elif fault == 3:
            wide = [*wide, 5]  # a value without its escape
        elif fault == 4:  # an escaped gap that is negative, or reaches past the end
            w = sum(x == 0xFFFF for x in gaps[:q])
            gaps[q], wide = 0xFFFF, [*wide[:w], int(rng.choice([-3, n, 2**62])), *wide[w + (gaps[q] == 0xFFFF):]]
        elif fault == 5:
            gaps[-1] = 0xFFFE  # past the end unless it lands inside
        cases.append((gaps, wide))
    refused = 0
    for gaps, wide in cases:
        esc, ok, in_range = _check_ref(gaps, wide, n)
        valid = ok and in_range and esc == len(wide)
        target = torch.randint(-30000, 30000, (n,), generator=g, dtype=torch.int16)
        before = target.clone()
        vals = torch.randint(-30000, 30000, (len(gaps),), generator=g, dtype=torch.int16)
        ga, wa = np.array(gaps, np.uint16), np.array(wide, np.int64)
        saved = np.empty(len(gaps), np.int16)
        if valid:
            _bits.gap16_apply(target.numpy(), ga, wa, vals.numpy(), saved, with_crc=True)
            before[torch.tensor(_positions(gaps, wide))] = vals
            assert torch.equal(target, before)
        else:
            refused += 1
            with pytest.raises(ValueError, match="not valid"):
                _bits.gap16_apply(target.numpy(), ga, wa, vals.numpy(), saved, with_crc=True)
            assert torch.equal(target, before), (gaps[:5], wide)
        # the batched call: None for a refused list, the target unchanged either way (the same values again)
        (crc,), _ = _bits.gap16_apply_many([(target.numpy(), ga, wa, vals.numpy())], keep=True, with_crc=True)
        assert (crc is None) == (not valid) and torch.equal(target, before)
    assert 20 < refused < len(cases)


def _positions(gaps: list[int], wide: list[int]) -> list[int]:
    out, pos, w = [], -1, 0
    for g in gaps:
        if g == 0xFFFF:
            g, w = wide[w], w + 1
        pos += g
        out.append(pos)
    return out


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_gap16_apply_writes_saves_and_checksums(monkeypatch, dtype):
    """Writes against index assignment, saved values against a gather, and the CRCs before / after against zlib,
    with 256-byte checksum pieces (changes on both sides of every piece boundary)."""
    monkeypatch.setattr(_bits, "SUB_BYTES", 256)
    g = torch.Generator().manual_seed(7)
    es = torch.empty(0, dtype=dtype).element_size()
    records, refs = [], []
    for n in (1, 300, 200_001):
        t = torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8).view(dtype)
        m = torch.rand(n, generator=g) < 0.05
        m[0] = m[-1] = True
        if n > 100_000:
            m[1000:150_000] = False  # an escaped gap
        idx = m.nonzero().squeeze(1)
        vals = torch.randint(0, 256, (idx.numel() * es,), generator=g, dtype=torch.uint8).view(INT[es])
        gaps, wide = _ref_gaps(idx)
        want = t.view(INT[es]).clone()
        want[idx] = vals
        refs.append((t.clone(), want, idx))
        records.append((t.view(INT[es]).numpy(), gaps.numpy(), wide.numpy(), vals.numpy()))
    crcs, saved = _bits.gap16_apply_many(records, keep=True, with_crc=True)
    for (before, want, idx), (target, *_), (cb, ca), old in zip(refs, records, crcs, saved):
        assert torch.equal(torch.from_numpy(target), want)
        assert torch.equal(torch.from_numpy(old), before.view(INT[es])[idx])
        assert cb == _zlib(before) and ca == _zlib(want)
    for (before, _, _), (target, gaps, wide, _), old in zip(refs, records, saved):  # undo: write the old back
        assert _bits.gap16_apply(target, gaps, wide, old, with_crc=True)[1] == _zlib(before)
        assert torch.equal(torch.from_numpy(target), before.view(INT[es]))


def _piece_crc_cases():
    """(bytes, offset, length, initial value): every length 0-700 (the fold's 256-byte threshold, its 128-byte
    steps and every tail), a long piece, unaligned starts, chained initial values."""
    import numpy as np

    rng = np.random.default_rng(11)
    buf = rng.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)
    for n in [*range(0, 701), 4095, 65_536, (1 << 20) + 13]:
        yield buf, int(rng.integers(0, 32)), n, int(rng.integers(0, 1 << 32))


def _check_piece_crc(fn_jit) -> None:
    fn = _bits._find_crc_fn()
    for buf, off, n, init in _piece_crc_cases():
        got = fn_jit(fn, init, buf.ctypes.data + off, n)
        assert got == zlib.crc32(buf[off : off + n].tobytes(), init), (off, n, init)


@pytest.mark.skipif(not NATIVE, reason="numba / isal not installed (the compiled loops are optional)")
def test_compiled_loops_piece_crc_equals_zlib():
    """What the compiled loops checksum each piece with (ISA-L, or the 256-bit fold where chosen)."""
    from rlblocks.sync import _native

    _check_piece_crc(_native.crc_piece)
    _check_piece_crc(_native.crc_narrow)


def _has_clmul256() -> bool:
    if not NATIVE:
        return False
    from rlblocks.sync import _native

    return _native.HAS_CLMUL256


@pytest.mark.skipif(not _has_clmul256(), reason="needs the compiled loops and a CPU with 256-bit VPCLMULQDQ")
def test_crc_folded_256_bits_at_a_time_equals_zlib():
    """The 256-bit carry-less-multiply fold (four registers, 128 bytes per step, the rest by ISA-L) against zlib."""
    from rlblocks.sync import _native

    _check_piece_crc(_native.crc_wide)
