"""CUDA-only checks of the Triton kernels at realistic shapes (skipped without a GPU; run by gpu_check.sh).

Sized for a cold start on one H200 (each kernel config compiles once): fp32 at 1e-5 (IEEE, one config), bf16 at
verl's tolerances (logp 1e-3, entropy 5e-3, gradients 2e-2)."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import (
    linear_token_logprobs,
    linear_token_logprobs_loss,
    linear_vocab_kl,
    token_logprobs,
    vocab_kl,
)

pytestmark = pytest.mark.gpu
BF16_TOL = {"lp": 1e-3, "ent": 5e-3, "grad": 2e-2}
FP32_TOL = {"lp": 1e-5, "ent": 1e-5, "grad": 1e-5}


def _inputs(ref, n, hdim, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=g).to(dtype).cuda()
    weight = (torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2).to(dtype).cuda()
    labels = ref.make_labels((n,), vocab, seed=seed).cuda()
    return hidden, weight, labels


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
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


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_fused_loss_cuda(ref, dtype, tol, monkeypatch):
    """The fused-loss path (gradient formed in the forward), over several row chunks, with a mask."""
    from rlblocks.kernels import _common

    monkeypatch.setattr(_common, "FUSED_CHUNK_BYTES", 256 * 32003 * 4)
    hidden, weight, labels = _inputs(ref, 1000, 512, 32003, dtype, seed=2)
    mask = torch.rand(1000, device="cuda") > 0.2
    coef = torch.randn(1000, device="cuda") / 1000
    ecoef = torch.randn(1000, device="cuda") / 1000
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    res = linear_token_logprobs_loss(h, w, labels, coef, entropy_coef=ecoef, mask=mask, temperature=0.9,
                                     backend="triton")  # fmt: skip
    res.loss.backward()
    keep = mask & (labels != ref.IGNORE)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = ref.linear(hr, wr, torch.where(keep, labels, ref.IGNORE), 0.9)
    want = (torch.where(keep, coef.double(), 0.0) * want_lp).sum() + (
        torch.where(keep, ecoef.double(), 0.0) * want_ent).sum()
    want.backward()
    ref.assert_close(res.logp, want_lp, tol["lp"], "logp")
    ref.assert_close(res.entropy, want_ent, tol["ent"], "entropy")
    # gradients of a mean over 1000 tokens are ~1e-3 of the per-token ones: compare relative to their size
    for got, exp, what in ((h.grad, hr.grad, "grad hidden"), (w.grad, wr.grad, "grad weight")):
        err = (got.double() - exp).abs().max() / exp.abs().max()
        assert err < tol["grad"], f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_kl_triton_cuda(ref, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    gtol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(1)
    s = (torch.randn(513, 50000, generator=g) * 2).to(dtype).cuda()
    t = (torch.randn(513, 50000, generator=g) * 2).to(dtype).cuda()
    s[:, :3000] = float("-inf")  # a masked vocabulary block: exact values, no NaN
    t[:, :3000] = float("-inf")
    labels = ref.make_labels((513,), 50000).cuda()
    labels = torch.where(labels == ref.IGNORE, labels, labels.clamp(min=3000))
    x = s.clone().requires_grad_()
    xr = torch.where(torch.isinf(s), -1e4, s.double()).requires_grad_()  # exp(-1e4) == 0 in float64
    lp, ent = token_logprobs(x, labels, return_entropy=True, backend="triton")
    wl, we = ref.token_logprobs(xr, labels)
    (lp.sum() + ent.sum()).backward()
    (wl.sum() + we.sum()).backward()
    ref.assert_close(lp, wl, tol, "logp")
    ref.assert_close(ent, we, 5 * tol, "entropy")
    ref.assert_close(x.grad, xr.grad, gtol, "grad logits")
    if dtype == torch.float32:
        return  # the KL row kernels: bf16 only (their fp32 math is the CPU interpreter tests')
    valid = labels != ref.IGNORE
    for kind in ("reverse", "jsd"):
        x = s.clone().requires_grad_()
        xr = torch.where(torch.isinf(s), -1e4, s.double()).requires_grad_()
        out = vocab_kl(x, t, kind=kind, labels=labels, backend="triton")
        want = ref.vocab_kl(xr, torch.where(torch.isinf(t), -1e4, t.double()), valid, kind)
        out.sum().backward()
        want.sum().backward()
        ref.assert_close(out, want, 5 * tol, f"{kind}")
        ref.assert_close(x.grad, xr.grad, gtol, f"{kind} grad")


def test_linear_kl_triton_cuda(ref):
    hs, ws, labels = _inputs(ref, 700, 256, 20011, torch.float32)
    ht, wt, _ = _inputs(ref, 700, 128, 20011, torch.float32, seed=5)
    valid = labels != ref.IGNORE
    for kind in ("forward", "jsd"):
        a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        ar, br = hs.double().requires_grad_(), ws.double().requires_grad_()
        out = linear_vocab_kl(a, b, ht, wt, kind=kind, labels=labels, backend="triton")
        want = ref.vocab_kl(ar @ br.T, ht.double() @ wt.double().T, valid, kind)
        out.sum().backward()
        want.sum().backward()
        ref.assert_close(out, want, 1e-5, kind)
        ref.assert_close(a.grad, ar.grad, 1e-5, f"{kind} grad hidden")
        ref.assert_close(b.grad, br.grad, 1e-5, f"{kind} grad weight")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_another_device_than_the_current_one(ref):
    hidden, weight, labels = _inputs(ref, 300, 128, 5000, torch.bfloat16)
    h1, w1, y1 = hidden.to("cuda:1").requires_grad_(), weight.to("cuda:1"), labels.to("cuda:1")
    with torch.cuda.device(0):
        lp = linear_token_logprobs(h1, w1, y1, backend="triton")
        lp.sum().backward()
    want = linear_token_logprobs(hidden, weight, labels, backend="triton")
    ref.assert_close(lp.cpu(), want.cpu(), 1e-6, "logp on cuda:1")


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_sampling_replay_cuda(ref, kind):
    """Sampling-mask replay on CUDA: ``sparse`` (top_k=20, top_p=0.8 everywhere: the kept sets come from the
    candidates, no kernel runs) and ``dense`` (some rows unfiltered: the Triton kernels take the thresholds),
    fp32 against the float64 processed distribution."""
    n, hdim, vocab, temp = 600, 256, 20011, 0.9
    hidden, weight, _ = _inputs(ref, n, hdim, vocab, torch.float32, seed=5)
    k = torch.full((n,), 20, device="cuda")
    p = torch.full((n,), 0.8, device="cuda")
    if kind == "dense":
        k[::7], p[::7] = -1, 1.0
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lsm = ref.processed((hr @ wr.T) / temp, k, p)
    g = torch.Generator(device="cuda").manual_seed(6)
    labels = torch.multinomial(lsm.detach().exp().float(), 1, generator=g).squeeze(1)
    labels[1::9] = torch.randint(0, vocab, (len(labels[1::9]),), device="cuda", generator=g)  # mostly outside
    valid = torch.ones(n, dtype=torch.bool, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, out = linear_token_logprobs(h, w, labels, temperature=temp, top_k=k, top_p=p, return_entropy=True,
                                         return_outside=True, backend="triton")  # fmt: skip
    want_lp, want_ent, want_out = ref.processed_outputs(lsm, labels, valid)
    assert torch.equal(out, want_out) and out.any()
    c1 = torch.randn(n, device="cuda", dtype=torch.float64)
    ((torch.where(out, 0.0, lp.double()) * c1).sum() + ent.double().sum()).backward()
    ((torch.where(want_out, 0.0, want_lp) * c1).sum() + want_ent.sum()).backward()
    keep = ~out
    ref.assert_close(lp[keep], want_lp[keep], FP32_TOL["lp"], "logp")
    ref.assert_close(ent, want_ent, FP32_TOL["ent"], "entropy")
    ref.assert_close(h.grad, hr.grad, 2e-5, "grad hidden")
    ref.assert_close(w.grad, wr.grad, 2e-5, "grad weight")
