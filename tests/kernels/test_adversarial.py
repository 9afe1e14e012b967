"""Bad input to the kernel ops, tried as an attacker and as a new user would: NaN in valid rows (it must show, in
the value and in the gradient, on every backend and with sampling-mask replay), NaN in padded rows (it must not
leak), empty batches, and host scalars of the wrong kind (bools, numpy numbers, non-integral ignore_index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.kernels import (
    linear_token_logprobs,
    linear_token_logprobs_loss,
    linear_vocab_kl,
    token_logprobs,
    vocab_kl,
)
from rlblocks.kernels._common import interpret_mode, triton_available

NEEDS_TRITON = pytest.mark.skipif(
    not (triton_available() and interpret_mode()), reason="needs triton and TRITON_INTERPRET=1 (CPU tensors)"
)
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]
KINDS = ["forward", "reverse", "jsd"]
NAN = float("nan")
# The CPU interpreter evaluates both sides of every tl.where with numpy (warnings only; the values are checked).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _assert_nan_rows(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    """NaN exactly where the float64 reference is NaN (per row, for a gradient), and close elsewhere."""
    got_nan = torch.isnan(got) if got.dim() == 1 else torch.isnan(got).any(-1)
    want_nan = torch.isnan(want) if want.dim() == 1 else torch.isnan(want).any(-1)
    assert torch.equal(got_nan, want_nan), f"{what}: NaN rows {got_nan.tolist()} != reference {want_nan.tolist()}"
    assert want_nan.any() and not want_nan.all(), f"{what}: the case must hold NaN and finite rows"
    err = (got[~got_nan].double() - want[~want_nan]).abs().max().item()
    assert err <= atol * max(1.0, want[~want_nan].abs().max().item()), f"{what}: max error {err:.3g}"


# ------------------------------------------------------------------------------------------ vocab_kl: NaN logits
@pytest.mark.parametrize("side", ["student", "teacher"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_kl_nan_logit_propagates(ref, backend, kind, side):
    """A NaN logit in a valid row gives that row NaN, value and gradient, for every kind (the reverse KL and the
    JSD used to leave NaN-weighted terms out as if their weight were 0, returning a finite value or gradient); a
    NaN in a masked row gives 0 and no gradient. Float64 reference: the textbook formulas."""
    g = torch.Generator().manual_seed(5)
    student = torch.randn(6, 200, generator=g) * 2
    teacher = torch.randn(6, 200, generator=g) * 2
    valid = torch.tensor([True, True, False, True, True, True])
    (student if side == "student" else teacher)[1, 17] = NAN  # valid row: must show
    student[2] = NAN  # masked row: must not leak
    s = student.clone().requires_grad_()
    sr = student.double().requires_grad_()
    out = vocab_kl(s, teacher, kind=kind, beta=0.3, mask=valid, backend=backend)
    want = ref.vocab_kl(sr, teacher.double(), valid, kind, beta=0.3)
    out.sum().backward()
    want.sum().backward()
    _assert_nan_rows(out, want, f"{kind} value")
    _assert_nan_rows(s.grad, sr.grad, f"{kind} grad")
    assert out[2] == 0 and (s.grad[2] == 0).all()


@pytest.mark.parametrize("side", ["student", "teacher"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_vocab_kl_nan_hidden_propagates(ref, backend, kind, side):
    """The fused path shares the reductions: a NaN hidden state of a valid row gives that row NaN (value, grad
    of the hidden state) and the LM-head gradient NaN (every row's gradient sums into it)."""
    g = torch.Generator().manual_seed(6)
    n, hs_dim, ht_dim, vocab = 7, 24, 16, 150
    hs = torch.randn(n, hs_dim, generator=g)
    ws = torch.randn(vocab, hs_dim, generator=g) / hs_dim**0.5
    ht = torch.randn(n, ht_dim, generator=g)
    wt = torch.randn(vocab, ht_dim, generator=g) / ht_dim**0.5
    valid = torch.ones(n, dtype=torch.bool)
    valid[4] = False
    (hs if side == "student" else ht)[2, 3] = NAN
    hs[4] = NAN  # masked: zeroed before any product
    a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    ar = hs.double().requires_grad_()
    out = linear_vocab_kl(a, b, ht, wt, kind=kind, mask=valid, backend=backend)
    zs = torch.where(valid[:, None], ar, 0.0) @ ws.double().T
    zt = torch.where(valid[:, None], ht.double(), 0.0) @ wt.double().T
    want = ref.vocab_kl(zs, zt, valid, kind)
    out.sum().backward()
    want.sum().backward()
    _assert_nan_rows(out, want, f"{kind} value")
    _assert_nan_rows(a.grad, ar.grad, f"{kind} grad hidden")
    assert torch.isnan(b.grad).any()


# ----------------------------------------------------------------------------- log-prob ops: NaN logits, replay
REPLAY = [{}, {"top_k": 5}, {"top_p": 0.7}, {"top_k": 40, "top_p": 0.9}]


@pytest.mark.parametrize("sampling", REPLAY, ids=["plain", "top_k", "top_p", "top_k+top_p"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_nan_logit_propagates(ref, backend, sampling):
    """A NaN logit in a valid row gives that row a NaN log-prob, entropy and gradient, with or without top-k /
    top-p replay (the Triton kernel used to treat a NaN logit as a masked entry, ``NaN >= -inf`` being false, and
    return a finite log-prob; replay used to report a NaN row as a label outside the kept set, ``-inf``, which
    ``mask & ~outside`` would then drop without a trace). The other rows keep their float64 values."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 300, generator=g) * 2
    labels = torch.randint(0, 300, (5,), generator=g)
    labels[[0, 2]] = logits[[0, 2]].argmax(-1)  # kept by every filter: finite values to compare
    labels[3] = ref.IGNORE
    logits[1, 250] = NAN
    logits[3] = NAN  # ignored row
    x = logits.clone().requires_grad_()
    lp, ent, outside = token_logprobs(x, labels, backend=backend, return_entropy=True, return_outside=True,
                                      **sampling)
    (lp.sum() + ent.sum()).backward()
    assert torch.isnan(lp[1]) and torch.isnan(ent[1]) and torch.isnan(x.grad[1]).any()
    assert not outside[1]  # NaN is not "outside": it is no probability at all
    assert lp[3] == 0 and ent[3] == 0 and (x.grad[3] == 0).all()
    keep = torch.tensor([0, 2, 4])
    assert torch.isfinite(x.grad[keep]).all() and torch.isfinite(ent[keep]).all()
    if not sampling:
        want_lp, want_ent = ref.token_logprobs(logits[keep], labels[keep])
        ref.assert_close(lp[keep], want_lp, 1e-5, "logp")
        ref.assert_close(ent[keep], want_ent, 1e-5, "entropy")
    else:
        want = ref.processed(logits[keep].double(), torch.full((3,), sampling.get("top_k", 0)),
                             torch.full((3,), sampling.get("top_p", 1.0)))
        want_lp = want.gather(1, labels[keep].unsqueeze(1)).squeeze(1)
        fin = torch.isfinite(want_lp)
        assert torch.equal(outside[keep], ~fin)
        ref.assert_close(lp[keep][fin], want_lp[fin], 1e-5, "replay logp")


@pytest.mark.parametrize("sampling", REPLAY, ids=["plain", "top_k", "top_p", "top_k+top_p"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_logprobs_nan_weight_row_propagates(backend, sampling):
    """A NaN in one LM-head row makes that vocabulary entry's logit NaN in every row: every valid row's log-prob
    is NaN (its normaliser holds the NaN), with replay too, and the fused-loss path's loss is NaN."""
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(4, 16, generator=g)
    weight = torch.randn(120, 16, generator=g) / 4
    labels = torch.randint(0, 120, (4,), generator=g)
    weight[77, 5] = NAN
    mask = torch.tensor([True, True, False, True])
    h = hidden.clone().requires_grad_()
    lp = linear_token_logprobs(h, weight, labels, mask=mask, backend=backend, **sampling)
    lp.sum().backward()
    assert torch.isnan(lp[mask]).all() and lp[2] == 0
    assert torch.isnan(h.grad[mask]).any(-1).all()  # (a NaN weight is no padding: it may reach any row's grad)
    res = linear_token_logprobs_loss(hidden.clone().requires_grad_(), weight, labels, torch.ones(4), mask=mask,
                                     backend=backend, **sampling)
    assert torch.isnan(res.loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_loss_nan_hidden_row_propagates(ref, backend):
    """The fused-loss path (logits gradient formed in the forward): a NaN hidden state of a valid row makes the
    loss and that row's gradient NaN; the other rows' gradients match the unfused op's."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(5, 16, generator=g)
    weight = torch.randn(100, 16, generator=g) / 4
    labels = torch.randint(0, 100, (5,), generator=g)
    coef = torch.randn(5, generator=g)
    hidden[3, 2] = NAN
    h = hidden.clone().requires_grad_()
    res = linear_token_logprobs_loss(h, weight, labels, coef, backend=backend)
    res.loss.backward()
    assert torch.isnan(res.loss) and torch.isnan(res.logp[3]) and torch.isnan(h.grad[3]).any()
    h2 = hidden.clone().requires_grad_()
    (linear_token_logprobs(h2, weight, labels, backend="torch") * coef).sum().backward()
    ok = torch.tensor([0, 1, 2, 4])
    ref.assert_close(h.grad[ok], h2.grad[ok], 1e-5, "grad hidden of the finite rows")


# ------------------------------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_gives_empty_outputs(backend):
    w = torch.randn(9, 4)
    none = torch.zeros(0, dtype=torch.long)
    lp, ent = token_logprobs(torch.zeros(0, 9, requires_grad=True), none, return_entropy=True, backend=backend)
    assert lp.shape == (0,) and ent.shape == (0,)
    assert linear_token_logprobs(torch.zeros(0, 4), w, none, backend=backend).shape == (0,)
    assert vocab_kl(torch.zeros(2, 0, 9), torch.zeros(2, 0, 9), backend=backend).shape == (2, 0)
    assert linear_vocab_kl(torch.zeros(0, 4), w, torch.zeros(0, 3), torch.randn(9, 3), backend=backend).shape == (0,)
    res = linear_token_logprobs_loss(torch.zeros(0, 4, requires_grad=True), w, none, torch.zeros(0), backend=backend)
    assert res.loss.item() == 0


# ------------------------------------------------------------------------------------------- host scalar arguments
def test_ignore_index_must_be_an_int():
    """``ignore_index=True`` used to be read as 1, silently ignoring every label 1; ``-100.5`` matched nothing."""
    x, y = torch.randn(3, 7), torch.tensor([1, 2, 3])
    for bad in (True, -100.5, "x", None):
        with pytest.raises(ArgumentError, match=r"ignore_index: expected an int"):
            token_logprobs(x, y, ignore_index=bad)
    with pytest.raises(ArgumentError, match=r"ignore_index"):
        linear_token_logprobs(torch.randn(3, 4), torch.randn(7, 4), y, ignore_index=False)
    with pytest.raises(ArgumentError, match=r"ignore_index"):
        vocab_kl(x, x.clone(), labels=y, ignore_index=1.0)
    want = token_logprobs(x, torch.tensor([1, -7, 3]), ignore_index=-7)
    got = token_logprobs(x, torch.tensor([1, -7, 3]), ignore_index=np.int64(-7))  # a numpy int is an int
    assert torch.equal(got, want) and got[1] == 0


@pytest.mark.parametrize("flag", ["return_entropy", "return_outside"])
def test_output_flags_must_be_bools(flag):
    x, y = torch.randn(3, 7), torch.tensor([1, 2, 3])
    for bad in ("yes", 1, None):
        with pytest.raises(ArgumentError, match=rf"{flag}: expected True or False"):
            token_logprobs(x, y, **{flag: bad})
        with pytest.raises(ArgumentError, match=rf"{flag}: expected True or False"):
            linear_token_logprobs(torch.randn(3, 4), torch.randn(7, 4), y, **{flag: bad})
    with pytest.raises(ArgumentError, match=r"allreduce_grad_hidden: expected True or False"):
        linear_token_logprobs_loss(torch.randn(3, 4), torch.randn(7, 4), y, torch.ones(3), allreduce_grad_hidden=0)


def test_numpy_scalars_are_numbers_and_tensors_or_bools_are_not():
    """numpy host scalars (a config read through numpy) act as the Python numbers they hold; a bool or a tensor
    temperature / beta / top-k is refused (a tensor would need a host sync)."""
    g = torch.Generator().manual_seed(10)
    x, y = torch.randn(3, 50, generator=g), torch.tensor([1, 2, 3])
    t = torch.randn(3, 50, generator=g)
    assert torch.equal(token_logprobs(x, y, temperature=np.float32(0.5)), token_logprobs(x, y, temperature=0.5))
    assert torch.equal(token_logprobs(x, y, top_k=np.int64(4)), token_logprobs(x, y, top_k=4))
    assert torch.equal(token_logprobs(x, y, top_p=np.float32(0.5)), token_logprobs(x, y, top_p=float(np.float32(0.5))))
    assert torch.equal(vocab_kl(x, t, kind="jsd", beta=np.float32(0.25)), vocab_kl(x, t, kind="jsd", beta=0.25))
    for kw, name in (({"temperature": True}, "temperature"), ({"temperature": torch.tensor(1.0)}, "temperature"),
                     ({"top_k": True}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_p": np.bool_(True)}, "top_p")):
        with pytest.raises(ArgumentError, match=rf"{name}: expected"):
            token_logprobs(x, y, **kw)
    for beta in (True, torch.tensor(0.3), 1.0, 0):
        with pytest.raises(ArgumentError, match=r"beta: expected a float in \(0, 1\)"):
            vocab_kl(x, t, kind="jsd", beta=beta)


# ----------------------------------------------------------------------------------------- empty hidden dimension
@pytest.mark.parametrize("n", [3, 0])
def test_a_hidden_size_of_zero_is_refused_by_name(n):
    """A contraction over 0 hidden entries means nothing (it used to raise torch's ``cannot reshape tensor of 0
    elements``); an empty batch with a real hidden size still gives empty outputs (above)."""
    y = torch.zeros(n, dtype=torch.long)
    with pytest.raises(ArgumentError, match=rf"^hidden: expected shape \[\.\.\., H\] with H > 0, got \[{n}, 0\]"):
        linear_token_logprobs(torch.zeros(n, 0), torch.zeros(5, 0), y)
    with pytest.raises(ArgumentError, match=rf"^hidden: expected shape \[\.\.\., H\] with H > 0, got \[{n}, 0\]"):
        linear_token_logprobs_loss(torch.zeros(n, 0, requires_grad=True), torch.zeros(5, 0), y, torch.ones(n))
    with pytest.raises(ArgumentError, match=r"^student_hidden: expected shape \[\.\.\., Hs\] with Hs > 0"):
        linear_vocab_kl(torch.zeros(n, 0), torch.zeros(5, 0), torch.zeros(n, 4), torch.zeros(5, 4))
    with pytest.raises(ArgumentError, match=r"^teacher_hidden: expected shape \[\.\.\., Ht\] with Ht > 0"):
        linear_vocab_kl(torch.zeros(n, 4), torch.zeros(5, 4), torch.zeros(n, 0), torch.zeros(5, 0))
