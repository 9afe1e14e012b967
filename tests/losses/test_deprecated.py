"""Renamed arguments, call forms and metric keys keep working for one release, warn, and point at the caller."""

import warnings

import pytest
import torch

import rlblocks.losses as L

B, T = 3, 4
g = torch.Generator().manual_seed(0)
LP = -torch.rand(B, T, generator=g, dtype=torch.float64)
OLD = LP + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
ROLL = OLD + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
ADV = torch.randn(B, generator=g, dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
W = torch.rand(B, T, generator=g, dtype=torch.float64)


def same(a, b):
    la, ma = a
    lb, mb = b
    torch.testing.assert_close(la, lb)
    assert list(ma) == list(mb)
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k])


def deprecated(fn):
    with pytest.warns(DeprecationWarning, match="deprecated") as rec:
        out = fn()
    assert any(r.filename == __file__ for r in rec), [r.filename for r in rec]  # blames the caller's line
    return out


def silent(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


# ---- pg_loss(logp, old_logp, advantages, mask) ----------------------------------------------------------------------


def test_pg_loss_old_three_argument_form():
    new = silent(lambda: L.pg_loss(LP, None, ADV, MASK, weights=W))
    same(deprecated(lambda: L.pg_loss(LP, ADV, MASK, weights=W)), new)
    same(deprecated(lambda: L.pg_loss(LP, ADV, mask=MASK, weights=W)), new)
    same(deprecated(lambda: L.pg_loss(LP, advantages=ADV, mask=MASK, weights=W)), new)
    assert new[1]["approx_kl"].item() == 0.0  # old_logp=None: π_old = π_θ


def test_pg_loss_new_form_feeds_approx_kl():
    loss, met = silent(lambda: L.pg_loss(LP, OLD, ADV, MASK))
    lr = (LP - OLD)[MASK]
    torch.testing.assert_close(met["approx_kl"], (torch.exp(lr) - 1 - lr).mean())
    torch.testing.assert_close(loss, silent(lambda: L.pg_loss(LP, None, ADV, MASK))[0])  # old_logp not in the loss
    silent(lambda: L.pg_loss(logp=LP, old_logp=OLD, advantages=ADV, mask=MASK))


# ---- decoupled_ppo_loss(logp, old_logp, advantages, mask, *, rollout_logp) ------------------------------------------


def test_decoupled_old_positional_form_and_keywords():
    new = silent(lambda: L.decoupled_ppo_loss(LP, OLD, ADV, MASK, rollout_logp=ROLL, rollout_weight_cap=1.5))
    same(deprecated(lambda: L.decoupled_ppo_loss(LP, OLD, ROLL, ADV, MASK, rollout_weight_cap=1.5)), new)
    same(deprecated(lambda: L.decoupled_ppo_loss(LP, OLD, ROLL, ADV, MASK, behav_weight_cap=1.5)), new)
    same(deprecated(lambda: L.decoupled_ppo_loss(LP, OLD, ADV, MASK, behav_logp=ROLL, rollout_weight_cap=1.5)), new)
    same(
        deprecated(
            lambda: L.decoupled_ppo_loss(
                LP, prox_logp=OLD, behav_logp=ROLL, advantages=ADV, mask=MASK, behav_weight_cap=1.5
            )
        ),
        new,
    )
    with pytest.raises(ValueError, match="both `rollout_logp=` and its deprecated name `behav_logp=`"):
        L.decoupled_ppo_loss(LP, OLD, ADV, MASK, rollout_logp=ROLL, behav_logp=ROLL)


def test_decoupled_old_metric_keys_readable_not_listed():
    _, met = silent(lambda: L.decoupled_ppo_loss(LP, OLD, ADV, MASK, rollout_logp=ROLL, rollout_weight_cap=1.5))
    assert "behav_weight_mean" not in list(met) and "behav_capped_frac" not in list(met)
    assert len(met) == len(set(met)) == 7
    for old, new in (("behav_weight_mean", "rollout_weight_mean"), ("behav_capped_frac", "rollout_capped_frac")):
        assert deprecated(lambda o=old: met[o]) is met[new]
        assert deprecated(lambda o=old: met.get(o)) is met[new]
    assert met.get("nope", 3) == 3
    with pytest.raises(KeyError):
        met["nope"]


# ---- rollout_correction / mismatch_metrics (old_logp, rollout_logp, mask) and OPSM's rollout_logp -------------------


def test_rollout_correction_train_logp_keyword():
    new = silent(lambda: L.rollout_correction(OLD, ROLL, MASK, upper=1.5))
    old = deprecated(lambda: L.rollout_correction(train_logp=OLD, rollout_logp=ROLL, mask=MASK, upper=1.5))
    torch.testing.assert_close(old[0], new[0])
    assert old[1].tolist() == new[1].tolist()
    silent(lambda: L.rollout_correction(old_logp=OLD, rollout_logp=ROLL, mask=MASK))


def test_mismatch_metrics_train_logp_keyword():
    new = silent(lambda: L.mismatch_metrics(OLD, ROLL, MASK))
    old = deprecated(lambda: L.mismatch_metrics(train_logp=OLD, rollout_logp=ROLL, mask=MASK))
    for k in new:
        torch.testing.assert_close(old[k], new[k])
    silent(lambda: L.mismatch_metrics(old_logp=OLD, rollout_logp=ROLL, mask=MASK))


def test_opsm_old_logp_keyword():
    new = silent(lambda: L.off_policy_sequence_mask(-ADV, LP, rollout_logp=ROLL, mask=MASK, delta=0.0))
    old = deprecated(lambda: L.off_policy_sequence_mask(-ADV, LP, old_logp=ROLL, mask=MASK, delta=0.0))
    assert old.tolist() == new.tolist()
