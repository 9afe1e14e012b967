"""KL estimators and controllers."""

import math

import pytest
import torch

from rlblocks.losses import AdaptiveKLController, FixedKLController, kl_estimate

L_VALUES = torch.tensor([-3.0, -1.0, -0.1, 0.0, 0.5, 1.0, 2.5], dtype=torch.float64)


def ref(kind, x):
    k3 = math.exp(-x) - 1 + x
    return {"k1": x, "k2": 0.5 * x * x, "k3": k3, "abs": abs(x), "low_var_kl": min(max(k3, -10), 10)}[kind]


def test_k3_published_values():
    k3 = kl_estimate(torch.tensor([1.0, -1.0]), torch.zeros(2), kind="k3")
    torch.testing.assert_close(k3, torch.tensor([0.3679, 0.7183]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "low_var_kl"])
def test_estimators_match_reference(kind):
    ref_logp = torch.full_like(L_VALUES, -2.0)
    got = kl_estimate(ref_logp + L_VALUES, ref_logp, kind=kind)
    torch.testing.assert_close(got, torch.tensor([ref(kind, x) for x in L_VALUES.tolist()], dtype=torch.float64))


def test_low_var_kl_is_clamped():
    got = kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), kind="low_var_kl")
    assert got.item() == 10.0
    assert torch.isfinite(kl_estimate(torch.tensor([-200.0]), torch.tensor([0.0]), kind="k3")).all()


def test_k3_is_unbiased_for_reverse_kl():
    # Exact expectation over a categorical π: E_π[k3] = E_π[k1] = KL(π‖π_ref).
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = (p * (p.log() - q.log())).sum()
    for kind in ("k1", "k3"):
        est = (p * kl_estimate(p.log(), q.log(), kind=kind)).sum()
        torch.testing.assert_close(est, true_kl)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "low_var_kl"])
def test_straight_through_has_k2_gradient(kind):
    ref_logp = torch.full_like(L_VALUES, -1.0)
    lp = (ref_logp + L_VALUES).requires_grad_(True)
    st = kl_estimate(lp, ref_logp, kind=kind, straight_through=True)
    torch.testing.assert_close(st.detach(), kl_estimate(lp.detach(), ref_logp, kind=kind))
    (g,) = torch.autograd.grad(st.sum(), lp)
    torch.testing.assert_close(g, L_VALUES)  # d(l²/2)/dlogp = l


def test_kl_gradcheck():
    ref_logp = torch.full_like(L_VALUES, -1.0)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        lp = (ref_logp + L_VALUES).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda x, k=kind: kl_estimate(x, ref_logp, kind=k), (lp,))


def test_kl_bf16_computed_in_fp32():
    out = kl_estimate(torch.tensor([0.5], dtype=torch.bfloat16), torch.tensor([0.0], dtype=torch.bfloat16))
    assert out.dtype == torch.float32


def test_fixed_controller():
    c = FixedKLController(0.05)
    assert c.update(10.0, 100) == 0.05 and c.value == 0.05


def test_adaptive_controller_follows_ppo_rule():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # proportional error clipped to +0.2: kl = 12 -> error = min(1, 0.2)
    assert c.update(12.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    v = c.value
    # inside the band: kl = 5.4 -> error = -0.1
    assert c.update(torch.tensor(5.4), 512) == pytest.approx(v * (1 - 0.1 * 512 / 10000))
    v = c.value
    # clipped to -0.2: kl = 0
    assert c.update(0.0, 1000) == pytest.approx(v * (1 - 0.2 * 1000 / 10000))
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=1)
    with pytest.raises(ValueError, match="n_steps"):
        c.update(1.0, -1)
