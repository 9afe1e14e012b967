"""Advantage estimators against float64 loop references and published values."""

import math
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlblocks.losses import (
    discounted_returns,
    gae,
    gdpo_advantages,
    grpo_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    whiten,
)

SETTINGS = settings(max_examples=25, deadline=None)


def groups_of(ids):
    g = defaultdict(list)
    for i, k in enumerate(ids):
        g[k].append(i)
    return g


def ref_std(xs):
    n = len(xs)
    if n < 2:
        return 0.0
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1))


def ref_grpo(r, ids, std_scale, eps):
    out = [0.0] * len(r)
    batch_std = ref_std(r)
    for idx in groups_of(ids).values():
        xs = [r[i] for i in idx]
        if len(xs) == 1:
            continue
        mu = sum(xs) / len(xs)
        sd = {"group": ref_std(xs), "batch": batch_std, "none": None}[std_scale]
        for i in idx:
            out[i] = (r[i] - mu) if sd is None else (r[i] - mu) / (sd + eps)
    return out


def rand_groups(seed, n=13):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([7, 7, 7, -3, 100, 100, 7, 42, 42, 42, 42, -3, 5])[:n]
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    return rewards, ids


def test_grpo_low_variance_group_golden():
    # The two-pass fp64 variance keeps [1.0, 1.00001] exact (verl's one-pass form gave ±0.005).
    r = torch.tensor([1.0, 1.00001])
    ids = torch.tensor([3, 3])
    a9 = grpo_advantages(r, ids, eps=1e-9)
    torch.testing.assert_close(a9, torch.tensor([-0.7070, 0.7070]), atol=2e-4, rtol=0)
    a6 = grpo_advantages(r, ids, eps=1e-6)  # default eps (verl / SLIME): ±0.62
    ref = ref_grpo([float(x) for x in r.double()], [3, 3], "group", 1e-6)
    torch.testing.assert_close(a6, torch.tensor(ref, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert abs(a6[1].item() - 0.62) < 0.005


@pytest.mark.parametrize("std_scale", ["group", "batch", "none"])
def test_grpo_matches_reference(std_scale):
    r, ids = rand_groups(0)
    got = grpo_advantages(r, ids, std_scale=std_scale, eps=1e-4)
    ref = ref_grpo(r.tolist(), ids.tolist(), std_scale, 1e-4)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))
    assert got[12].item() == 0.0  # singleton group 5


def test_grpo_dtypes():
    r = torch.tensor([1, 0, 1, 1], dtype=torch.int64)
    ids = torch.tensor([0, 0, 1, 1])
    out = grpo_advantages(r, ids)
    assert out.dtype == torch.float32
    assert out[2] == 0 and out[3] == 0 and out[0] > 0
    assert grpo_advantages(r.bfloat16(), ids).dtype == torch.float32


def test_rloo_matches_reference():
    r, ids = rand_groups(1)
    ref = [0.0] * len(r)
    for idx in groups_of(ids.tolist()).values():
        k = len(idx)
        if k == 1:
            continue
        tot = sum(r[i].item() for i in idx)
        for i in idx:
            ref[i] = r[i].item() - (tot - r[i].item()) / (k - 1)
    torch.testing.assert_close(rloo_advantages(r, ids), torch.tensor(ref, dtype=torch.float64))


def test_opo_matches_reference():
    r, ids = rand_groups(2)
    lengths = torch.arange(3, 3 + len(r))
    ref = [0.0] * len(r)
    for idx in groups_of(ids.tolist()).values():
        if len(idx) == 1:
            continue
        b = sum(lengths[i].item() * r[i].item() for i in idx) / sum(lengths[i].item() for i in idx)
        for i in idx:
            ref[i] = r[i].item() - b
    torch.testing.assert_close(opo_advantages(r, ids, lengths), torch.tensor(ref, dtype=torch.float64))


def test_passk_matches_reference():
    r = torch.tensor([0.1, 0.9, 0.5, 2.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    ids = torch.tensor([1, 1, 1, 2, 2, 2, 9])
    # group 1: best 0.9, second 0.5 -> 0.4 for the best only; group 2: tie at 2.0 -> all 0; singleton -> 0
    want = torch.tensor([0, 0.4, 0, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(passk_advantages(r, ids), want)


def test_gdpo_matches_reference():
    g = torch.Generator().manual_seed(3)
    r = torch.randn(9, 2, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    eps = 1e-6
    s = [0.0] * 9
    for f in range(2):
        col = r[:, f].tolist()
        norm = ref_grpo(col, ids.tolist(), "group", eps)
        for i in range(9):
            s[i] += w[f].item() * norm[i]
    mu = sum(s) / 9
    sd = ref_std(s)
    ref = [(x - mu) / (sd + eps) for x in s]
    torch.testing.assert_close(gdpo_advantages(r, ids, w), torch.tensor(ref, dtype=torch.float64))


def test_remax():
    torch.testing.assert_close(
        remax_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5])), torch.tensor([0.5, -0.5, 0.0])
    )


def ref_whiten(x, m, eps, shift_mean=True):
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if m[i][j]]
    n = len(vals)
    mu = sum(vals) / max(n, 1)
    var = sum((v - mu) ** 2 for v in vals) / max(n - 1, 1)
    out = [[0.0] * len(x[0]) for _ in x]
    for i in range(len(x)):
        for j in range(len(x[0])):
            if m[i][j]:
                out[i][j] = (x[i][j] - mu) / math.sqrt(var + eps) + (0 if shift_mean else mu)
    return out


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shift_mean):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64) * 3 + 1
    m = torch.rand(3, 5, generator=g) > 0.3
    ref = ref_whiten(x.tolist(), m.tolist(), 1e-8, shift_mean)
    torch.testing.assert_close(whiten(x, m, shift_mean=shift_mean), torch.tensor(ref, dtype=torch.float64))


def test_reinforce_pp_baseline_matches_reference():
    r, ids = rand_groups(5, n=6)
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    centred = [0.0] * 6
    for idx in groups_of(ids.tolist()).values():
        mu = sum(r[i].item() for i in idx) / len(idx)
        for i in idx:
            centred[i] = r[i].item() - mu
    scores = [[centred[i]] * 3 for i in range(6)]
    ref = ref_whiten(scores, m.tolist(), 1e-8)
    got = reinforce_pp_baseline_advantages(r, ids, m)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))


def ref_gae(r, v, m, gamma, lam):
    b, t = len(r), len(r[0])
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        valid = [j for j in range(t) if m[i][j]]
        for k, j in enumerate(valid):
            a = 0.0
            for s, jj in enumerate(valid[k:]):
                nxt = v[i][valid[k + s + 1]] if k + s + 1 < len(valid) else 0.0
                a += (gamma * lam) ** s * (r[i][jj] + gamma * nxt - v[i][jj])
            adv[i][j] = a
            ret[i][j] = a + v[i][j]
    return adv, ret


def test_gae_matches_reference_and_skips_masked():
    g = torch.Generator().manual_seed(6)
    r = torch.randn(3, 7, generator=g, dtype=torch.float64)
    v = torch.randn(3, 7, generator=g, dtype=torch.float64)
    m = torch.tensor(
        [[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )  # row 0: a tool span at 2..3 and padding; row 2 empty
    adv_ref, ret_ref = ref_gae(r.tolist(), v.tolist(), m.tolist(), 0.9, 0.8)
    r_nan = torch.where(m, r, torch.nan)
    v_inf = torch.where(m, v, torch.inf)
    adv, ret = gae(r_nan, v_inf, m, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor(adv_ref, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ret_ref, dtype=torch.float64))


def test_discounted_returns_equal_gae_with_zero_values():
    g = torch.Generator().manual_seed(7)
    r = torch.randn(2, 6, generator=g, dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ret = discounted_returns(r, m, gamma=0.7)
    ref = [[0.0] * 6 for _ in range(2)]
    for i in range(2):
        valid = [j for j in range(6) if m[i, j]]
        for k, j in enumerate(valid):
            ref[i][j] = sum(0.7**s * r[i, jj].item() for s, jj in enumerate(valid[k:]))
    torch.testing.assert_close(ret, torch.tensor(ref, dtype=torch.float64))
    adv, _ = gae(r, torch.zeros_like(r), m, gamma=0.7, lam=1.0)
    torch.testing.assert_close(ret, adv)


group_data = st.lists(
    st.tuples(st.integers(-5, 5), st.floats(-10, 10, allow_nan=False, width=32)), min_size=1, max_size=24
)


@SETTINGS
@given(data=group_data, seed=st.integers(0, 2**16))
def test_group_advantages_sum_to_zero_and_are_permutation_equivariant(data, seed):
    ids = torch.tensor([d[0] for d in data])
    r = torch.tensor([d[1] for d in data], dtype=torch.float64)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    for fn in (
        lambda r, i: grpo_advantages(r, i, std_scale="group"),
        lambda r, i: grpo_advantages(r, i, std_scale="none"),
        lambda r, i: grpo_advantages(r, i, std_scale="batch"),
        rloo_advantages,
    ):
        a = fn(r, ids)
        assert torch.isfinite(a).all()
        for k in ids.unique().tolist():
            sel = ids == k
            scale = 1 + r[sel].abs().max().item()
            assert abs(a[sel].sum().item()) <= 1e-9 * scale * (1 + a[sel].abs().max().item())
        torch.testing.assert_close(fn(r[perm], ids[perm]), a[perm], rtol=1e-9, atol=1e-9)
    lengths = torch.arange(1, len(data) + 1)
    o = opo_advantages(r, ids, lengths)
    for k in ids.unique().tolist():  # OPO's length-weighted advantages sum to zero per group
        sel = ids == k
        assert abs((o[sel] * lengths[sel]).sum().item()) <= 1e-9 * (1 + r[sel].abs().max().item()) * lengths.sum()
    torch.testing.assert_close(opo_advantages(r[perm], ids[perm], lengths[perm]), o[perm])
    torch.testing.assert_close(passk_advantages(r[perm], ids[perm]), passk_advantages(r, ids)[perm])
