"""linear_token_logprobs vs float64 materialised logits; memory bound of the chunked torch path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlblocks.kernels import linear_token_logprobs, token_logprobs
from rlblocks.kernels._common import interpret_mode, triton_available

# The Triton kernels run here on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it when there is no
# GPU); on a GPU machine the same kernels are checked on CUDA tensors by test_gpu.py.
NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)


def _case(ref, lead, hdim, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, hdim, generator=g).to(dtype)
    weight = (torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2).to(dtype)
    labels = ref.make_labels(lead, vocab, seed=seed)
    hidden[labels == ref.IGNORE] = float("nan")  # padding garbage must not leak
    return hidden, weight, labels


def _check(ref, backend, lead, hdim, vocab, temperature, entropy, dtype=torch.float32, tol=None):
    tol = tol or {"lp": 1e-5, "ent": 1e-5, "grad": 1e-5}
    hidden, weight, labels = _case(ref, lead, hdim, vocab, dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    out = linear_token_logprobs(h, w, labels, temperature=temperature, return_entropy=entropy, backend=backend)
    want_lp, want_ent = ref.linear(hr, wr, labels, temperature)
    c1, c2 = torch.randn(lead, dtype=torch.float64), torch.randn(lead, dtype=torch.float64)
    lp = out[0] if entropy else out
    loss = (lp.double() * c1).sum() + ((out[1].double() * c2).sum() if entropy else 0)
    want = (want_lp * c1).sum() + ((want_ent * c2).sum() if entropy else 0)
    loss.backward()
    want.backward()
    assert lp.dtype == torch.float32 and lp.shape == lead
    ref.assert_close(lp, want_lp, tol["lp"], "logp")
    if entropy:
        ref.assert_close(out[1], want_ent, tol["ent"], "entropy")
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    ref.assert_close(h.grad, hr.grad, tol["grad"], "grad hidden")
    ref.assert_close(w.grad, wr.grad, tol["grad"], "grad weight")
    ignored = labels == ref.IGNORE
    assert (lp[ignored] == 0).all() and (h.grad[ignored] == 0).all()


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(
    ("backend", "lead", "hdim", "vocab"),
    [("torch", (2, 150), 96, 3001), pytest.param("triton", (45,), 40, 333, marks=NEEDS_TRITON),
     # H=37: fp32 rows of 148 bytes are not 16-byte aligned, so the kernels read through pointers instead of TMA
     pytest.param("triton", (21,), 37, 200, marks=NEEDS_TRITON)],
)
def test_fp32_matches_fp64(ref, small_chunks, backend, lead, hdim, vocab, entropy):
    _check(ref, backend, lead, hdim, vocab, 0.7, entropy)


@NEEDS_TRITON
def test_triton_single_chunk_temperature_one(ref):
    _check(ref, "triton", (3, 7), 64, 200, 1.0, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_torch_path(ref, dtype):
    tol = {"lp": 1e-3, "ent": 5e-3, "grad": 2e-2}
    _check(ref, "torch", (97,), 64, 2053, 1.3, True, dtype=dtype, tol=tol)


def test_matches_token_logprobs(ref):
    hidden, weight, labels = _case(ref, (4, 33), 48, 999)
    hidden = torch.nan_to_num(hidden)
    lp, ent = linear_token_logprobs(hidden, weight, labels, temperature=0.9, return_entropy=True)
    lp2, ent2 = token_logprobs(hidden @ weight.T, labels, temperature=0.9, return_entropy=True)
    ref.assert_close(lp, lp2, 1e-5, "logp vs token_logprobs")
    ref.assert_close(ent, ent2, 1e-5, "entropy vs token_logprobs")


def test_weight_only_gradient(ref):
    hidden, weight, labels = _case(ref, (60,), 32, 500, seed=4)
    w = weight.clone().requires_grad_()
    linear_token_logprobs(hidden, w, labels).sum().backward()
    wr = weight.double().requires_grad_()
    ref.linear(hidden, wr, labels)[0].sum().backward()
    ref.assert_close(w.grad, wr.grad, 1e-5, "grad weight")


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _saved_by_op(root):
    """Tensors saved for backward by the LinearTokenLogprobsFunction node reachable from ``root``."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "LinearTokenLogprobsFunction" in type(node).__name__:
            return [t for t in node.saved_tensors if t is not None]
        stack.extend(fn for fn, _ in node.next_functions)
    raise AssertionError("LinearTokenLogprobsFunction not found in the graph")


@pytest.mark.parametrize("entropy", [False, True])
def test_torch_path_never_materialises_n_by_v(ref, small_chunks, entropy):
    n, hdim, vocab = 128, 8, 2048
    hidden, weight, labels = _case(ref, (n,), hdim, vocab)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    mode = _LargestTensor()
    with mode:
        out = linear_token_logprobs(h, w, labels, return_entropy=entropy, backend="torch")
        total = (out[0] + out[1]).sum() if entropy else out.sum()
        saved = _saved_by_op(total.grad_fn)
        total.backward()
    # chunks of 8 rows x V, and the [V, H] weight gradient: nothing near [N, V]
    assert mode.largest <= max(vocab * hdim, 8 * vocab), mode.largest
    assert mode.largest <= n * vocab // 16
    assert max(t.numel() for t in saved) <= vocab * hdim


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=NEEDS_TRITON)])
def test_mask_like_every_block(ref, backend):
    """mask=False positions: logp 0, entropy 0, no gradient, and NaN/inf in their hidden rows never leak; the
    rest equals the float64 reference (mask and ignore_index combine)."""
    n, hdim, vocab = (37, 24, 300) if backend == "triton" else (120, 32, 1001)
    hidden, weight, labels = _case(ref, (n,), hdim, vocab, seed=6)
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = False
    hidden[~mask & (labels != ref.IGNORE)] = float("inf")  # masked rows hold garbage too
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_token_logprobs(h, w, labels, mask=mask, temperature=0.9, return_entropy=True, backend=backend)
    keep = mask & (labels != ref.IGNORE)
    y_ref = torch.where(keep, labels, ref.IGNORE)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = ref.linear(hr, wr, y_ref, 0.9)
    c = torch.randn(n, generator=g, dtype=torch.float64)
    ((lp.double() + ent.double()) * c).sum().backward()
    ((want_lp + want_ent) * c).sum().backward()
    ref.assert_close(lp, want_lp, 1e-5, "logp")
    ref.assert_close(ent, want_ent, 1e-5, "entropy")
    assert (lp[~keep] == 0).all() and (ent[~keep] == 0).all()
    assert torch.isfinite(h.grad).all() and (h.grad[~keep] == 0).all()
    ref.assert_close(h.grad, hr.grad, 1e-5, "grad hidden")
    ref.assert_close(w.grad, wr.grad, 1e-5, "grad weight")
    # an int 0/1 mask means the same; a mask of another shape is refused, naming the argument
    # (same call with the entropy: with it, Σexp is summed in column blocks, so logp may differ in the last bit)
    lp01, _ = linear_token_logprobs(hidden, weight, labels, mask=mask.int(), temperature=0.9, return_entropy=True,
                                    backend=backend)  # fmt: skip
    assert torch.equal(lp01, lp.detach())
    with pytest.raises(ValueError, match=r"mask: expected the shape of labels"):
        linear_token_logprobs(hidden, weight, labels, mask=mask[:-1], backend=backend)


def test_token_logprobs_mask(ref):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50, 70, generator=g)
    labels = ref.make_labels((6, 50), 70, seed=7)
    mask = torch.rand(6, 50, generator=g) > 0.5
    logits[~mask] = float("nan")
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, labels, mask=mask, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    want_lp, want_ent = ref.token_logprobs(logits, torch.where(mask, labels, ref.IGNORE))
    ref.assert_close(lp, want_lp, 1e-5, "logp")
    ref.assert_close(ent, want_ent, 1e-5, "entropy")
    assert torch.isfinite(x.grad).all() and (x.grad[~mask] == 0).all()


@pytest.mark.parametrize("entropy", [False, True])
def test_torch_chunks_at_uneven_rows_and_vocab(ref, entropy):
    """The default chunking (no shrunk budget): 1027 rows in forward chunks of 65 (1/16 of them, the last one 52
    rows), 1031 vocabulary rows in backward blocks of 65 (the last one 56), against float64; rows with a zero
    upstream gradient and ignored rows included."""
    n, hdim, vocab = 1027, 24, 1031
    hidden, weight, labels = _case(ref, (n,), hdim, vocab, seed=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    g = torch.Generator().manual_seed(5)
    c1, c2 = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    c1[::7] = 0.0
    mode = _LargestTensor()
    with mode:
        out = linear_token_logprobs(h, w, labels, temperature=0.8, return_entropy=entropy, backend="torch")
        lp = out[0] if entropy else out
        loss = (lp.double() * c1).sum() + ((out[1].double() * c2).sum() if entropy else 0)
        loss.backward()
    want_lp, want_ent = ref.linear(hr, wr, labels, 0.8)
    ((want_lp * c1).sum() + ((want_ent * c2).sum() if entropy else 0)).backward()
    ref.assert_close(lp, want_lp, 1e-5, "logp")
    if entropy:
        ref.assert_close(out[1], want_ent, 1e-5, "entropy")
    ref.assert_close(h.grad, hr.grad, 1e-5, "grad hidden")
    ref.assert_close(w.grad, wr.grad, 1e-5, "grad weight")
    assert (h.grad[labels == ref.IGNORE] == 0).all()
    # forward row chunks of ceil(N/16) rows, backward vocabulary blocks of ceil(V/16) columns
    assert mode.largest <= max(vocab * hdim, -(-n // 16) * vocab, n * -(-vocab // 16)), mode.largest
