"""Bad input to the loss blocks, tried as an attacker and as a new user would: impossible counts and lengths,
NaN in valid and in padded positions, empty batches, bools and truthy strings where flags or counts are
expected, numpy scalars, multi-element tensors where a scalar is expected.

The losses do no host syncs, so a tensor value that cannot be right gives NaN (value and gradient) instead of an
error (the convention of ``aggregate``'s counts); a host value (a Python or numpy number, a flag) that cannot be
right raises ``ArgumentError`` naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rlblocks.losses as L
from rlblocks.errors import ArgumentError

NAN = float("nan")


# ------------------------------------------------------------------------------------ aggregate: max_len bound
@pytest.mark.parametrize("as_tensor", [False, True])
def test_aggregate_max_len_below_the_longest_row_is_nan(as_tensor):
    """Dr.GRPO divides by ``S·L`` with ``L`` a bound on every row's length: ``max_len=2`` for a row of 4 valid
    tokens used to return a number (scaled by a normaliser that is no bound at all); it is NaN now, value and
    gradient, whether the count is a Python number or an all-reduced tensor (no host sync either way)."""
    x = torch.ones(2, 4, requires_grad=True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    two = torch.tensor(2.0) if as_tensor else 2
    out = L.aggregate(x, mask, mode="seq-mean-token-sum-norm", max_len=two)
    (grad,) = torch.autograd.grad(out, x)
    assert torch.isnan(out) and torch.isnan(grad).all()


def test_aggregate_max_len_is_compared_with_valid_tokens_not_with_T():
    """In a next-token layout ``T`` spans the prompt too, so a ``max_len`` below ``T`` but not below any row's
    valid tokens is right, and gives ``Σ mℓ / (S·L)`` (float64 reference)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 4:7] = True  # 3 response tokens after a prompt
    mask[1, 2:6] = True  # 4
    mask[2, 5:6] = True  # 1
    for max_len in (4, torch.tensor(4), 5.5):
        got = L.aggregate(x, mask, mode="seq-mean-token-sum-norm", max_len=max_len, num_seqs=3)
        want = (x * mask).sum() / (3 * float(max_len))
        torch.testing.assert_close(got, want)
    assert torch.isnan(L.aggregate(x, mask, mode="seq-mean-token-sum-norm", max_len=3))


def test_aggregate_counts_smaller_than_local_ones_stay_allowed():
    """A data-parallel rank whose gradients are averaged over W ranks passes ``global / W``, which may be
    below its own token count: that is not refused."""
    x = torch.ones(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert L.aggregate(x, mask, num_tokens=2).item() == 2.0
    assert L.aggregate(x, mask, mode="seq-mean-token-sum", num_seqs=0.5).item() == 8.0


def test_aggregate_counts_accept_numpy_numbers():
    x = torch.arange(6.0).reshape(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    want = L.aggregate(x, mask, num_tokens=6)
    assert L.aggregate(x, mask, num_tokens=np.int64(6)) == want
    assert L.aggregate(x, mask, num_tokens=np.float32(6)) == want
    for bad in (np.bool_(True), True, "6", torch.tensor([6, 6])):
        with pytest.raises(ArgumentError, match=r"num_tokens: expected"):
            L.aggregate(x, mask, num_tokens=bad)


# --------------------------------------------------------------------------------------------- top_entropy_mask
def test_top_entropy_mask_keeps_a_nan_token_and_ranks_the_rest():
    """A NaN entropy at a valid position has no rank: it is left out of the quantile and its token is kept (a
    mask cannot carry NaN, and raising would need a host sync; kept, the token's NaN log-probs reach the loss).
    The threshold of the other tokens is ``torch.quantile`` of the finite valid entropies."""
    g = torch.Generator().manual_seed(1)
    ent = torch.rand(3, 7, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.2
    mask[1, 3] = True
    ent[1, 3] = NAN  # valid
    mask[2, 5] = False
    ent[2, 5] = NAN  # padding: stays out
    for q in (0.0, 0.5, 0.8, 1.0):
        got = L.top_entropy_mask(ent, mask, quantile=q)
        ranked = mask & ~torch.isnan(ent)
        want = mask & ((ent >= torch.quantile(ent[ranked], q)) | torch.isnan(ent))
        assert torch.equal(got, want) and got[1, 3] and not got[2, 5]


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_top_entropy_mask_empty_batch(shape):
    """An empty batch used to raise an IndexError-like RuntimeError from the quantile gather."""
    out = L.top_entropy_mask(torch.zeros(shape), torch.ones(shape, dtype=torch.bool), quantile=0.8)
    assert out.shape == shape and out.dtype == torch.bool
    assert not L.top_entropy_mask(torch.rand(2, 3), torch.zeros(2, 3, dtype=torch.bool), quantile=0.5).any()


def test_top_entropy_mask_quantile_must_be_a_number():
    for bad in (True, "0.8", torch.tensor(0.8), NAN, 1.5):
        with pytest.raises(ArgumentError, match=r"quantile: expected"):
            L.top_entropy_mask(torch.rand(2, 3), torch.ones(2, 3), quantile=bad)
    want = L.top_entropy_mask(torch.arange(6.0).reshape(2, 3), torch.ones(2, 3), quantile=0.5)
    assert torch.equal(L.top_entropy_mask(torch.arange(6.0).reshape(2, 3), torch.ones(2, 3),
                                          quantile=np.float32(0.5)), want)


# --------------------------------------------------------------------------------------- lengths are counts
def _overlong_ref(lengths: list[float], max_len: int, buffer: int, penalty: float) -> list[float]:
    out = []
    for n in lengths:
        if not n >= 0:
            out.append(NAN)
        else:
            out.append(-penalty * min(max((n - (max_len - buffer)) / buffer, 0.0), 1.0))
    return out


def test_overlong_penalty_negative_or_nan_length_is_nan():
    """A negative length used to score the 0 penalty of a short answer; negative and NaN lengths give NaN at
    their sample (no host sync), +inf gives the full penalty. Float64 reference."""
    lengths = [-1.0, 0.0, 12.0, 13.0, NAN, 16.0, float("inf"), -0.5]
    got = L.overlong_penalty(torch.tensor(lengths, dtype=torch.float64), max_len=16, buffer=4, penalty=0.5)
    want = torch.tensor(_overlong_ref(lengths, 16, 4, 0.5), dtype=torch.float64)
    torch.testing.assert_close(got, want, equal_nan=True)
    ints = L.overlong_penalty(torch.tensor([-3, 14, 20]), max_len=16, buffer=4)
    assert torch.isnan(ints[0]) and ints[1:].tolist() == [-0.5, -1.0]


def test_overlong_penalty_budgets_are_ints():
    lengths = torch.tensor([10, 14])
    want = L.overlong_penalty(lengths, max_len=16, buffer=4)
    assert torch.equal(L.overlong_penalty(lengths, max_len=np.int64(16), buffer=np.int32(4)), want)
    for kw, name in (({"max_len": 16.0}, "max_len"), ({"max_len": True}, "max_len"), ({"buffer": 4.5}, "buffer"),
                     ({"buffer": 0}, "buffer"), ({"buffer": 17}, "buffer"), ({"penalty": float("inf")}, "penalty"),
                     ({"penalty": NAN}, "penalty"), ({"penalty": -1.0}, "penalty")):
        args = {"max_len": 16, "buffer": 4, **kw}
        with pytest.raises(ArgumentError, match=rf"^{name}: expected"):
            L.overlong_penalty(lengths, **args)


def test_opo_negative_length_poisons_its_group_only():
    """OPO weights the baseline by response lengths: a negative one would move the baseline outside the group's
    rewards. Its group is NaN (like a NaN length), the other groups keep their reference values."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 1])
    lengths = torch.tensor([3.0, 5.0, -2.0, 4.0, 6.0], dtype=torch.float64)
    got = L.opo_advantages(r, ids, lengths)
    base = (3 * 1.0 + 5 * 0.0) / 8
    torch.testing.assert_close(got[:2], torch.tensor([1.0 - base, 0.0 - base], dtype=torch.float64))
    assert torch.isnan(got[2:]).all()
    with pytest.raises(ArgumentError, match=r"^lengths: expected a real tensor"):
        L.opo_advantages(r, ids, lengths > 0)


# ------------------------------------------------------------------------------------------------ KL controllers
@pytest.mark.parametrize("ctl", [L.AdaptiveKLController(0.1, 0.05, 100.0), L.FixedKLController(0.1)],
                         ids=["adaptive", "fixed"])
def test_kl_controller_update_arguments(ctl):
    """A per-token KL tensor where the batch's mean is expected used to raise a bare RuntimeError ("a Tensor with
    2 elements cannot be converted to Scalar"); both controllers check the same arguments."""
    with pytest.raises(ArgumentError, match=r"current_kl: expected a number or a 1-element real tensor .* shape \[2\]"):
        ctl.update(torch.tensor([0.1, 0.2]), 1)
    for bad in ("0.1", None, NAN, torch.tensor(True)):
        with pytest.raises(ArgumentError, match=r"current_kl: expected"):
            ctl.update(bad, 1)
    for bad in (True, 1.0, -1):
        with pytest.raises(ArgumentError, match=r"n_steps: expected"):
            ctl.update(0.1, bad)


def test_adaptive_kl_controller_reads_tensors_and_numpy_like_floats():
    """Float64 reference of the Ziegler et al. rule ``value *= 1 + clip(kl/target − 1, ±0.2)·n/horizon``."""
    kl, target, horizon = 0.07, 0.05, 100.0
    want = 0.1 * (1 + min(max(kl / target - 1, -0.2), 0.2) * 8 / horizon)
    for current in (kl, np.float64(kl), torch.tensor([kl], dtype=torch.float64), torch.tensor(kl, dtype=torch.float64)):
        ctl = L.AdaptiveKLController(0.1, target, horizon)
        assert ctl.update(current, np.int64(8)) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ArgumentError, match=r"init_kl_coef: expected a finite real number"):
        L.AdaptiveKLController(float("inf"), target, horizon)


# ------------------------------------------------------------------------------------- flags and version scalars
def test_truthy_strings_are_not_flags():
    """``whiten(shift_mean="no")`` used to shift (a non-empty string is truthy) and ``straight_through="no"``
    used to switch the k2 gradient on."""
    x = torch.randn(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ArgumentError, match=r"shift_mean: expected True or False, got 'no'"):
        L.whiten(x, mask, shift_mean="no")
    with pytest.raises(ArgumentError, match=r"straight_through: expected True or False"):
        L.kl_estimate(x, x.flip(0), straight_through="no")
    with pytest.raises(ArgumentError, match=r"straight_through: expected True or False"):
        L.kl_estimate(x, x.flip(0), straight_through=1)


def test_mismatch_metrics_versions_accept_numpy_ints_only():
    old = torch.randn(2, 3, dtype=torch.float64)
    roll = old + 0.1
    mask = torch.ones(2, 3, dtype=torch.bool)
    versions = torch.tensor([[3, 3, 2], [1, 3, -1]])
    want = L.mismatch_metrics(old, roll, mask, versions=versions, current_version=3, max_staleness=2)
    got = L.mismatch_metrics(old, roll, mask, versions=versions, current_version=np.int64(3),
                             max_staleness=np.int64(2))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    for kw, name in (({"current_version": True}, "current_version"), ({"current_version": 3.0}, "current_version"),
                     ({"max_staleness": True}, "max_staleness"), ({"max_staleness": -1}, "max_staleness")):
        args = {"versions": versions, "current_version": 3, "max_staleness": 2, **kw}
        with pytest.raises(ArgumentError, match=rf"^{name}: expected"):
            L.mismatch_metrics(old, roll, mask, **args)


# ----------------------------------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_policy_losses_and_estimators_on_empty_batches(shape):
    """Nothing valid anywhere: per-token outputs of the input's shape, metrics 0, aggregates 0 (never NaN)."""
    e = torch.zeros(shape)
    m = torch.zeros(shape, dtype=torch.bool)
    adv = torch.zeros(shape[0])
    for name in ("ppo_clip_loss", "gspo_loss", "cispo_loss", "sapo_loss", "gmpo_loss", "dppo_loss", "pg_loss"):
        loss, metrics = getattr(L, name)(e, e, adv, m)
        assert loss.shape == shape, name
        assert all(torch.isfinite(v) for v in metrics.values()), name
        for mode in L.AGG_MODES:
            assert L.aggregate(loss, m, mode=mode) == 0, (name, mode)
    adv_gae, ret = L.gae(e, e, m)
    assert adv_gae.shape == shape and ret.shape == shape
    assert L.whiten(e, m).shape == shape and L.kl_estimate(e, e, mask=m).shape == shape
