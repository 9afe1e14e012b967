"""CUDA-only checks of the Triton kernels at realistic shapes (skipped without a GPU; run by gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import linear_token_logprobs, linear_vocab_kl, token_logprobs, vocab_kl

pytestmark = pytest.mark.gpu
BF16_TOL = {"lp": 1e-3, "ent": 5e-3, "grad": 2e-2}  # DESIGN §3 (verl's bf16 tolerances)


def _inputs(ref, n, hdim, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=g).to(dtype).cuda()
    weight = (torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2).to(dtype).cuda()
    labels = ref.make_labels((n,), vocab, seed=seed).cuda()
    return hidden, weight, labels


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, {"lp": 1e-5, "ent": 1e-5, "grad": 1e-5}),
                                            (torch.bfloat16, BF16_TOL)])
@pytest.mark.parametrize("entropy", [False, True])
def test_linear_triton_cuda(ref, dtype, tol, entropy):
    hidden, weight, labels = _inputs(ref, 1000, 512, 32003, dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    out = linear_token_logprobs(h, w, labels, temperature=0.9, return_entropy=entropy, backend="triton")
    want_lp, want_ent = ref.linear(hr, wr, labels, 0.9)
    c1 = torch.randn(1000, device="cuda", dtype=torch.float64)
    lp = out[0] if entropy else out
    ((lp.double() * c1).sum() + (out[1].double().sum() if entropy else 0)).backward()
    ((want_lp * c1).sum() + (want_ent.sum() if entropy else 0)).backward()
    ref.assert_close(lp, want_lp, tol["lp"], "logp")
    if entropy:
        ref.assert_close(out[1], want_ent, tol["ent"], "entropy")
    ref.assert_close(h.grad, hr.grad, tol["grad"], "grad hidden")
    ref.assert_close(w.grad, wr.grad, tol["grad"], "grad weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_kl_triton_cuda(ref, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    gtol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(1)
    s = (torch.randn(513, 50000, generator=g) * 2).to(dtype).cuda()
    t = (torch.randn(513, 50000, generator=g) * 2).to(dtype).cuda()
    labels = ref.make_labels((513,), 50000).cuda()
    x = s.clone().requires_grad_()
    xr = s.double().requires_grad_()
    lp, ent = token_logprobs(x, labels, return_entropy=True, backend="triton")
    wl, we = ref.token_logprobs(xr, labels)
    (lp.sum() + ent.sum()).backward()
    (wl.sum() + we.sum()).backward()
    ref.assert_close(lp, wl, tol, "logp")
    ref.assert_close(ent, we, 5 * tol, "entropy")
    ref.assert_close(x.grad, xr.grad, gtol, "grad logits")
    valid = labels != ref.IGNORE
    for kind in ("forward", "reverse", "jsd"):
        x = s.clone().requires_grad_()
        xr = s.double().requires_grad_()
        out = vocab_kl(x, t, kind=kind, labels=labels, backend="triton")
        want = ref.vocab_kl(xr, t.double(), valid, kind)
        out.sum().backward()
        want.sum().backward()
        ref.assert_close(out, want, 5 * tol, f"{kind}")
        ref.assert_close(x.grad, xr.grad, gtol, f"{kind} grad")


def test_linear_kl_triton_cuda(ref):
    hs, ws, labels = _inputs(ref, 700, 256, 20011, torch.float32)
    ht, wt, _ = _inputs(ref, 700, 128, 20011, torch.float32, seed=5)
    valid = labels != ref.IGNORE
    for kind in ("forward", "reverse", "jsd"):
        a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        ar, br = hs.double().requires_grad_(), ws.double().requires_grad_()
        out = linear_vocab_kl(a, b, ht, wt, kind=kind, labels=labels, backend="triton")
        want = ref.vocab_kl(ar @ br.T, ht.double() @ wt.double().T, valid, kind)
        out.sum().backward()
        want.sum().backward()
        ref.assert_close(out, want, 1e-5, kind)
        ref.assert_close(a.grad, ar.grad, 1e-5, f"{kind} grad hidden")
        ref.assert_close(b.grad, br.grad, 1e-5, f"{kind} grad weight")
