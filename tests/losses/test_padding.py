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
        "mismatch_metrics": tuple(L.mismatch_metrics(lp, old, mask).values()),
        "opsm": L.off_policy_sequence_mask(torch.randn(B, generator=g), lp, old, mask, delta=0.0),
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
