"""Backward numerics of the fused-linear ops: grad_hidden accumulated in fp32 across vocab chunks, fp16 logits
gradients kept out of fp16's underflow range, and every Triton launch made on the inputs' device."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlblocks.kernels import linear_token_logprobs, linear_vocab_kl
from rlblocks.kernels._common import contract_grad_chunks, grad_scale, interpret_mode, triton_available

NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)


def test_grad_hidden_accumulates_in_fp32_across_chunks():
    """16 vocab chunks of a bf16 gradient block: grad_hidden equals the float64 product to fp32 rounding (a bf16
    round trip per chunk would leave ~2^-9 relative error per chunk)."""
    g = torch.Generator().manual_seed(0)
    n, hdim, v = 64, 32, 4096
    h = torch.randn(n, hdim, generator=g).bfloat16()
    w = torch.randn(v, hdim, generator=g).bfloat16()
    gz_full = torch.randn(n, v, generator=g).bfloat16()
    seen = []

    def fill(gz, c0, c):
        seen.append((c0, c))
        gz.copy_(gz_full[:, c0 : c0 + c])

    gh, gw = contract_grad_chunks(h, w, fill, True, True, budget_bytes=n * 2 * 256)
    assert len(seen) == 16 and gh.dtype == torch.float32 and gw.dtype == torch.bfloat16
    want_h = gz_full.double() @ w.double()
    want_w = gz_full.double().T @ h.double()
    assert (gh.double() - want_h).abs().max() <= 1e-5 * want_h.abs().max()
    # grad_weight rows are written once per chunk: a single bf16 rounding of an fp32-accumulated product
    assert (gw.double() - want_w).abs().max() <= 2.0**-8 * want_w.abs().max()


def test_grad_scale_is_a_power_of_two_that_fits_fp16():
    bound = torch.tensor([3e-7, 1e-9, 0.0])
    s = grad_scale(bound, torch.float16)
    assert torch.log2(s).item() == int(torch.log2(s).item())  # exact scaling and unscaling
    assert 2.0**13 < (s * bound.max()).item() <= 2.0**14
    assert grad_scale(bound, torch.bfloat16).item() == 1.0 and grad_scale(bound, torch.float32).item() == 1.0


def _rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _fp16_case(seed=1, n=17, hdim=32, vocab=2048):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=g).half()
    weight = (torch.randn(vocab, hdim, generator=g) / hdim**0.5).half()
    labels = torch.randint(0, vocab, (n,), generator=g)
    # upstream grads ~1e-4 (a mean over ~10k tokens): p·g is ~5e-8 for a typical vocabulary entry, below fp16's
    # smallest subnormal step (6e-8) — an unscaled fp16 block flushes most of the softmax term to 0
    c = torch.rand(n, generator=g, dtype=torch.float64) * 1e-4
    return hidden, weight, labels, c


def _fp16_linear_errors(ref, hidden, weight, labels, c):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_token_logprobs(h, w, labels, return_entropy=True, backend="triton")
    ((lp.double() + ent.double()) * c).sum().backward()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = ref.linear(hr, wr, labels)
    ((want_lp + want_ent) * c).sum().backward()
    return _rel_err(h.grad, hr.grad), _rel_err(w.grad, wr.grad)


@NEEDS_TRITON
def test_fp16_logits_gradient_does_not_underflow(ref, monkeypatch):
    """The Triton path stores an fp16 gradient block scaled by a power of two and unscales it after the
    fp32-output GEMMs: the gradients match float64 to fp16 output rounding. With the scale disabled the same
    check fails (the softmax term underflows), so the test sees the difference."""
    import rlblocks.kernels._linear as llp

    hidden, weight, labels, c = _fp16_case()
    err_h, err_w = _fp16_linear_errors(ref, hidden, weight, labels, c)
    assert err_h < 2e-3 and err_w < 2e-3, (err_h, err_w)
    monkeypatch.setattr(llp, "grad_scale", lambda bound, dtype, target=0.0: torch.ones(1))
    err_h_unscaled, _ = _fp16_linear_errors(ref, hidden, weight, labels, c)
    assert err_h_unscaled > 5e-3, err_h_unscaled
    monkeypatch.undo()

    # the KL op's scaled path too (its gradients are ~100x smaller: a larger upstream grad keeps the fp16 outputs
    # themselves above the subnormal range)
    c = c * 100
    weight = weight[:256].contiguous()
    hs, ws = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ht, wt = hidden.flip(0).contiguous(), weight.flip(0).contiguous()
    (linear_vocab_kl(hs, ws, ht, wt, kind="reverse", backend="triton").double() * c).sum().backward()
    a, b = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = ref.vocab_kl(a @ b.T, ht.double() @ wt.double().T, torch.ones(len(c), dtype=torch.bool), "reverse")
    (want * c).sum().backward()
    assert _rel_err(hs.grad, a.grad) < 2e-3 and _rel_err(ws.grad, b.grad) < 2e-3


@NEEDS_TRITON
def test_every_launch_happens_under_the_device_guard(monkeypatch, ref):
    """Triton launches on the current CUDA device; each op makes the inputs' device current around each launch."""
    import rlblocks.kernels._linear as llp
    import rlblocks.kernels.linear_kl as lkl
    import rlblocks.kernels.logprobs as tlp

    state = {"inside": None, "launches": []}

    @contextlib.contextmanager
    def guard(t):
        state["inside"] = t.device
        try:
            yield
        finally:
            state["inside"] = None

    for mod in (llp, lkl, tlp):
        monkeypatch.setattr(mod, "device_guard", guard)
    for kern in (llp._linear_logprobs_fwd_kernel, llp._linear_logprobs_bwd_kernel, lkl._linear_kl_fwd_kernel,
                 lkl._linear_kl_bwd_kernel, tlp._token_logprobs_fwd_kernel, tlp._token_logprobs_bwd_kernel):
        orig = kern.run

        def run(*args, _orig=orig, _name=kern.fn.__name__, **kwargs):
            state["launches"].append((_name, state["inside"]))
            return _orig(*args, **kwargs)

        monkeypatch.setattr(kern, "run", run)
    h = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(70, 16, requires_grad=True)
    y = ref.make_labels((9,), 70)
    linear_token_logprobs(h, w, y, backend="triton").sum().backward()
    linear_vocab_kl(h, w, h.detach(), w.detach(), backend="triton").sum().backward()
    from rlblocks.kernels import token_logprobs

    token_logprobs((h @ w.T).detach().requires_grad_(), y, backend="triton").sum().backward()
    names = {n for n, _ in state["launches"]}
    assert len(names) == 6, names
    assert all(dev == h.device for _, dev in state["launches"]), state["launches"]
