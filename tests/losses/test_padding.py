"""NaN/inf in padded positions never leak into the outputs (or gradients) of the token-level functions."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlblocks.losses as L

B, T = 3, 6


@settings(max_examples=20, deadline=None)
@given(
    fill=st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30]),
    rows=st.lists(st.integers(0, T), min_size=B, max_size=B),
    seed=st.integers(0, 1000),
)
def test_padding_never_leaks(fill, rows, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(rows)[:, None]
    pad = lambda x: torch.where(mask, x, fill)
    lp = pad(-torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = pad(-torch.rand(B, T, generator=g, dtype=torch.float64))
    x = pad(torch.randn(B, T, generator=g, dtype=torch.float64))
    outs = {
        "gae": L.gae(x, pad(torch.randn(B, T, generator=g, dtype=torch.float64)), mask, gamma=0.9, lam=0.9),
        "discounted_returns": L.discounted_returns(x, mask, gamma=0.9),
        "whiten": L.whiten(x, mask),
        "rpp": L.reinforce_pp_baseline_advantages(torch.randn(B, generator=g), torch.tensor([0, 0, 1]), mask),
        "rollout_correction": L.rollout_correction(lp, old, mask, level="geometric", mode="mask"),
        "mismatch_metrics": tuple(v for k, v in L.mismatch_metrics(lp, old, mask).items() if k != "prob_corr"),
        "opsm": L.off_policy_sequence_mask(lp, old, mask, advantages=torch.randn(B, generator=g), delta=0.0),
        "top_entropy_mask": L.top_entropy_mask(x, mask, quantile=0.5),
    }
    for name, out in outs.items():
        for t in out if isinstance(out, tuple) else (out,):
            t = t if isinstance(t, torch.Tensor) else torch.stack(list(t.values()))
            assert torch.isfinite(t.double()).all(), name
            if t.shape == mask.shape:
                assert (t[~mask] == 0).all(), name
    kl = L.kl_estimate(lp, old, kind="k3", straight_through=True, mask=mask)
    assert (kl[~mask] == 0).all()
    for mode in L.AGG_MODES:
        total = L.aggregate(kl, mask, mode=mode)
        (grad,) = torch.autograd.grad(total, lp, retain_graph=True)
        assert torch.isfinite(total) and torch.isfinite(grad).all() and (grad[~mask] == 0).all()


@settings(max_examples=20, deadline=None)
@given(
    fill=st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30]),
    rows=st.lists(st.integers(0, T), min_size=B, max_size=B),
    seed=st.integers(0, 1000),
)
def test_new_masks_and_losses_ignore_padding(fill, rows, seed):
    """Same outputs (and gradient) whatever the padding holds: compare with a run on zero padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(rows)[:, None]
    base_lp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    base_old = base_lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    versions = torch.randint(-1, 4, (B, T), generator=g)
    turns = torch.randint(0, 3, (B, T), generator=g)

    def run(lp, old):
        return {
            "geo": L.geometric_sequence_mask(lp, old, mask, lower=0.9, upper=1.1),
            "outlier": L.outlier_sequence_mask(lp, old, mask, lower=0.7, upper=1.4),
            "icepop": L.icepop_correction(lp, old, mask, lower=0.8, upper=1.2),
            "segment": L.rollout_correction(lp, old, mask, level="segment", turn_ids=turns),
            "runs": L.rollout_correction(lp, old, mask, level="segment", mode="mask", lower=0.8),
            "dppo_mask": L.dppo_mask(lp, old, adv, mask),
            "distill": L.distill_advantages(lp, old, mask, discount=0.8),
            "mismatch": L.mismatch_metrics(lp, old, mask, versions=versions, current_version=3, max_staleness=2),
        }

    def flat(out):
        items = out if isinstance(out, tuple) else (out,)
        res = []
        for x in items:
            res.extend(x.values() if isinstance(x, dict) else [x])
        return res

    clean = run(torch.where(mask, base_lp, 0.0), torch.where(mask, base_old, 0.0))
    dirty = run(torch.where(mask, base_lp, fill), torch.where(mask, base_old, fill))
    for name in clean:
        for a, b in zip(flat(clean[name]), flat(dirty[name]), strict=True):
            torch.testing.assert_close(a, b, equal_nan=True, msg=name)
    lp = torch.where(mask, base_lp, fill).requires_grad_(True)
    loss, met = L.dppo_loss(lp, torch.where(mask, base_old, fill), adv, mask, kl_coef=0.5)
    (grad,) = torch.autograd.grad(L.aggregate(loss, mask), lp)
    assert torch.isfinite(loss).all() and (loss[~mask] == 0).all()
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in met.values())
