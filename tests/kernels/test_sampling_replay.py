"""Sampling-mask replay (top-k / top-p) in token_logprobs and linear_token_logprobs, against a float64 reference that
applies vLLM's sampler rule literally (``ref.processed`` in conftest.py: sort ascending, drop where the inclusive
cumulative sum is <= 1 − p), on the torch path and on the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.kernels import linear_token_logprobs, token_logprobs
from rlblocks.kernels._common import interpret_mode, triton_available
from rlblocks.kernels._sampling import check_sampling, dense_thresholds, mask_below

NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]


def _params(n, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "both":
        return 20, 0.8
    if kind == "k":
        return 7, None
    if kind == "p":
        return None, 0.9
    if kind == "p_wide":  # nucleus much wider than the 64 candidates: the full-sort path
        return None, 0.995
    if kind == "per_token":
        k = torch.randint(-1, 40, (n,), generator=g)
        p = torch.rand(n, generator=g) * 0.9 + 0.1
        p[::5] = 1.0
        return k, p
    raise AssertionError(kind)


def _flat(x, n, fill, dtype):
    if x is None:
        return torch.full((n,), fill, dtype=dtype)
    if isinstance(x, torch.Tensor):
        return x.to(dtype)
    return torch.full((n,), x, dtype=dtype)


def _labels(lsm, n, v, seed):
    """Labels drawn from the processed distribution (what an engine samples), a few from outside it, some
    ignored."""
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(lsm.exp().float(), 1, generator=g).squeeze(1)
    y[1::6] = torch.randint(0, v, (len(y[1::6]),), generator=g)  # mostly outside the kept set
    y[0] = -100
    y[4::9] = -100
    return y


@pytest.mark.parametrize("kind", ["both", "k", "p", "p_wide", "per_token", "two_stage"])
def test_thresholds_select_vllm_kept_set(ref, kind):
    n, v = 48, 700
    z = torch.randn(n, v, generator=torch.Generator().manual_seed(1)) * 2.5
    if kind == "two_stage":  # nuclei past the 64 candidates, some settled by the wider top-k, some sorted whole
        v = 3000
        z = torch.randn(n, v, generator=torch.Generator().manual_seed(1)) * 1.5
        k, p = None, torch.tensor([0.6, 0.999] * (n // 2))
        lsm = ref.processed(z, torch.full((n,), -1), p)
        sizes = torch.isfinite(lsm).sum(1)
        assert (sizes[0::2] > 64).all() and (sizes[0::2] < 1024).all() and (sizes[1::2] >= 1024).all()
    else:
        k, p = _params(n, kind)
    sm = check_sampling(k, p, torch.Size([n]), v, torch.ones(n, dtype=torch.bool))
    tau = dense_thresholds(z.clone(), sm)
    got = mask_below(z.clone(), tau)
    want = ref.processed(z, _flat(k, n, -1, torch.long), _flat(p, n, 1.0, torch.float32))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    if kind == "p_wide":
        assert torch.isfinite(want).sum(1).min() > 64  # really exercises the rows the candidates cannot settle


def test_top_k_ties_are_kept_and_off_values_change_nothing():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]])
    lp = token_logprobs(z, torch.tensor([5]), top_k=2, backend="torch")
    # ties with the 2nd largest value (2.0, three of them) are all kept: p = e^2 / (e^3 + 3 e^2)
    want = 2.0 - torch.logsumexp(torch.tensor([3.0, 2.0, 2.0, 2.0]).double(), 0)
    assert abs(lp.item() - want.item()) < 1e-6
    x = torch.randn(5, 50)
    y = torch.randint(0, 50, (5,))
    base = token_logprobs(x, y, return_entropy=True, backend="torch")
    for k, p in ((None, None), (-1, 1.0), (0, None), (50, 1.0), (1000, None)):
        out = token_logprobs(x, y, top_k=k, top_p=p, return_entropy=True, backend="torch")
        assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])


def _check(lp, ent, out, want_lp, want_ent, want_out, valid, atol=1e-5):
    assert torch.equal(out, want_out)
    assert want_out.any() and (~want_out & valid).any()
    assert torch.isneginf(lp[out]).all()
    keep = valid & ~out
    assert (lp[keep].double() - want_lp[keep]).abs().max() < atol
    assert (ent.double() - want_ent).abs().max() < atol
    assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all()


@pytest.mark.parametrize("kind", ["both", "per_token", "p_wide"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_replay_matches_fp64(ref, small_chunks, backend, kind):
    n, v, temp = 41, 300, 0.7
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(2)) * 3
    k, p = _params(n, kind)
    kf, pf = _flat(k, n, -1, torch.long), _flat(p, n, 1.0, torch.float32)
    xr = logits.double().requires_grad_()
    lsm = ref.processed(xr / temp, kf, pf)
    y = _labels(lsm.detach(), n, v, 3)
    valid = y != -100
    logits[~valid] = float("nan")  # padding may hold garbage
    x = logits.clone().requires_grad_()
    lp, ent, out = token_logprobs(x, y, temperature=temp, top_k=k, top_p=p, return_entropy=True,
                                  return_outside=True, backend=backend)  # fmt: skip
    want_lp, want_ent, want_out = ref.processed_outputs(lsm, y, valid)
    _check(lp, ent, out, want_lp.detach(), want_ent.detach(), want_out, valid)
    # gradients: the loss uses logp only where the label is kept (the documented way to drop outside labels)
    c1, c2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    ((torch.where(out, 0.0, lp.double()) * c1).sum() + (ent.double() * c2).sum()).backward()
    ((torch.where(want_out, 0.0, want_lp) * c1).sum() + (torch.where(valid, want_ent, 0.0) * c2).sum()).backward()
    assert (x.grad.double() - xr.grad).abs().max() < 1e-5 * max(1.0, xr.grad.abs().max().item())
    assert (x.grad[~valid] == 0).all()
    assert (x.grad[torch.isneginf(lsm.detach())] == 0).all()  # gradients through kept tokens only


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_label_gets_no_gradient_through_logp(backend):
    x = torch.tensor([[4.0, 3.0, 0.0, -1.0], [4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    lp, out = token_logprobs(x, torch.tensor([2, 1]), top_k=2, return_outside=True, backend=backend)
    assert out.tolist() == [True, False] and torch.isneginf(lp[0]) and torch.isfinite(lp[1])
    lp[1].backward(retain_graph=True)
    assert (x.grad[0] == 0).all() and x.grad[1, 2:].eq(0).all() and x.grad[1, :2].ne(0).all()
    (g,) = torch.autograd.grad(lp.sum(), x)  # a −inf loss, but the backward stays finite
    assert torch.isfinite(g).all() and (g[0] == 0).all()


@pytest.mark.parametrize("kind", ["both", "per_token"])
@pytest.mark.parametrize(("backend", "n", "hdim", "v"), [("torch", 70, 48, 530),
                                                         pytest.param("triton", 37, 32, 200, marks=NEEDS_TRITON)])
def test_linear_token_logprobs_replay_matches_fp64(ref, small_chunks, backend, n, hdim, v, kind):
    temp = 0.8
    g = torch.Generator().manual_seed(4)
    h = torch.randn(n, hdim, generator=g)
    w = torch.randn(v, hdim, generator=g) * 0.6
    k, p = _params(n, kind, seed=5)
    kf, pf = _flat(k, n, -1, torch.long), _flat(p, n, 1.0, torch.float32)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    lsm = ref.processed((hr @ wr.T) / temp, kf, pf)
    y = _labels(lsm.detach(), n, v, 6)
    valid = y != -100
    hr_masked = torch.where(valid.unsqueeze(1), hr, 0.0)
    lsm = ref.processed((hr_masked @ wr.T) / temp, kf, pf)
    h[~valid] = float("nan")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent, out = linear_token_logprobs(hh, ww, y, temperature=temp, top_k=k, top_p=p, return_entropy=True,
                                         return_outside=True, backend=backend)  # fmt: skip
    want_lp, want_ent, want_out = ref.processed_outputs(lsm, y, valid)
    _check(lp, ent, out, want_lp.detach(), want_ent.detach(), want_out, valid)
    c1, c2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    ((torch.where(out, 0.0, lp.double()) * c1).sum() + (ent.double() * c2).sum()).backward()
    ((torch.where(want_out, 0.0, want_lp) * c1).sum() + (torch.where(valid, want_ent, 0.0) * c2).sum()).backward()
    assert (hh.grad.double() - hr.grad).abs().max() < 2e-5
    assert (ww.grad.double() - wr.grad).abs().max() < 2e-5 * max(1.0, wr.grad.abs().max().item())
    assert (hh.grad[~valid] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_matches_token_logprobs_and_no_grad(backend):
    n, hdim, v = 24, 16, 150
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(n, hdim, generator=g), torch.randn(v, hdim, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[::2] = (h @ w.T)[::2].argmax(1)  # kept labels, the others mostly outside
    a = linear_token_logprobs(h, w, y, top_k=10, top_p=0.7, return_entropy=True, backend=backend)
    b = token_logprobs(h @ w.T, y, top_k=10, top_p=0.7, return_entropy=True, backend=backend)
    fin = torch.isfinite(b[0])
    assert torch.equal(torch.isfinite(a[0]), fin) and (~fin).any()
    assert (a[0][fin] - b[0][fin]).abs().max() < 1e-5 and (a[1] - b[1]).abs().max() < 1e-5


def test_bad_sampling_arguments_raise():
    x, y = torch.randn(4, 10), torch.randint(0, 10, (4,))
    bad = (
        ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
        ({"top_k": torch.ones(3, dtype=torch.long)}, "top_k"), ({"top_p": torch.ones(4, dtype=torch.long)}, "top_p"),
        ({"top_p": torch.tensor([0.5, 0.5, 0.0, 0.5])}, "top_p"),
    )  # fmt: skip
    for kw, word in bad:
        with pytest.raises(ArgumentError, match=word):
            token_logprobs(x, y, backend="torch", **kw)
    with pytest.raises(ArgumentError, match="top_k"):
        linear_token_logprobs(torch.randn(4, 3), torch.randn(10, 3), y, top_k=1.0, backend="torch")
    # a top_p of 0 at an ignored position is never read
    token_logprobs(x, torch.tensor([1, 2, -100, 3]), top_p=torch.tensor([0.5, 0.5, 0.0, 0.5]), backend="torch")


@pytest.mark.parametrize("op", ["token", "linear"])
def test_sparse_and_dense_chunks_in_one_call(ref, small_chunks, op):
    """Chunks whose kept sets lie among the candidates take the sparse path (no logits recomputation in the
    backward), others the masked dense one; both in one call, against float64."""
    from rlblocks.kernels import _linear, logprobs

    n, hdim, v, temp = 96, 24, 400, 1.1
    g = torch.Generator().manual_seed(8)
    h, w = torch.randn(n, hdim, generator=g), torch.randn(v, hdim, generator=g) * 0.7
    k = torch.full((n,), 12)
    p = torch.full((n,), 0.85)
    k[60:], p[60:] = -1, torch.where(torch.arange(n - 60) % 3 == 0, 1.0, 0.9)  # off rows, and top-p alone
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    lsm = ref.processed((hr @ wr.T) / temp, k, p)
    y = _labels(lsm.detach(), n, v, 9)
    valid = y != -100
    xr = torch.where(valid.unsqueeze(1), hr, 0.0) @ wr.T
    lsm = ref.processed(xr / temp, k, p)
    want_lp, want_ent, want_out = ref.processed_outputs(lsm, y, valid)
    if op == "token":
        x = (h @ w.T).detach().requires_grad_()
        rep = logprobs._fwd_torch(x.detach(), y, valid, 1 / temp, True, check_sampling(k, p, y.shape, v, valid))[3]
        lp, ent, out = token_logprobs(x, y, temperature=temp, top_k=k, top_p=p, return_entropy=True,
                                      return_outside=True, backend="torch")  # fmt: skip
        leaves, refs = (x,), (xr,)
        xr.retain_grad()
    else:
        x, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        idx = torch.where(valid, y, 0)
        rep = _linear._fwd_stats_torch(h, w, idx, valid, 1 / temp, True,
                                       check_sampling(k, p, y.shape, v, valid))[4]  # fmt: skip
        lp, ent, out = linear_token_logprobs(x, ww, y, temperature=temp, top_k=k, top_p=p, return_entropy=True,
                                             return_outside=True, backend="torch")  # fmt: skip
        leaves, refs = (x, ww), (hr, wr)
    assert rep.sparse[:40].all() and not rep.sparse[40:].any()  # chunks of 40 rows: the first sparse, later dense
    _check(lp, ent, out, want_lp.detach(), want_ent.detach(), want_out, valid)
    c1, c2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    ((torch.where(out, 0.0, lp.double()) * c1).sum() + (ent.double() * c2).sum()).backward()
    ((torch.where(want_out, 0.0, want_lp) * c1).sum() + (torch.where(valid, want_ent, 0.0) * c2).sum()).backward()
    for got, ref in zip(leaves, refs, strict=True):
        assert (got.grad.double() - ref.grad).abs().max() < 2e-5 * max(1.0, ref.grad.abs().max().item())
