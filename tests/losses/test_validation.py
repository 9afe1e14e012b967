"""Bad input raises ValueError naming the argument and both shapes."""

import re

import pytest
import torch

import rlblocks.losses as L

LP = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.bool)
A = torch.zeros(2)


@pytest.mark.parametrize(
    ("call", "arg", "shapes"),
    [
        (lambda: L.ppo_clip_loss(LP, torch.zeros(2, 4), A, M), "old_logp", ["[2, 3]", "[2, 4]"]),
        (lambda: L.ppo_clip_loss(LP, LP, A, torch.ones(3, 2, dtype=torch.bool)), "mask", ["[2, 3]", "[3, 2]"]),
        (lambda: L.ppo_clip_loss(LP, LP, torch.zeros(3), M), "advantages", ["[2, 3]", "[3]"]),
        (lambda: L.gspo_loss(LP, LP, torch.zeros(2, 2), M), "advantages", ["[2, 3]", "[2, 2]"]),
        (lambda: L.cispo_loss(LP, LP[:1], A, M), "old_logp", ["[2, 3]", "[1, 3]"]),
        (lambda: L.sapo_loss(LP, LP, A, M[:, :2]), "mask", ["[2, 3]", "[2, 2]"]),
        (lambda: L.gmpo_loss(LP, LP.T, A, M), "old_logp", ["[2, 3]", "[3, 2]"]),
        (lambda: L.pg_loss(LP, None, A, M, weights=torch.ones(2, 2)), "weights", ["[2, 3]", "[2, 2]"]),
        (lambda: L.pg_loss(LP, LP[:, :2], A, M), "old_logp", ["[2, 3]", "[2, 2]"]),
        (lambda: L.decoupled_ppo_loss(LP, LP.T, A, M, rollout_logp=LP), "old_logp", ["[2, 3]", "[3, 2]"]),
        (lambda: L.decoupled_ppo_loss(LP, LP, A, M, rollout_logp=LP[:, :1]), "rollout_logp", ["[2, 3]", "[2, 1]"]),
        (lambda: L.value_loss(LP, LP, LP[:1], M), "returns", ["[2, 3]", "[1, 3]"]),
        (lambda: L.kl_estimate(LP, LP[:, :2]), "ref_logp", ["[2, 3]", "[2, 2]"]),
        (lambda: L.aggregate(LP, M[:1]), "mask", ["[2, 3]", "[1, 3]"]),
        (lambda: L.rollout_correction(LP, LP[:, :1], M), "rollout_logp", ["[2, 3]", "[2, 1]"]),
        (lambda: L.rollout_correction(LP.long(), LP, M), "old_logp", ["torch.int64"]),
        (lambda: L.mismatch_metrics(LP, LP, M.T), "mask", ["[2, 3]", "[3, 2]"]),
        (lambda: L.geometric_sequence_mask(LP, LP[:1], M), "rollout_logp", ["[2, 3]", "[1, 3]"]),
        (lambda: L.outlier_sequence_mask(LP, LP, M[:, :2]), "mask", ["[2, 3]", "[2, 2]"]),
        (lambda: L.icepop_correction(LP[:, :1], LP, M), "rollout_logp", ["[2, 1]", "[2, 3]"]),
        (lambda: L.dppo_mask(LP, LP, torch.zeros(5), M), "advantages", ["[2, 3]", "[5]"]),
        (lambda: L.dppo_loss(LP, LP.T, A, M), "old_logp", ["[2, 3]", "[3, 2]"]),
        (lambda: L.distill_advantages(LP, LP, M[:1]), "mask", ["[2, 3]", "[1, 3]"]),
        (lambda: L.grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long)), "group_ids", ["[4]", "[3]"]),
        (lambda: L.rloo_advantages(torch.zeros(4), torch.zeros(5, dtype=torch.long)), "group_ids", ["[4]", "[5]"]),
        (lambda: L.opo_advantages(torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.ones(3)), "lengths",
         ["[4]", "[3]"]),
        (lambda: L.passk_advantages(torch.zeros(2), torch.zeros(1, dtype=torch.long)), "group_ids", ["[2]", "[1]"]),
        (lambda: L.gdpo_advantages(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), torch.ones(3)), "weights",
         ["[4, 2]", "[3]"]),
        (lambda: L.remax_advantages(torch.zeros(4), torch.zeros(2)), "greedy_rewards", ["[4]", "[2]"]),
        (lambda: L.gae(LP, LP[:, :2], M), "values", ["[2, 3]", "[2, 2]"]),
        (lambda: L.whiten(LP, M[:, :1]), "mask", ["[2, 3]", "[2, 1]"]),
        (lambda: L.off_policy_sequence_mask(LP, LP[:1], M, advantages=A, delta=0.1), "rollout_logp",
         ["[2, 3]", "[1, 3]"]),
        (lambda: L.top_entropy_mask(LP, M[:1], quantile=0.5), "mask", ["[2, 3]", "[1, 3]"]),
        (lambda: L.zero_variance_groups(torch.zeros(3), torch.zeros(2, dtype=torch.long)), "group_ids",
         ["[3]", "[2]"]),
        (lambda: L.reinforce_pp_baseline_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), M), "mask",
         ["[3]", "[2, 3]"]),
    ],
)
def test_shape_mismatch_names_argument_and_both_shapes(call, arg, shapes):
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(arg + ":"), msg
    for s in shapes:
        assert s in msg, msg


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: L.ppo_clip_loss(LP, LP, A, torch.ones(2, 3, dtype=torch.complex64)), r"^mask: .*dtype"),
        (lambda: L.ppo_clip_loss(LP.long(), LP, A, M), r"^logp: .*floating"),
        (lambda: L.ppo_clip_loss(LP, LP, A, M, eps_low=1.5), r"^eps_low: "),
        (lambda: L.ppo_clip_loss(LP, LP, A, M, dual_clip=0.5), r"^dual_clip: .*> 1"),
        (lambda: L.ppo_clip_loss(LP[0], LP[0], A, M[0]), r"^logp: .*2-D"),
        (lambda: L.grpo_advantages(torch.zeros(3), torch.zeros(3)), r"^group_ids: .*integer"),
        (lambda: L.grpo_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), std_scale="x"), r"^std_scale"),
        (lambda: L.aggregate(LP, M, mode="mean"), r"^mode: "),
        (lambda: L.aggregate(LP, M, num_tokens=-1), r"^num_tokens: "),
        (lambda: L.kl_estimate(LP, LP, kind="k4"), r"^kind: "),
        (lambda: L.rollout_correction(LP, LP, M, level="seq"), r"^level: "),
        (lambda: L.rollout_correction(LP, LP, M, lower=3.0, upper=2.0), r"^lower: "),
        (lambda: L.overlong_penalty(torch.ones(2), max_len=4, buffer=8), r"^buffer: "),
        (lambda: L.top_entropy_mask(LP, M, quantile=1.5), r"^quantile: "),
        (lambda: L.decoupled_ppo_loss(LP, LP, A, M, rollout_logp=LP, rollout_weight_cap=0), r"^rollout_weight_cap: "),
        (lambda: L.outlier_sequence_mask(LP, LP, M, lower=3.0, upper=2.0), r"^lower: "),
        (lambda: L.icepop_correction(LP, LP, M, upper=0.0), r"^upper: "),
        (lambda: L.dppo_mask(LP, LP, A, M, delta_low=-0.1), r"^delta_low: "),
        (lambda: L.dppo_loss(LP, LP, A, M, kl_coef=-1.0), r"^kl_coef: "),
        (lambda: L.rollout_correction(LP, LP, M, level="turn"), r"^level: "),
    ],
)
def test_bad_values_and_dtypes(call, pattern):
    with pytest.raises(ValueError, match=re.compile(pattern)):
        call()


@pytest.mark.parametrize(
    "call,pattern",
    [
        (lambda: L.decoupled_ppo_loss(LP, LP, A, M), "rollout_logp"),
        (lambda: L.decoupled_ppo_loss(LP, LP, A, M, LP, rollout_logp=LP), "positional"),
        (lambda: L.pg_loss(LP), "old_logp"),
        (lambda: L.pg_loss(LP, A, M), "mask"),  # one call form: (logp, old_logp, advantages, mask)
    ],
)
def test_one_call_form(call, pattern):
    """Each loss has one signature: a missing or extra tensor is refused by Python naming it."""
    with pytest.raises(TypeError, match=pattern):
        call()


def test_float_and_int_masks_are_accepted():
    base, _ = L.ppo_clip_loss(LP, LP, A, M)
    for m in (M.float(), M.long()):
        torch.testing.assert_close(L.ppo_clip_loss(LP, LP, A, m)[0], base)
