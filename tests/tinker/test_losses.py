"""Every served Tinker loss against Tinker's documented formula, in float64 (value and gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from rlblocks.errors import RequestError
from rlblocks.tinker.losses import LOSS_FNS, check_loss_config, check_loss_inputs, tinker_loss

B, T = 3, 7


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 2])
    mask = torch.arange(T)[None] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    q = logp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios on both sides of the clips
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64)
    ratio_mask = (torch.rand(B, T, generator=g) < 0.7).double()
    adv = adv * ratio_mask  # gspo: advantages live on the ratio tokens, as the recipes build them
    # padding holds garbage that must never reach the loss or the gradient
    for t in (q, adv, weights):
        t[~mask] = float("nan")
    return logp, {"logprobs": q, "advantages": adv, "weights": weights, "sequence_ratio_mask": ratio_mask}, mask


# Tinker's documented per-datum losses, written from its loss docs (sum over the datum's tokens).
def ref_loss(loss_fn, cfg, lp, inp):
    q, a = inp.get("logprobs"), inp.get("advantages")
    if loss_fn == "cross_entropy":
        return (-lp * inp["weights"]).sum()
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * a).sum()
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if loss_fn == "ppo":
        return -torch.min(ratio * a, torch.clamp(ratio, lo, hi) * a).sum()
    if loss_fn == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * lp * a).sum()
    if loss_fn == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if loss_fn == "gspo":
        in_ratio = inp["sequence_ratio_mask"] != 0
        log_ratio = (lp.detach() - q)[in_ratio].mean()
        r = torch.exp(log_ratio + lp - lp.detach())
        return -torch.min(r * a, torch.clamp(r, lo, hi) * a).sum()
    raise AssertionError(loss_fn)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("ppo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.5}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.28}),
    ("dro", {}),
    ("dro", {"beta": 0.3}),
    ("gspo", {}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}),
]


@pytest.mark.parametrize("loss_fn,config", CASES)
def test_loss_matches_tinker_formula_in_float64(loss_fn, config):
    logp, inputs, mask = _batch()
    cfg = check_loss_config(loss_fn, config)
    lp = logp.clone().requires_grad_(True)
    loss, per = tinker_loss(loss_fn, cfg, lp, inputs, mask)
    loss.backward()
    assert per.dtype == torch.float64 and bool((per[~mask] == 0).all())
    ref_total = torch.zeros((), dtype=torch.float64)
    ref_grad = torch.zeros_like(logp)
    for b in range(B):
        n = int(mask[b].sum())
        lr = logp[b, :n].clone().requires_grad_(True)
        ref = ref_loss(loss_fn, cfg, lr, {k: v[b, :n] for k, v in inputs.items()})
        ref.backward()
        ref_total = ref_total + ref.detach()
        ref_grad[b, :n] = lr.grad
    torch.testing.assert_close(loss.detach(), ref_total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert bool(torch.isfinite(lp.grad).all())


def test_clip_is_active_in_the_ppo_case():
    """The reference batch really exercises the clip (else the ppo test would not tell ppo from IS)."""
    logp, inputs, mask = _batch()
    r = torch.exp(logp - inputs["logprobs"])[mask]
    assert bool((r < 0.8).any()) and bool((r > 1.2).any())


def test_topk_cross_entropy_sums_every_candidate():
    g = torch.Generator().manual_seed(1)
    k = 4
    logp = -torch.rand(B, T, k, generator=g, dtype=torch.float64)
    w = torch.rand(B, T, k, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    w[2, 3:] = float("nan")
    lp = logp.clone().requires_grad_(True)
    loss, _ = tinker_loss("cross_entropy", {}, lp, {"weights": w}, mask)
    loss.backward()
    keep = mask[..., None].expand_as(w)
    torch.testing.assert_close(loss.detach(), (-logp * w)[keep].sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(lp.grad, torch.where(keep, -w, torch.zeros_like(w)), rtol=0, atol=0)


def test_config_and_refusals_name_the_field():
    with pytest.raises(RequestError, match="loss_fn: 'stable_reinforce' is not supported"):
        check_loss_config("stable_reinforce", None)
    with pytest.raises(RequestError, match="loss_fn: expected one of"):
        check_loss_config("nope", None)
    with pytest.raises(RequestError, match=r"loss_fn_config\['beta'\]: not a parameter of loss_fn 'ppo'"):
        check_loss_config("ppo", {"beta": 1.0})
    with pytest.raises(RequestError, match=r"clip_low_threshold'\]: expected a ratio bound in \[0, 1\]"):
        check_loss_config("ppo", {"clip_low_threshold": 1.3})
    with pytest.raises(RequestError, match="finite"):
        check_loss_config("dro", {"beta": math.nan})
    assert check_loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_input_checks_name_the_field():
    n = 5
    ok = {"target_tokens": torch.zeros(n, dtype=torch.int64), "weights": torch.ones(n)}
    check_loss_inputs("cross_entropy", "data[0]", n, ok)
    with pytest.raises(RequestError, match=r"data\[0\]\.loss_fn_inputs\['weights'\]: expected shape \[5\]"):
        check_loss_inputs("cross_entropy", "data[0]", n, {**ok, "weights": torch.ones(n - 1)})
    with pytest.raises(RequestError, match=r"loss_fn_inputs\['advantages'\]: missing"):
        check_loss_inputs("ppo", "data[0]", n, {"target_tokens": ok["target_tokens"], "logprobs": torch.zeros(n)})
    with pytest.raises(RequestError, match=r"'weights'\]: not an input of loss_fn 'ppo'"):
        check_loss_inputs("ppo", "data[0]", n, {**ok, "logprobs": torch.zeros(n), "advantages": torch.zeros(n)})
    with pytest.raises(RequestError, match="per-token clip thresholds"):
        check_loss_inputs("ppo", "data[2]", n, {"target_tokens": ok["target_tokens"], "logprobs": torch.zeros(n),
                                                "advantages": torch.zeros(n), "clip_low_threshold": torch.zeros(n)})
    with pytest.raises(RequestError, match=r"target_tokens'\]: expected shape \[5\] \(one row"):
        check_loss_inputs("ppo", "d", n, {"target_tokens": torch.zeros(n, 2, dtype=torch.int64),
                                          "logprobs": torch.zeros(n), "advantages": torch.zeros(n)})
    adv = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    with pytest.raises(RequestError, match=r"advantages'\]\[1\]: nonzero outside sequence_ratio_mask"):
        check_loss_inputs("gspo", "d", n, {"target_tokens": ok["target_tokens"], "logprobs": torch.zeros(n),
                                           "advantages": adv, "sequence_ratio_mask": torch.zeros(n)})
    assert set(LOSS_FNS) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
