"""On-policy distillation advantages against a float64 loop reference (tinker-cookbook's convention)."""

import pytest
import torch

import rlblocks.losses as L

NAN = float("nan")
B, T = 4, 6


@pytest.mark.parametrize("discount", [None, 0.0, 0.5, 1.0])
def test_distill_advantages_reference(discount):
    m = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)
    g = torch.Generator().manual_seed(7)
    student = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = [[0.0] * T for _ in range(B)]
    for i in range(B):
        x = [teacher[i, j].item() - student[i, j].item() if m[i, j] else 0.0 for j in range(T)]
        for j in range(T):
            if m[i, j]:
                ref[i][j] = x[j] if not discount else sum(discount ** (k - j) * x[k] for k in range(j, T))
    got = L.distill_advantages(torch.where(m, student, NAN), torch.where(m, teacher, -torch.inf), m,
                               discount=discount)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64))
    assert not got.requires_grad


def test_distill_advantages_sign_lowers_reverse_kl():
    # one step of pg_loss with these advantages moves the student toward the teacher on the sampled tokens
    student = torch.log(torch.tensor([[0.5, 0.1, 0.3]], dtype=torch.float64)).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.2, 0.4, 0.3]], dtype=torch.float64))
    m = torch.ones(1, 3, dtype=torch.bool)
    adv = L.distill_advantages(student, teacher, m)
    loss, _ = L.pg_loss(student, None, adv, m)
    (g,) = torch.autograd.grad(loss.sum(), student)
    assert g[0, 0] > 0 and g[0, 1] < 0 and g[0, 2] == 0  # descent lowers an over-confident token, raises the other


def test_distill_nan_propagates_and_checks():
    m = torch.ones(1, 3, dtype=torch.bool)
    s = torch.zeros(1, 3)
    t = torch.tensor([[0.0, NAN, 0.0]])
    assert torch.isnan(L.distill_advantages(s, t, m)).tolist() == [[False, True, False]]
    assert torch.isnan(L.distill_advantages(s, t, m, discount=0.9)).tolist() == [[True, True, False]]
    with pytest.raises(ValueError, match=r"^discount: "):
        L.distill_advantages(s, t, m, discount=1.5)
    with pytest.raises(ValueError, match=r"^teacher_logp: .*\[1, 3\].*\[1, 2\]"):
        L.distill_advantages(s, t[:, :2], m)
    assert L.distill_advantages(s.bfloat16(), t.bfloat16(), m).dtype == torch.float32
