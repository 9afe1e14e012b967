"""vocab_kl and linear_vocab_kl (forward / reverse / jsd) vs float64 materialised references, with gradients."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import linear_vocab_kl, vocab_kl
from rlblocks.kernels._common import interpret_mode, triton_available

# The Triton kernels run here on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no
# GPU); on a GPU machine the same kernels are checked on CUDA tensors by test_gpu.py.
NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)
KINDS = ["forward", "reverse", "jsd"]
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]
# The CPU interpreter evaluates both sides of every tl.where with numpy, so the guarded −inf − (−inf) and log(0)
# branches warn there (on a GPU they are silent); the values that are kept are checked below.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_kl_matches_fp64(ref, small_chunks, backend, kind):
    lead, vocab = ((2, 61), 2999) if backend == "torch" else ((29,), 300)
    g = torch.Generator().manual_seed(1)
    student = torch.randn(*lead, vocab, generator=g) * 2
    teacher = torch.randn(*lead, vocab, generator=g) * 2
    labels = ref.make_labels(lead, vocab, seed=1)
    valid = labels != ref.IGNORE
    student[~valid] = float("nan")
    s = student.clone().requires_grad_()
    sr = student.double().requires_grad_()
    out = vocab_kl(s, teacher, kind=kind, beta=0.3, temperature=0.8, labels=labels, backend=backend)
    want = ref.vocab_kl(sr, teacher.double(), valid, kind, beta=0.3, temperature=0.8)
    c = torch.randn(lead, dtype=torch.float64)
    (out.double() * c).sum().backward()
    (want * c).sum().backward()
    assert out.dtype == torch.float32 and out.shape == lead
    ref.assert_close(out, want, 1e-5, f"{kind} value")
    ref.assert_close(s.grad, sr.grad, 1e-5, f"{kind} grad student")
    assert (out[~valid] == 0).all() and (s.grad[~valid] == 0).all()
    assert (out[valid] >= -1e-6).all()


def test_vocab_kl_mask_and_bf16(ref):
    g = torch.Generator().manual_seed(2)
    student = torch.randn(40, 1000, generator=g).bfloat16()
    teacher = torch.randn(40, 1000, generator=g).bfloat16()
    mask = torch.rand(40, generator=g) > 0.2
    s = student.clone().requires_grad_()
    sr = student.double().requires_grad_()
    out = vocab_kl(s, teacher, kind="reverse", mask=mask)
    want = ref.vocab_kl(sr, teacher.double(), mask, "reverse")
    out.sum().backward()
    want.sum().backward()
    ref.assert_close(out, want, 1e-3, "reverse bf16 value")
    ref.assert_close(s.grad, sr.grad, 2e-2, "reverse bf16 grad")


def test_identical_distributions_give_zero(ref):
    x = torch.randn(5, 77)
    for kind in KINDS:
        ref.assert_close(vocab_kl(x, x.clone(), kind=kind), torch.zeros(5), 1e-6, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_vocab_kl_matches_fp64(ref, small_chunks, backend, kind):
    n, hs_dim, ht_dim, vocab = (150, 48, 32, 2051) if backend == "torch" else (37, 40, 24, 300)
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(n, hs_dim, generator=g)
    ws = torch.randn(vocab, hs_dim, generator=g) / hs_dim**0.5 * 2
    ht = torch.randn(n, ht_dim, generator=g)
    wt = torch.randn(vocab, ht_dim, generator=g) / ht_dim**0.5 * 2
    labels = ref.make_labels((n,), vocab, seed=3)
    valid = labels != ref.IGNORE
    hs[~valid] = float("nan")
    a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    ar, br = hs.double().requires_grad_(), ws.double().requires_grad_()
    out = linear_vocab_kl(a, b, ht, wt, kind=kind, beta=0.7, temperature=1.4, labels=labels, backend=backend)
    zs = torch.where(valid[:, None], ar, 0.0) @ br.T
    zt = torch.where(valid[:, None], ht.double(), 0.0) @ wt.double().T
    want = ref.vocab_kl(zs, zt, valid, kind, beta=0.7, temperature=1.4)
    c = torch.randn(n, dtype=torch.float64)
    (out.double() * c).sum().backward()
    (want * c).sum().backward()
    ref.assert_close(out, want, 1e-5, f"{kind} value")
    ref.assert_close(a.grad, ar.grad, 1e-5, f"{kind} grad student_hidden")
    ref.assert_close(b.grad, br.grad, 1e-5, f"{kind} grad student_weight")
    assert (a.grad[~valid] == 0).all()
