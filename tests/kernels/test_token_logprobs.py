"""token_logprobs vs a float64 materialised reference: torch path at larger shapes, Triton (interpreter) at small."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import token_logprobs
from rlblocks.kernels._common import interpret_mode, triton_available

# The Triton kernels run here on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no
# GPU); on a GPU machine the same kernels are checked on CUDA tensors by test_gpu.py.
NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)


def _run(ref, backend, lead, vocab, temperature, entropy, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    logits = (torch.randn(*lead, vocab) * 3).to(dtype)
    labels = ref.make_labels(lead, vocab, seed=seed)
    # padding rows may hold garbage: it must not leak into outputs or grads
    logits[labels == ref.IGNORE] = float("nan")
    x = logits.clone().requires_grad_()
    xr = logits.double().requires_grad_()
    out = token_logprobs(x, labels, temperature=temperature, return_entropy=entropy, backend=backend)
    want_lp, want_ent = ref.token_logprobs(xr, labels, temperature)
    w1, w2 = torch.randn(lead, dtype=torch.float64), torch.randn(lead, dtype=torch.float64)
    if entropy:
        lp, ent = out
        ((lp.double() * w1).sum() + (ent.double() * w2).sum()).backward()
        ((want_lp * w1).sum() + (want_ent * w2).sum()).backward()
    else:
        lp, ent = out, None
        (lp.double() * w1).sum().backward()
        (want_lp * w1).sum().backward()
    assert lp.dtype == torch.float32 and lp.shape == lead
    return lp, ent, want_lp, want_ent, x.grad, xr.grad, labels


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(
    ("backend", "lead", "vocab"),
    [("torch", (3, 113), 4099), pytest.param("triton", (37,), 300, marks=NEEDS_TRITON)],
)
def test_fp32_matches_fp64(ref, small_chunks, backend, lead, vocab, entropy):
    lp, ent, want_lp, want_ent, g, want_g, labels = _run(ref, backend, lead, vocab, 0.7, entropy)
    ref.assert_close(lp, want_lp, 1e-5, "logp")
    if entropy:
        ref.assert_close(ent, want_ent, 1e-5, "entropy")
    ref.assert_close(g, want_g, 1e-5, "grad logits")
    ignored = labels == ref.IGNORE
    assert (lp[ignored] == 0).all()
    assert (g[ignored] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_torch_path(ref, dtype):
    lp, ent, want_lp, want_ent, g, want_g, _ = _run(ref, "torch", (4, 63), 4099, 1.3, True, dtype=dtype, seed=1)
    # references use the same rounded inputs in float64; the tolerances are those of low-precision inputs
    ref.assert_close(lp, want_lp, 1e-3, "logp")
    ref.assert_close(ent, want_ent, 5e-3, "entropy")
    assert g.dtype == dtype
    ref.assert_close(g, want_g, 2e-2, "grad logits")


def test_entropy_only_gradient(ref):
    torch.manual_seed(3)
    logits = torch.randn(50, 700, requires_grad=True)
    labels = ref.make_labels((50,), 700, seed=3)
    _, ent = token_logprobs(logits, labels, return_entropy=True, temperature=0.5)
    ent.sum().backward()
    xr = logits.detach().double().requires_grad_()
    ref.token_logprobs(xr, labels, 0.5)[1].sum().backward()
    ref.assert_close(logits.grad, xr.grad, 1e-5, "grad through entropy")


def test_no_grad_and_auto_backend(ref):
    logits = torch.randn(2, 9, 130)
    labels = ref.make_labels((2, 9), 130)
    with torch.no_grad():
        lp = token_logprobs(logits, labels)
    ref.assert_close(lp, ref.token_logprobs(logits, labels)[0], 1e-5, "logp (auto backend, no grad)")
