"""−inf logits (masked vocabulary entries, e.g. a top-k / top-p sampling mask) are valid input: exact values and
gradients against float64 references that leave probability-0 entries out, on both backends."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import token_logprobs, vocab_kl
from rlblocks.kernels._common import interpret_mode, triton_available

NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]
NEG = float("-inf")
# The CPU interpreter evaluates both sides of every tl.where with numpy, so the guarded −inf − (−inf) and log(0)
# branches warn there (on a GPU they are silent); the values that are kept are checked below.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _masked_logits(n, v, frac, seed, *, whole_block=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3
    banned = torch.rand(n, v, generator=g) < frac
    if whole_block:
        banned[:, : min(v, 160)] = True  # a whole vocab block (> BLOCK_V of the interpreter) is −inf
        banned[:, -1] = False
    x[banned] = NEG
    return x, banned


def _finite64(x):
    """float64 copy with −inf replaced by −1e4: exp(−1e4) is exactly 0 in float64 and every 0·x is a plain 0, so
    the textbook formulas (and their autograd) give the exact values of the −inf input."""
    return torch.where(torch.isinf(x), -1e4, x.double())


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_with_neg_inf(ref, backend):
    n, v = (23, 300) if backend == "triton" else (64, 1000)
    x, banned = _masked_logits(n, v, 0.4, 0)
    labels = ref.make_labels((n,), v, seed=0)
    rows = torch.arange(n)
    ok = labels != ref.IGNORE
    labels = torch.where(ok & banned[rows, labels.clamp(min=0)], v - 1, labels)  # labels on allowed tokens
    xx = x.clone().requires_grad_()
    lp, ent = token_logprobs(xx, labels, temperature=0.7, return_entropy=True, backend=backend)
    c1, c2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    ((lp.double() * c1) + (ent.double() * c2)).sum().backward()
    xr = _finite64(x).requires_grad_()
    lsm = torch.log_softmax(xr / 0.7, -1)
    want_lp = torch.where(ok, lsm[rows, labels.clamp(min=0)], 0.0)
    want_ent = torch.where(ok, -(lsm.exp() * lsm).sum(-1), 0.0)
    ((want_lp * c1) + (want_ent * c2)).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(xx.grad).all()
    ref.assert_close(lp, want_lp, 1e-5, "logp")
    ref.assert_close(ent, want_ent, 1e-5, "entropy")
    ref.assert_close(xx.grad, xr.grad, 1e-5, "grad")
    assert (xx.grad[banned] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_at_neg_inf_gives_neg_inf(backend):
    x = torch.tensor([[0.0, NEG, 1.0, 2.0]]).repeat(2, 1)
    lp = token_logprobs(x, torch.tensor([1, 2]), backend=backend)
    assert lp[0] == NEG and torch.isfinite(lp[1])


def _ref_kl(zs, zt, kind, beta):
    lq, lp = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    q, p = lq.exp(), lp.exp()
    if kind == "forward":
        return (p * (lp - lq)).sum(-1)
    if kind == "reverse":
        return (q * (lq - lp)).sum(-1)
    m = beta * p + (1 - beta) * q
    lm = torch.where(m > 0, m, 1.0).log()
    return beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)


@pytest.mark.parametrize("kind", ["forward", "reverse", "jsd"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_kl_with_neg_inf(ref, backend, kind):
    """A shared mask on both sides, plus −inf on the side where it keeps the divergence finite: teacher-only for
    forward KL and JSD, student-only for reverse KL."""
    n, v = (19, 300) if backend == "triton" else (40, 800)
    s, banned = _masked_logits(n, v, 0.3, 1)
    t = torch.randn(n, v, generator=torch.Generator().manual_seed(2)) * 2
    t[banned] = NEG
    extra = torch.rand(n, v, generator=torch.Generator().manual_seed(3)) < 0.1
    extra[:, -1] = False
    (s if kind == "reverse" else t)[extra] = NEG
    ss = s.clone().requires_grad_()
    out = vocab_kl(ss, t, kind=kind, beta=0.3, temperature=0.9, backend=backend)
    sr = _finite64(s).requires_grad_()
    want = _ref_kl(sr / 0.9, _finite64(t) / 0.9, kind, 0.3)
    c = torch.randn(n, dtype=torch.float64)
    (out.double() * c).sum().backward()
    (want * c).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(ss.grad).all()
    ref.assert_close(out, want, 1e-5, f"{kind} value")
    ref.assert_close(ss.grad, sr.grad, 1e-5, f"{kind} grad")
