"""Policy and value losses: float64 loop references, gradcheck, gradient properties, NaN-safe padding, bf16."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlblocks.losses import (
    AGG_MODES,
    aggregate,
    cispo_loss,
    decoupled_ppo_loss,
    gmpo_loss,
    gspo_loss,
    pg_loss,
    ppo_clip_loss,
    sapo_loss,
    value_loss,
)

B, T = 3, 5
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)


def inputs(seed=0, dtype=torch.float64, spread=0.5, seq_adv=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    adv = torch.randn(B, generator=g, dtype=torch.float64) if seq_adv else torch.randn(B, T, generator=g).double()
    return logp.to(dtype), old.to(dtype), adv.to(dtype)


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def adv_at(adv, i, j):
    return adv[i] if isinstance(adv[i], float) else adv[i][j]


# ---- loop references (float64, plain Python) ------------------------------------------------------------------------


def ref_ppo(lp, olp, adv, m, el, eh, c=None):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            if not m[i][j]:
                continue
            a = adv_at(adv, i, j)
            r = math.exp(clip(lp[i][j] - olp[i][j], -20, 20))
            loss = max(-r * a, -clip(r, 1 - el, 1 + eh) * a)
            if c is not None and a < 0:
                loss = min(loss, -c * a)
            out[i][j] = loss
    return out


def seq_mean(x, m, i):
    vals = [x[i][j] for j in range(T) if m[i][j]]
    return sum(vals) / max(len(vals), 1)


def ref_gspo(lp, olp, adv, m, el, eh):
    out = [[0.0] * T for _ in range(B)]
    lr = [[lp[i][j] - olp[i][j] for j in range(T)] for i in range(B)]
    for i in range(B):
        s = math.exp(seq_mean(lr, m, i))
        for j in range(T):
            if m[i][j]:
                a = adv_at(adv, i, j)
                out[i][j] = max(-s * a, -clip(s, 1 - el, 1 + eh) * a)
    return out


def ref_cispo(lp, olp, adv, m, el, eh):
    return [
        [
            -clip(math.exp(lp[i][j] - olp[i][j]), 1 - el, 1 + eh) * adv_at(adv, i, j) * lp[i][j] if m[i][j] else 0.0
            for j in range(T)
        ]
        for i in range(B)
    ]


def ref_sapo(lp, olp, adv, m, tp, tn):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            if m[i][j]:
                a = adv_at(adv, i, j)
                tau = tp if a > 0 else tn
                r = math.exp(lp[i][j] - olp[i][j])
                out[i][j] = -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * a
    return out


def ref_gmpo(lp, olp, adv, m, el, eh):
    lo, hi = math.log(1 - el), math.log(1 + eh)
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        eff = [[0.0] * T]
        for j in range(T):
            a = adv_at(adv, i, j)
            lr = lp[i][j] - olp[i][j]
            sgn = -1.0 if a < 0 else 1.0
            eff[0][j] = sgn * min(sgn * lr, sgn * clip(lr, lo, hi))
        g = math.exp(seq_mean(eff, [m[i]], 0))
        for j in range(T):
            if m[i][j]:
                out[i][j] = -adv_at(adv, i, j) * g
    return out


def ref_decoupled(lp, prox, behav, adv, m, el, eh, cap):
    base = ref_ppo(lp, prox, adv, m, el, eh)
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            w = math.exp(prox[i][j] - behav[i][j])
            if m[i][j] and (cap is None or w <= cap):
                out[i][j] = base[i][j] * w
    return out


def ref_value(v, vo, ret, m, c):
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            if m[i][j]:
                e1 = (v[i][j] - ret[i][j]) ** 2
                e2 = (vo[i][j] + clip(v[i][j] - vo[i][j], -c, c) - ret[i][j]) ** 2
                out[i][j] = 0.5 * max(e1, e2)
    return out


def L(x):
    return x.tolist()


@pytest.mark.parametrize("seq_adv", [False, True])
def test_losses_match_loop_references(seq_adv):
    lp, olp, adv = inputs(1, spread=0.6, seq_adv=seq_adv)
    m = MASK.tolist()
    a = L(adv)
    cases = [
        (ppo_clip_loss(lp, olp, adv, MASK, eps_low=0.2, eps_high=0.28)[0], ref_ppo(L(lp), L(olp), a, m, 0.2, 0.28)),
        (
            ppo_clip_loss(lp, olp, adv, MASK, dual_clip=1.5)[0],
            ref_ppo(L(lp), L(olp), a, m, 0.2, 0.2, 1.5),
        ),
        (gspo_loss(lp, olp, adv, MASK, eps_low=0.01, eps_high=0.02)[0], ref_gspo(L(lp), L(olp), a, m, 0.01, 0.02)),
        (cispo_loss(lp, olp, adv, MASK, eps_low=0.5, eps_high=0.1)[0], ref_cispo(L(lp), L(olp), a, m, 0.5, 0.1)),
        (sapo_loss(lp, olp, adv, MASK)[0], ref_sapo(L(lp), L(olp), a, m, 1.0, 1.05)),
        (gmpo_loss(lp, olp, adv, MASK, eps_low=0.1, eps_high=0.1)[0], ref_gmpo(L(lp), L(olp), a, m, 0.1, 0.1)),
        (
            pg_loss(lp, olp, adv, MASK)[0],
            [[-adv_at(a, i, j) * L(lp)[i][j] if m[i][j] else 0.0 for j in range(T)] for i in range(B)],
        ),
    ]
    for got, ref in cases:
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))


def test_decoupled_ppo_matches_reference_and_drops_capped_tokens():
    lp, prox, adv = inputs(2, spread=0.4)
    behav = prox - torch.linspace(-0.8, 0.8, B * T, dtype=torch.float64).reshape(B, T)
    for cap in (None, 1.5):
        got, met = decoupled_ppo_loss(
            lp, prox, adv, MASK, rollout_logp=behav, eps_low=0.1, eps_high=0.3, rollout_weight_cap=cap
        )
        ref = ref_decoupled(L(lp), L(prox), L(behav), L(adv), MASK.tolist(), 0.1, 0.3, cap)
        torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))
    w = torch.exp(prox - behav)
    want = ((w > 1.5) & MASK).sum() / MASK.sum()
    torch.testing.assert_close(met["rollout_capped_frac"], want.double())
    kept = MASK & (w <= 1.5)
    torch.testing.assert_close(met["rollout_weight_mean"], w[kept].mean())


def test_value_loss_matches_reference():
    g = torch.Generator().manual_seed(3)
    v, vo, ret = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(3))
    got, met = value_loss(v, vo, ret, MASK, clip=0.2)
    ref = ref_value(L(v), L(vo), L(ret), MASK.tolist(), 0.2)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))
    clipped = ((vo + (v - vo).clamp(-0.2, 0.2) - ret) ** 2 > (v - ret) ** 2) & MASK
    torch.testing.assert_close(met["vf_clipfrac"], (clipped.sum() / MASK.sum()).double())
    un, _ = value_loss(v, vo, ret, MASK, clip=None)
    torch.testing.assert_close(un, torch.where(MASK, 0.5 * (v - ret) ** 2, 0.0))


def test_ppo_metrics_reference():
    lp, olp, adv = inputs(4, spread=1.0)
    _, met = ppo_clip_loss(lp, olp, adv, MASK, eps_low=0.2, eps_high=0.2, dual_clip=2.0)
    r = torch.exp(lp - olp)
    n = MASK.sum()
    torch.testing.assert_close(met["clipfrac_high"], (((r > 1.2) & (adv > 0) & MASK).sum() / n).double())
    torch.testing.assert_close(met["clipfrac_low"], (((r < 0.8) & (adv < 0) & MASK).sum() / n).double())
    dual = (adv < 0) & (r > 2.0) & MASK  # -rA > -2A  <=>  r > 2 for A < 0
    torch.testing.assert_close(met["dual_clipfrac"], (dual.sum() / n).double())
    k3 = (r - 1 - (lp - olp))[MASK].mean()
    torch.testing.assert_close(met["approx_kl"], k3)


# ---- gradients ------------------------------------------------------------------------------------------------------

LOSSES = {
    "ppo": lambda lp, olp, a, m: ppo_clip_loss(lp, olp, a, m, eps_low=0.2, eps_high=0.28),
    "ppo_dual": lambda lp, olp, a, m: ppo_clip_loss(lp, olp, a, m, dual_clip=3.0),
    "gspo": lambda lp, olp, a, m: gspo_loss(lp, olp, a, m, eps_low=0.1, eps_high=0.1),
    "cispo": lambda lp, olp, a, m: cispo_loss(lp, olp, a, m, eps_low=0.2, eps_high=0.2),
    "sapo": lambda lp, olp, a, m: sapo_loss(lp, olp, a, m),
    "gmpo": lambda lp, olp, a, m: gmpo_loss(lp, olp, a, m),
    "pg": lambda lp, olp, a, m: pg_loss(lp, olp, a, m),
    "pg_on_policy": lambda lp, olp, a, m: pg_loss(lp, None, a, m),
    "decoupled": lambda lp, olp, a, m: decoupled_ppo_loss(lp, olp, a, m, rollout_logp=olp, rollout_weight_cap=5.0),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradcheck(name):
    # Ratios well inside or well outside the clip ranges, so no kink lies within gradcheck's finite-difference step.
    seq = name in ("gspo", "gmpo")
    lp, olp, adv = inputs(5, spread=0.05, seq_adv=seq)
    lp = lp.clone().requires_grad_(True)
    fn = LOSSES[name]
    if seq:
        # Token form: each token's value is the sequence ratio but its gradient flows through its own logp only,
        # so with sequence-level advantages the Jacobian is exact once reduced with weights uniform within a
        # sequence (every aggregate mode). With per-token advantages the gradient is GSPO-token's by definition.
        out = lambda x: aggregate(fn(x, olp, adv, MASK)[0], MASK, mode="seq-mean-token-mean")
    else:
        out = lambda x: fn(x, olp, adv, MASK)[0]
    if name != "cispo":
        assert torch.autograd.gradcheck(out, (lp,), eps=1e-6, atol=1e-6)
    # CISPO's weight is stop-gradient by design; where it is clipped it is constant and the value's true gradient
    # equals the implemented one. (test_cispo_no_grad_through_ratio checks the unclipped region.)
    sign = torch.where(torch.arange(T) % 2 == 0, 1.0, -1.0).double()
    far = (olp + sign).clone().requires_grad_(True)
    assert torch.autograd.gradcheck(out, (far,), eps=1e-6, atol=1e-6)


def test_gradcheck_value_loss():
    g = torch.Generator().manual_seed(6)
    vo, ret = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(2))
    near = (vo + 0.05).requires_grad_(True)
    far = (vo + 1.0).requires_grad_(True)
    for v in (near, far):
        assert torch.autograd.gradcheck(lambda x: value_loss(x, vo, ret, MASK)[0], (v,), eps=1e-6, atol=1e-6)


def _agg_weights(mode):
    """Independent per-token aggregation weights d(aggregate)/d(ℓ_t) for MASK."""
    lengths = MASK.sum(-1).double()
    w = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for j in range(T):
            if MASK[i, j]:
                w[i, j] = {
                    "token-mean": 1 / MASK.sum().item(),
                    "seq-mean-token-mean": 1 / (lengths[i].item() * B),
                    "seq-mean-token-sum": 1 / B,
                    "seq-mean-token-sum-norm": 1 / (B * T),
                    "token-sum": 1.0,
                }[mode]
    return w


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_gradient_at_ratio_one_is_minus_advantage_times_weight(name, mode):
    _, olp, adv = inputs(7)
    lp = olp.clone().requires_grad_(True)
    loss, _ = LOSSES[name](lp, olp, adv, MASK)
    (g,) = torch.autograd.grad(aggregate(loss, MASK, mode=mode), lp)
    torch.testing.assert_close(g, -adv * _agg_weights(mode))


def test_ppo_zero_grad_where_clipped():
    olp = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    m = torch.ones(1, 4, dtype=torch.bool)
    loss, _ = ppo_clip_loss(lp, olp, adv, m, eps_low=0.2, eps_high=0.2)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    # tokens 0,1: clipped in the direction of A -> exactly zero; tokens 2,3: unclipped -> -A·r
    assert g[0, 0] == 0 and g[0, 1] == 0
    torch.testing.assert_close(g[0, 2:], torch.tensor([1.5, -0.5], dtype=torch.float64))
    # dual clip: A<0 and r huge -> the constant branch -c·A, zero gradient
    lp2 = torch.tensor([[3.0]], dtype=torch.float64, requires_grad=True)
    loss2, _ = ppo_clip_loss(lp2, torch.zeros(1, 1).double(), torch.tensor([-1.0]).double(), m[:, :1], dual_clip=3.0)
    assert loss2.item() == 3.0
    assert torch.autograd.grad(loss2.sum(), lp2)[0].item() == 0


def test_cispo_no_grad_through_ratio():
    lp, olp, adv = inputs(8, spread=1.0)
    lp = lp.clone().requires_grad_(True)
    loss, _ = cispo_loss(lp, olp, adv, MASK, eps_low=0.2, eps_high=0.2)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    w = torch.exp(lp.detach() - olp).clamp(0.8, 1.2)
    torch.testing.assert_close(g, torch.where(MASK, -w * adv, 0.0))  # −sg(w)·A: no ∂w/∂logp term


def test_gspo_token_form_value_is_sequence_ratio_and_grad_matches_sequence_objective():
    lp, olp, adv = inputs(9, spread=0.3, seq_adv=True)
    lp = lp.clone().requires_grad_(True)
    loss, _ = gspo_loss(lp, olp, adv, MASK, eps_low=10.0 - 9.5, eps_high=10.0)  # effectively unclipped
    (g_tok,) = torch.autograd.grad(aggregate(loss, MASK, mode="seq-mean-token-mean"), lp)
    # sequence-level objective −mean_i A_i·exp(mean_t log r)
    lp2 = lp.detach().clone().requires_grad_(True)
    n = MASK.sum(-1)
    s = torch.exp(torch.where(MASK, lp2 - olp, 0.0).sum(-1) / n)
    (g_seq,) = torch.autograd.grad((-adv * s).mean(), lp2)
    torch.testing.assert_close(g_tok, g_seq)
    torch.testing.assert_close(loss, torch.where(MASK, (-adv * s.detach())[:, None], 0.0))


# ---- robustness ------------------------------------------------------------------------------------------------------



def _value(v, vo, a, m):
    return value_loss(v, vo, vo.float() + (a if a.dim() == 2 else a[:, None]).float(), m)


ALL = {**LOSSES, "value": _value}
bad = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30, -1e30])


@settings(max_examples=20, deadline=None)
@given(
    fill=bad,
    seed=st.integers(0, 1000),
    seq_adv=st.booleans(),
    rows=st.lists(st.integers(0, T), min_size=B, max_size=B),
)
def test_nan_in_padding_never_leaks(fill, seed, seq_adv, rows):
    mask = torch.arange(T)[None, :] < torch.tensor(rows)[:, None]  # includes all-false rows and masks
    lp, olp, adv = inputs(seed, seq_adv=seq_adv)
    lp = torch.where(mask, lp, fill).requires_grad_(True)
    olp = torch.where(mask, olp, fill)
    if not seq_adv:
        adv = torch.where(mask, adv, fill)
    for name, fn in ALL.items():
        loss, met = fn(lp, olp, adv, mask)
        assert torch.isfinite(loss).all(), name
        assert (loss[~mask] == 0).all(), name
        assert all(torch.isfinite(v) and v.dim() == 0 for v in met.values()), name
        for mode in AGG_MODES:
            total = aggregate(loss, mask, mode=mode)
            (g,) = torch.autograd.grad(total, lp, retain_graph=True)
            assert torch.isfinite(total), (name, mode)
            assert torch.isfinite(g).all() and (g[~mask] == 0).all(), (name, mode)


def test_all_false_mask_gives_zero():
    lp, olp, adv = inputs(10)
    m = torch.zeros(B, T, dtype=torch.bool)
    for name, fn in ALL.items():
        loss, met = fn(lp, olp, adv, m)
        assert (loss == 0).all(), name
        for mode in AGG_MODES:
            assert aggregate(loss, m, mode=mode).item() == 0, name
        assert all(v.item() == 0 or k == "weight_mean" for k, v in met.items() if not torch.isnan(v)), name
        assert all(not torch.isnan(v) for v in met.values()), name


@pytest.mark.parametrize("name", list(ALL))
def test_bf16_inputs_computed_in_fp32(name):
    lp, olp, adv = inputs(11, dtype=torch.float32)
    lpb, olpb, advb = lp.bfloat16(), olp.bfloat16(), adv.bfloat16()
    lpb.requires_grad_(True)
    loss, met = ALL[name](lpb, olpb, advb, MASK)
    assert loss.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in met.values())
    # same result as fp32 math on the bf16-rounded values
    ref, _ = ALL[name](lpb.detach().float(), olpb.float(), advb.float(), MASK)
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss.sum(), lpb)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()


def test_clip_metrics_of_every_clipping_loss():
    lp, olp, adv = inputs(12, spread=1.0)
    n = MASK.sum().double()
    lr = lp - olp
    r = torch.exp(lr)

    def frac(x):
        return (x & MASK).sum() / n

    seq_s = torch.exp(torch.where(MASK, lr, 0.0).sum(-1) / MASK.sum(-1))[:, None].expand(B, T)
    lo, hi = math.log(0.9), math.log(1.1)
    want = {
        "ppo": (frac((r < 0.8) & (adv < 0)), frac((r > 1.28) & (adv > 0))),
        "gspo": (frac((seq_s < 0.9) & (adv < 0)), frac((seq_s > 1.1) & (adv > 0))),
        "cispo": (frac(r < 0.5), frac(r > 1.1)),
        "gmpo": (frac((lr < lo) & (adv < 0)), frac((lr > hi) & (adv >= 0))),
        "decoupled": (frac((r < 0.8) & (adv < 0)), frac((r > 1.2) & (adv > 0))),
    }
    got = {
        "ppo": ppo_clip_loss(lp, olp, adv, MASK, eps_low=0.2, eps_high=0.28)[1],
        "gspo": gspo_loss(lp, olp, adv, MASK, eps_low=0.1, eps_high=0.1)[1],
        "cispo": cispo_loss(lp, olp, adv, MASK, eps_low=0.5, eps_high=0.1)[1],
        "gmpo": gmpo_loss(lp, olp, adv, MASK, eps_low=0.1, eps_high=0.1)[1],
        "decoupled": decoupled_ppo_loss(lp, olp, adv, MASK, rollout_logp=olp - 0.3)[1],
    }
    for name, met in got.items():
        low, high = want[name]
        assert 0 < low + high < 1, name  # the data exercise both bounds somewhere
        torch.testing.assert_close(met["clipfrac_low"], low, msg=name)
        torch.testing.assert_close(met["clipfrac_high"], high, msg=name)
        torch.testing.assert_close(met["clipfrac"], low + high, msg=name)  # disjoint (no dual clip here)
    k3 = (r - 1 - lr)[MASK].mean()
    for name, fn in LOSSES.items():
        met = fn(lp, olp, adv, MASK)[1]
        want_kl = torch.zeros((), dtype=torch.float64) if name == "pg_on_policy" else k3
        torch.testing.assert_close(met["approx_kl"], want_kl, msg=name)
    _, met = ppo_clip_loss(lp, olp, adv, MASK, dual_clip=1.5)
    torch.testing.assert_close(met["clipfrac"], met["clipfrac_low"] + met["clipfrac_high"] + met["dual_clipfrac"])
    assert met["dual_clipfrac"] > 0
