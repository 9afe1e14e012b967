"""Bad input raises ValueError naming the argument; backend selection; no triton import at package import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlblocks.kernels import linear_token_logprobs, linear_vocab_kl, token_logprobs, vocab_kl
from rlblocks.kernels._common import resolve_backend


def test_label_out_of_range():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"labels: .*\[0, 10\).*got 10"):
        token_logprobs(logits, torch.tensor([1, 2, -100, 10]))
    with pytest.raises(ValueError, match=r"labels: .*got -1"):
        token_logprobs(logits, torch.tensor([1, -1, 0, 0]))
    with pytest.raises(ValueError, match=r"labels: .*got 12"):
        linear_token_logprobs(torch.randn(2, 3), torch.randn(10, 3), torch.tensor([12, 0]))
    # ignore_index itself is fine, also a custom one
    token_logprobs(logits, torch.tensor([1, 2, 7, 7]), ignore_index=7)


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, 8\]"):
        linear_token_logprobs(torch.randn(3, 8), torch.randn(10, 7), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight: expected the dtype of hidden"):
        linear_token_logprobs(torch.randn(3, 8), torch.randn(10, 8).half(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"hidden: expected a floating-point tensor"):
        linear_token_logprobs(torch.ones(3, 8, dtype=torch.long), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits: expected a floating-point tensor"):
        token_logprobs(torch.ones(3, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels: expected the leading shape"):
        token_logprobs(torch.randn(3, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels: expected an integer tensor"):
        token_logprobs(torch.randn(3, 8), torch.zeros(3))
    with pytest.raises(ValueError, match=r"temperature"):
        token_logprobs(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"backend"):
        token_logprobs(torch.randn(3, 8), torch.zeros(3, dtype=torch.long), backend="cuda")


def test_kl_errors():
    s, t = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"teacher_logits: expected the shape"):
        vocab_kl(s, torch.randn(3, 9))
    with pytest.raises(ValueError, match=r"kind"):
        vocab_kl(s, t, kind="sym")
    with pytest.raises(ValueError, match=r"beta"):
        vocab_kl(s, t, kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match=r"teacher_logits: requires grad"):
        vocab_kl(s, t.requires_grad_())
    with pytest.raises(ValueError, match=r"mask"):
        vocab_kl(s, torch.randn(3, 8), mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"student_logits: expected a floating-point"):
        vocab_kl(s.long(), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"teacher_weight: expected shape \[10, 4\]"):
        linear_vocab_kl(torch.randn(3, 5), torch.randn(10, 5), torch.randn(3, 4), torch.randn(11, 4))
    with pytest.raises(ValueError, match=r"student_weight: expected shape \[V, 5\]"):
        linear_vocab_kl(torch.randn(3, 5), torch.randn(10, 6), torch.randn(3, 4), torch.randn(10, 4))


def test_backend_resolution():
    x = torch.randn(2, 2)
    assert resolve_backend(None, x) == "torch"  # CPU tensors: chunked torch path
    assert resolve_backend("torch", x) == "torch"


def _run(code):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_package_import_does_not_import_triton():
    out = _run("import sys, rlblocks.kernels; print('triton' in sys.modules)")
    assert out.strip() == "False"


def test_torch_path_works_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from rlblocks.kernels import linear_token_logprobs, token_logprobs, vocab_kl, linear_vocab_kl\n"
        "h = torch.randn(5, 4, requires_grad=True); w = torch.randn(9, 4); y = torch.tensor([0, 8, -100, 3, 3])\n"
        "lp = linear_token_logprobs(h, w, y); lp.sum().backward()\n"
        "ref = torch.log_softmax(h.detach() @ w.T, -1)[[0, 1, 3, 4], [0, 8, 3, 3]]\n"
        "assert torch.allclose(lp[[0, 1, 3, 4]], ref, atol=1e-6) and lp[2] == 0\n"
        "token_logprobs(h @ w.T, y); vocab_kl(h @ w.T, torch.randn(5, 9))\n"
        "linear_vocab_kl(h, w, torch.randn(5, 3), torch.randn(9, 3))\n"
        "try:\n"
        "    token_logprobs(h @ w.T, y, backend='triton')\n"
        "    raise SystemExit('expected ValueError')\n"
        "except ValueError as e:\n"
        "    assert 'triton' in str(e)\n"
        "print('ok')\n"
    )
    assert _run(code).strip() == "ok"
