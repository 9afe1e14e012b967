"""Non-finite values: in valid data they propagate (never vanish); in padding they never leak.

Each test below pins one rule that an earlier version broke: a NaN reward turned into a 0 advantage, a NaN weight
dropped its token, a NaN entropy emptied the mask, NaN padding reached the gradient of k2, a bad count was read as 1.
"""

import math

import pytest
import torch

import rlblocks.losses as L

NAN, INF = float("nan"), float("inf")


def ids(*xs):
    return torch.tensor(xs, dtype=torch.long)


# ---- advantages: a non-finite reward poisons its own group, and only it -------------------------------------------


def test_passk_nan_reward_propagates():
    out = L.passk_advantages(torch.tensor([NAN, 0.5, 1.0]), ids(0, 0, 0))
    assert torch.isnan(out).all(), out


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_singleton_group_with_nonfinite_reward_is_nan(bad):
    r = torch.tensor([bad, 1.0, 0.0, 2.0], dtype=torch.float64)
    g = ids(5, 1, 1, 9)  # group 5: the bad singleton; group 1: a normal pair; group 9: a normal singleton
    outs = {
        "grpo": L.grpo_advantages(r, g),
        "grpo_none": L.grpo_advantages(r, g, std_scale="none"),
        "rloo": L.rloo_advantages(r, g),
        "opo": L.opo_advantages(r, g, torch.tensor([3, 4, 5, 6])),
        "passk": L.passk_advantages(r, g),
    }
    for name, a in outs.items():
        assert torch.isnan(a[0]), (name, a)
        assert torch.isfinite(a[1:]).all(), (name, a)  # other groups are untouched
        assert a[3] == 0, (name, a)  # a finite singleton still gives 0
    # GDPO whitens over the batch, so a NaN anywhere reaches every sample (it must not be dropped as 0).
    gd = L.gdpo_advantages(torch.stack([r, r], 1), g, torch.tensor([1.0, 1.0]))
    assert torch.isnan(gd).all(), gd


def test_nonfinite_reward_poisons_whole_group_for_every_group_estimator():
    r = torch.tensor([1.0, INF, 0.0, 0.5, 0.25], dtype=torch.float64)
    g = ids(0, 0, 0, 1, 1)
    for name, a in {
        "grpo": L.grpo_advantages(r, g),
        "rloo": L.rloo_advantages(r, g),
        "opo": L.opo_advantages(r, g, torch.tensor([1, 2, 3, 4, 5])),
        "passk": L.passk_advantages(r, g),
    }.items():
        assert torch.isnan(a[:3]).all(), (name, a)
        assert torch.isfinite(a[3:]).all(), (name, a)


def test_opo_nonfinite_length_poisons_its_group():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    lengths = torch.tensor([NAN, 3.0, 2.0, 2.0], dtype=torch.float64)
    a = L.opo_advantages(r, ids(0, 0, 1, 1), lengths)
    assert torch.isnan(a[:2]).all() and torch.isfinite(a[2:]).all(), a


def test_zero_variance_groups_never_flags_a_nonfinite_group():
    # True would let dynamic sampling discard the group, and the bad reward with it. A group holding a NaN or an
    # infinity is never reported as zero-variance: it stays in the batch, where its advantages are NaN.
    r = torch.tensor([NAN, INF, INF, 1.0, NAN, -INF, 2.0, 2.0])
    got = L.zero_variance_groups(r, ids(0, 1, 1, 2, 2, 3, 4, 4))
    assert got.tolist() == [False, False, False, False, False, False, True, True]


# ---- losses and masks: a non-finite value at a valid token keeps the token ----------------------------------------


@pytest.mark.parametrize("bad", [NAN, INF])
def test_decoupled_cap_keeps_token_with_nonfinite_rollout_logp(bad):
    lp = torch.zeros(1, 3, dtype=torch.float64)
    rollout = torch.tensor([[0.0, -bad if bad == INF else bad, 0.0]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.ones(1, dtype=torch.float64)
    loss, met = L.decoupled_ppo_loss(lp, lp, adv, m, rollout_logp=rollout, rollout_weight_cap=5.0)
    if bad != bad:  # NaN weight: the token's loss is NaN, not 0
        assert torch.isnan(loss[0, 1]), loss
        assert torch.isnan(met["rollout_weight_mean"])
    else:  # π_old/π_rollout = e^{+inf}: over the cap, dropped and counted
        assert loss[0, 1] == 0 and met["rollout_capped_frac"].item() == pytest.approx(1 / 3)
    assert (loss[0, [0, 2]] == -1).all()


def test_rollout_correction_mask_mode_keeps_nan_ratio():
    old = torch.zeros(1, 4, dtype=torch.float64)
    rollout = torch.tensor([[0.0, NAN, 2.0, 0.0]], dtype=torch.float64)
    m = torch.ones(1, 4, dtype=torch.bool)
    w, keep, met = L.rollout_correction(old, rollout, m, mode="mask", upper=2.0, lower=0.5)
    assert keep.tolist() == [[True, True, False, True]]  # ρ = e^{-2} is out of band; the NaN is kept
    assert torch.isnan(w[0, 1]) and w[0, 2] == 0
    assert met["masked_frac"].item() == pytest.approx(0.25)
    w, keep, met = L.rollout_correction(old, rollout, m, mode="truncate", upper=2.0, lower=0.5)
    assert keep.all() and torch.isnan(w[0, 1]) and w[0, 2] == 0.5
    assert met["clipped_frac"].item() == pytest.approx(0.25)  # only the truncated e^{-2}; the NaN is not "clipped"


def test_top_entropy_mask_with_one_nan_entropy():
    g = torch.Generator().manual_seed(1)
    ent = torch.rand(3, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) > 0.2
    mask[1, 2] = True
    ent[1, 2] = NAN
    got = L.top_entropy_mask(ent, mask, quantile=0.5)
    finite = mask & ~torch.isnan(ent)
    thr = torch.quantile(ent[finite], 0.5)
    want = finite & (ent >= thr)
    want[1, 2] = True  # the NaN token is kept (not silently dropped); its quantile ignores it
    assert got.tolist() == want.tolist()
    assert got.sum() > 1


# ---- kl_estimate: the padding rule holds for every kind, with and without a mask ---------------------------------

KINDS = ("k1", "k2", "k3", "abs", "low_var_kl")


def _kl_ref(kind, x):
    k3 = math.exp(-x) - 1 + x
    return {"k1": x, "k2": 0.5 * x * x, "k3": k3, "abs": abs(x), "low_var_kl": min(max(k3, -10), 10)}[kind]


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("straight_through", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_kl_padding_never_reaches_value_or_gradient(kind, straight_through, with_mask, fill):
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    lr = torch.rand(2, 5, generator=g, dtype=torch.float64) * 2 - 1
    lp = torch.where(mask, ref + lr, fill).requires_grad_(True)
    ref_p = torch.where(mask, ref, torch.where(torch.arange(5) % 2 == 0, fill, 0.0))  # padding in both inputs
    kl = L.kl_estimate(lp, ref_p, kind=kind, straight_through=straight_through, mask=mask if with_mask else None)
    want = torch.tensor([[_kl_ref(kind, x) for x in row] for row in lr.tolist()], dtype=torch.float64)
    torch.testing.assert_close(kl[mask], want[mask])
    if with_mask:
        assert (kl[~mask] == 0).all()
    for mode in L.AGG_MODES:
        total = L.aggregate(kl, mask, mode=mode)
        (grad,) = torch.autograd.grad(total, lp, retain_graph=True)
        assert torch.isfinite(total), mode
        assert torch.isfinite(grad).all() and (grad[~mask] == 0).all(), (mode, grad)
    # gradient at the valid tokens: of k2 (l) with straight-through, else of the kind itself
    (grad,) = torch.autograd.grad(L.aggregate(kl, mask, mode="token-sum"), lp)
    x = lr[mask]
    dk3 = 1 - torch.exp(-x)
    d = {"k1": torch.ones_like(x), "k2": x, "k3": dk3, "abs": torch.sign(x), "low_var_kl": dk3}
    torch.testing.assert_close(grad[mask], x if straight_through else d[kind])


def test_kl_without_mask_nan_in_valid_data_still_propagates():
    # Without a mask nothing tells padding from data: a non-finite log-ratio gives a NaN value (so a NaN at a valid
    # token shows in any loss that reads it) and a zero gradient (so padding cannot poison the gradient).
    lp = torch.tensor([0.0, NAN, -1.0], requires_grad=True)
    kl = L.kl_estimate(lp, torch.zeros(3), kind="k2")
    assert torch.isnan(kl[1]) and torch.isnan(kl.sum())


# ---- aggregate: counts that cannot be right propagate NaN (tensor) or raise (Python) ------------------------------

MODES_COUNTS = [
    ("token-mean", "num_tokens"),
    ("seq-mean-token-mean", "num_seqs"),
    ("seq-mean-token-sum", "num_seqs"),
    ("seq-mean-token-sum-norm", "num_seqs"),
    ("seq-mean-token-sum-norm", "max_len"),
]


@pytest.mark.parametrize(("mode", "arg"), MODES_COUNTS)
@pytest.mark.parametrize("bad", [-3.0, NAN, INF, -INF])
def test_aggregate_bad_tensor_count_gives_nan(mode, arg, bad):
    x = torch.ones(2, 3, requires_grad=True)
    m = torch.ones(2, 3, dtype=torch.bool)
    out = L.aggregate(x, m, mode=mode, **{arg: torch.tensor(bad)})
    assert torch.isnan(out), (mode, arg, bad, out)


@pytest.mark.parametrize(("mode", "arg"), MODES_COUNTS)
@pytest.mark.parametrize("bad", [-3, -0.5, NAN, INF, True])
def test_aggregate_bad_python_count_raises(mode, arg, bad):
    with pytest.raises(ValueError, match=f"^{arg}: "):
        L.aggregate(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), mode=mode, **{arg: bad})


@pytest.mark.parametrize(("mode", "arg"), MODES_COUNTS)
@pytest.mark.parametrize("zero", [0, 0.0, torch.tensor(0), torch.tensor([0.0])])
def test_aggregate_zero_count(mode, arg, zero):
    x = torch.full((2, 3), NAN, requires_grad=True)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    out = L.aggregate(x, empty, mode=mode, **{arg: zero})  # nothing valid anywhere: 0, gradient 0
    assert out.item() == 0
    (grad,) = torch.autograd.grad(out, x)
    assert (grad == 0).all()
    # valid tokens here but a global count of 0: no right answer exists, so the loss is NaN (not a silent sum)
    assert torch.isnan(L.aggregate(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), mode=mode, **{arg: zero}))


def test_aggregate_valid_tensor_counts_unchanged():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert L.aggregate(x, m, num_tokens=torch.tensor(6)).item() == pytest.approx(7 / 6)
    assert L.aggregate(x, m, num_tokens=6.0).item() == pytest.approx(7 / 6)
    assert L.aggregate(x, m, num_tokens=torch.tensor(0.5)).item() == pytest.approx(14.0)  # fractional counts allowed
