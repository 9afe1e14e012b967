"""linear_token_logprobs_loss (the fused-loss path: logits gradient formed in the forward) vs float64."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import linear_token_logprobs, linear_token_logprobs_loss
from rlblocks.kernels._common import interpret_mode, triton_available

NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)
# The interpreter evaluates both sides of the −inf-guarded tl.where with numpy (warnings only; values checked).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _inputs(ref, lead, hdim, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, hdim, generator=g)
    weight = torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2
    labels = ref.make_labels(lead, vocab, seed=seed)
    mask = torch.rand(lead, generator=g) > 0.25
    hidden[labels == ref.IGNORE] = float("nan")  # padding garbage: must not leak
    coef = torch.randn(lead, generator=g) / 50
    ecoef = torch.randn(lead, generator=g) / 50
    coef[~mask] = float("nan")  # coefficients of masked positions are ignored, even NaN
    return hidden, weight, labels, mask, coef, ecoef


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(
    ("backend", "lead", "hdim", "vocab"),
    [("torch", (3, 70), 48, 2001), pytest.param("triton", (41,), 40, 333, marks=NEEDS_TRITON)],
)
def test_matches_fp64(ref, small_chunks, monkeypatch, backend, lead, hdim, vocab, entropy):
    from rlblocks.kernels import _common

    monkeypatch.setattr(_common, "FUSED_CHUNK_BYTES", 16 * vocab * 4)  # several row chunks (fp32 grad accumulation)
    hidden, weight, labels, mask, coef, ecoef = _inputs(ref, lead, hdim, vocab, seed=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    res = linear_token_logprobs_loss(h, w, labels, coef, entropy_coef=ecoef if entropy else None, mask=mask,
                                     temperature=0.8, backend=backend)  # fmt: skip
    (res.loss * 3.0).backward()  # the stored gradients are scaled by the upstream gradient
    keep = mask & (labels != ref.IGNORE)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = ref.linear(hr, wr, torch.where(keep, labels, ref.IGNORE), 0.8)
    c = torch.where(keep, coef.double(), 0.0)
    want = (c * want_lp).sum() + ((torch.where(keep, ecoef.double(), 0.0) * want_ent).sum() if entropy else 0.0)
    (want * 3.0).backward()
    assert res.loss.dtype == torch.float32 and res.loss.dim() == 0 and not res.logp.requires_grad
    ref.assert_close(res.loss, want, 1e-5, "loss")
    ref.assert_close(res.logp, want_lp, 1e-5, "logp")
    if entropy:
        ref.assert_close(res.entropy, want_ent, 1e-5, "entropy")
    else:
        assert res.entropy is None
    assert torch.isfinite(h.grad).all() and (h.grad[~keep] == 0).all()
    ref.assert_close(h.grad, hr.grad, 1e-5, "grad hidden")
    ref.assert_close(w.grad, wr.grad, 1e-5, "grad weight")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=NEEDS_TRITON)])
def test_same_as_general_path_and_no_grad(ref, backend):
    """A GRPO-style loss (coef = −A·mask / num_tokens): values and gradients equal the general path's; without
    grad it is the plain forward."""
    n, hdim, vocab = (37, 32, 300) if backend == "triton" else (90, 32, 1000)
    hidden, weight, labels, mask, coef, _ = _inputs(ref, (n,), hdim, vocab, seed=5)
    adv = torch.randn(n, generator=torch.Generator().manual_seed(1))
    coef = -(adv * mask) / mask.sum()
    hidden = torch.nan_to_num(hidden)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = linear_token_logprobs(h1, w1, labels, mask=mask, temperature=1.1, backend=backend)
    (coef * lp).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    res = linear_token_logprobs_loss(h2, w2, labels, coef, mask=mask, temperature=1.1, backend=backend)
    res.loss.backward()
    ref.assert_close(res.logp, lp.detach(), 1e-6, "logp")
    ref.assert_close(h2.grad, h1.grad, 1e-6, "grad hidden")
    ref.assert_close(w2.grad, w1.grad, 1e-6, "grad weight")
    with torch.no_grad():
        res0 = linear_token_logprobs_loss(h2, w2, labels, coef, mask=mask, temperature=1.1, backend=backend)
    assert res0.loss.grad_fn is None
    ref.assert_close(res0.loss, res.loss.detach(), 1e-6, "no-grad loss")


def test_bad_coefficients():
    h, w, y = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"coef: expected the shape of labels \[4\]"):
        linear_token_logprobs_loss(h, w, y, torch.ones(5))
    with pytest.raises(ValueError, match=r"coef: requires grad"):
        linear_token_logprobs_loss(h, w, y, torch.ones(4, requires_grad=True))
    with pytest.raises(ValueError, match=r"entropy_coef: expected a floating-point"):
        linear_token_logprobs_loss(h, w, y, torch.ones(4), entropy_coef=torch.ones(4, dtype=torch.long))


@pytest.mark.parametrize("kind", ["sparse_set", "per_token"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=NEEDS_TRITON)])
def test_sampling_replay_matches_fp64(ref, small_chunks, monkeypatch, backend, kind):
    """top_k / top_p on the fused-loss path: loss, logp, entropy and both gradients of the processed distribution
    against float64; a label outside the kept set is −inf in logp and adds no coef·logp term."""
    from rlblocks.kernels import _common

    monkeypatch.setattr(_common, "FUSED_CHUNK_BYTES", 16 * 200 * 4)  # several row chunks
    n, hdim, vocab, temp = 45, 24, 200, 0.8
    hidden, weight, labels, mask, coef, ecoef = _inputs(ref, (n,), hdim, vocab, seed=9)
    k, p = torch.full((n,), 15), torch.full((n,), 0.8)
    if kind == "per_token":
        k[::4], p[::4] = -1, 1.0
        k[1::4], p[1::4] = -1, 0.95
    valid = mask & (labels != ref.IGNORE)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    with torch.no_grad():
        lsm0 = ref.processed(torch.where(valid.unsqueeze(1), hr, 0.0) @ wr.T / temp, k, p)
    labels = torch.where(valid, torch.where(torch.arange(n) % 3 == 0, labels, lsm0.argmax(1)), labels)
    lsm = ref.processed(torch.where(valid.unsqueeze(1), hr, 0.0) @ wr.T / temp, k, p)
    want_lp, want_ent, want_out = ref.processed_outputs(lsm, torch.where(valid, labels, 0), valid)
    live = valid & ~want_out
    want_loss = (torch.where(live, coef.double() * want_lp, 0.0)).sum() + torch.where(valid, ecoef.double() * want_ent,
                                                                                       0.0).sum()  # fmt: skip
    want_loss.backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    res = linear_token_logprobs_loss(h, w, labels, coef, entropy_coef=ecoef, mask=mask, temperature=temp, top_k=k,
                                     top_p=p, backend=backend)  # fmt: skip
    res.loss.backward()
    assert want_out.any() and live.any()
    assert torch.equal(torch.isneginf(res.logp), want_out)
    ref.assert_close(res.logp[live], want_lp[live], 1e-5, "logp")
    ref.assert_close(res.entropy, want_ent, 1e-5, "entropy")
    ref.assert_close(res.loss, want_loss, 1e-5, "loss")
    ref.assert_close(h.grad, hr.grad, 1e-5, "grad hidden")
    ref.assert_close(w.grad, wr.grad, 1e-5, "grad weight")
