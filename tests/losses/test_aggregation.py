"""Aggregation: golden vector, loop reference, shard invariance with global normalisers."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlblocks.losses import AGG_MODES, aggregate

GOLDEN_L = torch.tensor([[1.0, 1, 1, 1], [2, 2, 0, 0]])
GOLDEN_M = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token-mean", 8 / 6),
        ("seq-mean-token-mean", 1.5),
        ("seq-mean-token-sum", 4.0),
        ("seq-mean-token-sum-norm", 1.0),
        ("token-sum", 8.0),
    ],
)
def test_golden_vector(mode, want):
    assert aggregate(GOLDEN_L, GOLDEN_M, mode=mode).item() == pytest.approx(want, abs=1e-4)
    assert aggregate(GOLDEN_L, GOLDEN_M.float(), mode=mode).item() == pytest.approx(want, abs=1e-4)


def ref_aggregate(x, m, mode):
    b, t = len(x), len(x[0])
    n_tok = sum(sum(r) for r in m)
    rows = [sum(x[i][j] for j in range(t) if m[i][j]) for i in range(b)]
    lens = [sum(m[i]) for i in range(b)]
    nonempty = sum(1 for n in lens if n > 0)
    if mode == "token-mean":
        return sum(rows) / max(n_tok, 1)
    if mode == "seq-mean-token-mean":
        return sum(r / n for r, n in zip(rows, lens) if n > 0) / max(nonempty, 1)
    if mode == "seq-mean-token-sum":
        return sum(rows) / max(nonempty, 1)
    if mode == "seq-mean-token-sum-norm":
        return sum(rows) / (b * t)
    return sum(rows)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_matches_loop_reference_and_ignores_nan_padding(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0, 0, 0], [0] * 6, [1] * 6, [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    want = ref_aggregate(x.tolist(), m.tolist(), mode)
    got = aggregate(torch.where(m, x, torch.nan), m, mode=mode)
    assert got.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_false_mask_is_zero_and_grad_is_finite(mode):
    x = torch.full((2, 3), float("nan"), dtype=torch.float64, requires_grad=True)
    out = aggregate(x, torch.zeros(2, 3, dtype=torch.bool), mode=mode)
    assert out.item() == 0.0
    zero = torch.tensor(0)
    kw = {"num_tokens": zero, "num_seqs": zero, "max_len": zero}
    assert aggregate(x, torch.zeros(2, 3, dtype=torch.bool), mode=mode, **kw).item() == 0.0
    (g,) = torch.autograd.grad(out, x)
    assert (g == 0).all()


def test_bf16_accumulates_in_fp32():
    x = torch.full((1, 4096), 1.0 + 2**-7, dtype=torch.bfloat16)
    out = aggregate(x, torch.ones(1, 4096, dtype=torch.bool), mode="token-sum")
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(4096 * (1.0 + 2**-7))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 7), min_size=2, max_size=10),
    cuts=st.lists(st.integers(0, 10), max_size=3),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(AGG_MODES),
    tensor_counts=st.booleans(),
)
def test_shard_invariance_with_global_normalisers(lengths, cuts, seed, mode, tensor_counts):
    b, t = len(lengths), 7
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64)
    m = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    x = torch.where(m, x, torch.inf)
    whole = aggregate(x, m, mode=mode)
    n_tok = m.sum()
    n_seq = (m.sum(-1) > 0).sum().clamp(min=1) if mode != "seq-mean-token-sum-norm" else torch.tensor(b)
    kw = {"num_tokens": n_tok.clamp(min=1), "num_seqs": n_seq, "max_len": t}
    if not tensor_counts:
        kw = {k: int(v) for k, v in kw.items()}
    bounds = sorted({0, b, *(min(c, b) for c in cuts)})
    total = sum(aggregate(x[lo:hi], m[lo:hi], mode=mode, **kw) for lo, hi in itertools.pairwise(bounds))
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
