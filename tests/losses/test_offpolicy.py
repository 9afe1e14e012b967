"""Off-policy masks, segment-level IS and DPPO against float64 loop references."""

import math

import pytest
import torch

import rlblocks.losses as L

NAN = float("nan")
B, T = 4, 6
MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool
)


def logps(seed, spread):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = roll + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    return old, roll


def padded(x, fill=NAN):
    return torch.where(MASK, x, fill)


def rows(m):
    return [[j for j in range(T) if m[i][j]] for i in range(B)]


def clampf(x):
    return min(max(x, -20.0), 20.0)


# ---- sequence masks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lo", "hi"), [(0.99, 1.01), (0.9, 1.05), (1.0, 1.0)])
def test_geometric_sequence_mask_reference(lo, hi):
    old, roll = logps(0, 0.1)
    keep, met = L.geometric_sequence_mask(padded(old), padded(roll, torch.inf), MASK, lower=lo, upper=hi)
    want = [[False] * T for _ in range(B)]
    dropped, low, high = 0, 0, 0
    for i, idx in enumerate(rows(MASK.tolist())):
        if not idx:
            continue
        g = math.exp(clampf(sum(old[i, j].item() - roll[i, j].item() for j in idx) / len(idx)))
        ok = lo <= g <= hi
        dropped += not ok
        low += g < lo
        high += g > hi
        for j in idx:
            want[i][j] = ok
    assert keep.tolist() == want
    n_tok = MASK.sum().item()
    assert met["masked_frac"].item() == pytest.approx(sum(MASK[i].sum().item() for i in range(B)
                                                          if MASK[i].any() and not any(want[i])) / n_tok)
    assert met["seq_masked_frac"].item() == pytest.approx(dropped / 3)
    assert met["seq_masked_low_frac"].item() == pytest.approx(low / 3)
    assert met["seq_masked_high_frac"].item() == pytest.approx(high / 3)


@pytest.mark.parametrize(("lo", "hi"), [(1e-4, 100.0), (0.6, 1.6), (None, 1.3), (0.7, None)])
def test_outlier_sequence_mask_reference(lo, hi):
    old, roll = logps(1, 0.8)
    keep, _ = L.outlier_sequence_mask(padded(old), padded(roll), MASK, lower=lo, upper=hi)
    lo_, hi_ = (0.0 if lo is None else lo), (math.inf if hi is None else hi)
    want = [[False] * T for _ in range(B)]
    for i, idx in enumerate(rows(MASK.tolist())):
        ok = all(lo_ <= math.exp(clampf(old[i, j].item() - roll[i, j].item())) <= hi_ for j in idx)
        for j in idx:
            want[i][j] = ok
    assert keep.tolist() == want
    if (lo, hi) == (0.6, 1.6):
        assert any(any(r) for r in want) and not all(all(want[i][j] for j in idx) for i, idx in
                                                     enumerate(rows(MASK.tolist())))  # the case drops something


def test_icepop_reference_and_gradient_zero_outside_band():
    old, roll = logps(2, 1.0)
    w, keep, met = L.icepop_correction(padded(old), padded(roll), MASK, lower=0.5, upper=2.0)
    rho = torch.exp(old - roll)
    want_keep = MASK & (rho >= 0.5) & (rho <= 2.0)
    assert keep.tolist() == want_keep.tolist()
    assert 0 < (MASK & ~want_keep).sum() < MASK.sum()
    torch.testing.assert_close(w, torch.where(want_keep, rho, 0.0))
    assert met["masked_low_frac"].item() == pytest.approx(((rho < 0.5) & MASK).sum().item() / MASK.sum().item())
    # ICEPOP's contract: masked tokens get exactly zero gradient through a policy loss
    lp = old.clone().requires_grad_(True)
    adv = torch.ones(B, dtype=torch.float64)
    loss, _ = L.ppo_clip_loss(lp, old, adv, keep)
    (g,) = torch.autograd.grad(L.aggregate(loss * w, keep, mode="token-sum"), lp)
    assert (g[~want_keep] == 0).all() and (g[want_keep] != 0).all()
    torch.testing.assert_close(g[want_keep], -rho[want_keep])  # -w·A·r at r = 1


def test_sequence_masks_keep_nan_tokens():
    old, roll = logps(3, 0.01)
    roll[0, 2] = NAN
    for fn in (L.geometric_sequence_mask, L.outlier_sequence_mask):
        keep, _ = fn(old, roll, MASK)
        assert keep[0].tolist() == MASK[0].tolist(), fn.__name__
    w, keep, _ = L.icepop_correction(old, roll, MASK)
    assert keep[0, 2] and torch.isnan(w[0, 2])


# ---- segment-level (per turn) truncated IS --------------------------------------------------------------------------


def ref_segment(old, roll, m, turns, mode, lo, hi):
    w = [[0.0] * T for _ in range(B)]
    keep = [[False] * T for _ in range(B)]
    for i in range(B):
        segs = {}
        if turns is None:  # maximal runs of valid tokens
            k = -1
            for j in range(T):
                if m[i][j] and (j == 0 or not m[i][j - 1]):
                    k += 1
                if m[i][j]:
                    segs.setdefault(k, []).append(j)
        else:
            for j in range(T):
                if m[i][j]:
                    segs.setdefault(turns[i][j], []).append(j)
        for idx in segs.values():
            rho = math.exp(clampf(sum(old[i][j] - roll[i][j] for j in idx) / len(idx)))
            for j in idx:
                if mode == "truncate":
                    w[i][j], keep[i][j] = min(rho, hi), True
                elif lo <= rho <= hi:
                    w[i][j], keep[i][j] = rho, True
    return w, keep


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("with_turns", [True, False])
def test_segment_level_matches_reference(mode, with_turns):
    g = torch.Generator().manual_seed(4)
    # multi-turn rows: model tokens of turns 0, 1, 2 separated by masked tool output
    m = torch.tensor(
        [[1, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    turns = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2], [5, 5, 5, 5, 9, 9], [0] * 6])
    roll = -torch.rand(B, T, generator=g, dtype=torch.float64)
    old = roll + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1)
    ref_w, ref_keep = ref_segment(old.tolist(), roll.tolist(), m.tolist(), turns.tolist() if with_turns else None,
                                  mode, 0.8, 1.25)
    w, keep, _ = L.rollout_correction(
        torch.where(m, old, NAN), torch.where(m, roll, torch.inf), m, level="segment", mode=mode,
        upper=1.25, lower=0.8 if mode == "mask" else None, turn_ids=turns if with_turns else None,
    )
    torch.testing.assert_close(w, torch.tensor(ref_w, dtype=torch.float64))
    assert keep.tolist() == ref_keep


def test_segment_turn_ids_split_a_contiguous_run():
    # one contiguous run holding two turns: turn_ids separate them, the run rule cannot
    m = torch.ones(1, 4, dtype=torch.bool)
    old = torch.tensor([[0.2, 0.2, -0.4, -0.4]], dtype=torch.float64)
    roll = torch.zeros(1, 4, dtype=torch.float64)
    w_t, _, _ = L.rollout_correction(old, roll, m, level="segment", upper=None, turn_ids=torch.tensor([[0, 0, 1, 1]]))
    w_r, _, _ = L.rollout_correction(old, roll, m, level="segment", upper=None)
    torch.testing.assert_close(w_t, torch.exp(old))
    torch.testing.assert_close(w_r, torch.full((1, 4), math.exp(-0.1), dtype=torch.float64))


def test_segment_argument_checks():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^turn_ids: only used with level='segment'"):
        L.rollout_correction(x, x, m, turn_ids=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^turn_ids: .*\[2, 3\].*\[2, 2\]"):
        L.rollout_correction(x, x, m, level="segment", turn_ids=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^turn_ids: expected an integer tensor"):
        L.rollout_correction(x, x, m, level="segment", turn_ids=torch.zeros(2, 3))


# ---- DPPO band mask and loss ----------------------------------------------------------------------------------------


def ref_dppo(lp, olp, adv, m, dl, dh, c):
    loss = [[0.0] * T for _ in range(B)]
    keep = [[False] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            if not m[i][j]:
                continue
            a = adv[i][j]
            d = math.exp(lp[i][j]) - math.exp(olp[i][j])
            drop = d > dh if a > 0 else d < -dl
            keep[i][j] = not drop
            lr = lp[i][j] - olp[i][j]
            loss[i][j] = (0.0 if drop else -math.exp(lr) * a) + c * lr * lr
    return loss, keep


@pytest.mark.parametrize(("dl", "dh", "c"), [(0.2, 0.2, 1e-3), (0.05, 0.1, 0.5), (1.0, 1.0, 0.0)])
def test_dppo_matches_reference(dl, dh, c):
    g = torch.Generator().manual_seed(5)
    olp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = olp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * 0.8
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_loss, ref_keep = ref_dppo(lp.tolist(), olp.tolist(), adv.tolist(), MASK.tolist(), dl, dh, c)
    keep, _ = L.dppo_mask(padded(lp), padded(olp), padded(adv), MASK, delta_low=dl, delta_high=dh)
    assert keep.tolist() == ref_keep
    loss, met = L.dppo_loss(padded(lp), padded(olp), padded(adv), MASK, delta_low=dl, delta_high=dh, kl_coef=c)
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    if (dl, dh) == (0.05, 0.1):
        assert 0 < met["clipfrac"] < 1 and met["clipfrac_low"] > 0 and met["clipfrac_high"] > 0
    assert met["clipfrac"].item() == pytest.approx(1 - sum(map(sum, ref_keep)) / MASK.sum().item())
    lr = (lp - olp)[MASK]
    torch.testing.assert_close(met["log_ratio_sq"], (lr * lr).mean())
    torch.testing.assert_close(met["approx_kl"], (torch.exp(lr) - 1 - lr).mean())


def test_dppo_gradient():
    g = torch.Generator().manual_seed(6)
    olp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = (olp + (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * 0.8).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    c = 0.3
    loss, _ = L.dppo_loss(lp, olp, adv, MASK, delta_low=0.1, delta_high=0.1, kl_coef=c)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    keep, _ = L.dppo_mask(lp, olp, adv, MASK, delta_low=0.1, delta_high=0.1)
    lr = (lp - olp).detach()
    want = torch.where(keep, -torch.exp(lr) * adv[:, None], 0.0) + torch.where(MASK, 2 * c * lr, 0.0)
    torch.testing.assert_close(grad, want)
    assert (keep != MASK).any()  # some tokens dropped: only the log² term pulls them
