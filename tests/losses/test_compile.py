"""Every loss, advantage, aggregation, correction and mask function traces as one graph (no host sync, no break).

``fullgraph=True`` turns any graph break (``.item()``, ``.tolist()``, Python branching on tensor values) into an
error; that is decided by Dynamo's trace, so the cheap ``eager`` backend suffices (no Inductor codegen).
"""

import pytest
import torch

import rlblocks.losses as L

B, T = 4, 6
g = torch.Generator().manual_seed(0)
LOGP = -torch.rand(B, T, generator=g)
OLD = LOGP + 0.1 * torch.randn(B, T, generator=g)
ADV = torch.randn(B, generator=g)
MASK = torch.arange(T)[None, :] < torch.tensor([6, 3, 1, 0])[:, None]
R = torch.tensor([1.0, 0.0, 0.5, 0.5])
IDS = torch.tensor([7, 7, -2, 7])
VERSIONS = torch.tensor([[3, 3, 2, 1, 0, -1]] * B)
TURNS = torch.tensor([[0, 0, 1, 1, 2, 2]] * B)

CASES = {
    "ppo_clip_loss": lambda: L.ppo_clip_loss(LOGP, OLD, ADV, MASK, dual_clip=3.0),
    "gspo_loss": lambda: L.gspo_loss(LOGP, OLD, ADV, MASK),
    "cispo_loss": lambda: L.cispo_loss(LOGP, OLD, ADV, MASK),
    "sapo_loss": lambda: L.sapo_loss(LOGP, OLD, ADV, MASK),
    "gmpo_loss": lambda: L.gmpo_loss(LOGP, OLD, ADV, MASK),
    "pg_loss": lambda: L.pg_loss(LOGP, OLD, ADV, MASK, weights=torch.exp(OLD)),
    "decoupled_ppo_loss": lambda: L.decoupled_ppo_loss(
        LOGP, OLD, ADV, MASK, rollout_logp=OLD - 0.1, rollout_weight_cap=2.0
    ),
    "value_loss": lambda: L.value_loss(LOGP, OLD, OLD + 1, MASK),
    "kl_estimate": lambda: L.kl_estimate(LOGP, OLD, kind="low_var_kl", straight_through=True),
    "aggregate": lambda: L.aggregate(LOGP, MASK, mode="seq-mean-token-mean", num_seqs=torch.tensor(8)),
    "rollout_correction": lambda: L.rollout_correction(LOGP, OLD, MASK, level="sequence", mode="mask", lower=0.5),
    "mismatch_metrics": lambda: L.mismatch_metrics(
        LOGP, OLD, MASK, versions=VERSIONS, current_version=torch.tensor(3), max_staleness=2
    ),
    "rollout_correction_segment": lambda: L.rollout_correction(LOGP, OLD, MASK, level="segment", turn_ids=TURNS),
    "rollout_correction_runs": lambda: L.rollout_correction(LOGP, OLD, MASK, level="segment", mode="mask"),
    "geometric_sequence_mask": lambda: L.geometric_sequence_mask(LOGP, OLD, MASK, lower=0.9, upper=1.1),
    "outlier_sequence_mask": lambda: L.outlier_sequence_mask(LOGP, OLD, MASK, lower=0.5, upper=2.0),
    "icepop_correction": lambda: L.icepop_correction(LOGP, OLD, MASK),
    "dppo_mask": lambda: L.dppo_mask(LOGP, OLD, ADV, MASK),
    "dppo_loss": lambda: L.dppo_loss(LOGP, OLD, ADV, MASK, kl_coef=0.1),
    "distill_advantages": lambda: L.distill_advantages(LOGP, OLD, MASK, discount=0.9),
    "grpo_advantages": lambda: L.grpo_advantages(R, IDS),
    "rloo_advantages": lambda: L.rloo_advantages(R, IDS),
    "opo_advantages": lambda: L.opo_advantages(R, IDS, torch.tensor([3, 4, 5, 6])),
    "passk_advantages": lambda: L.passk_advantages(R, IDS),
    "gdpo_advantages": lambda: L.gdpo_advantages(torch.stack([R, 1 - R], 1), IDS, torch.tensor([1.0, 0.5])),
    "remax_advantages": lambda: L.remax_advantages(R, R.flip(0)),
    "reinforce_pp_baseline_advantages": lambda: L.reinforce_pp_baseline_advantages(R, IDS, MASK),
    "gae": lambda: L.gae(LOGP, OLD, MASK, gamma=0.99, lam=0.95),
    "discounted_returns": lambda: L.discounted_returns(LOGP, MASK, gamma=0.9),
    "whiten": lambda: L.whiten(LOGP, MASK),
    "off_policy_sequence_mask": lambda: L.off_policy_sequence_mask(LOGP, OLD, MASK, advantages=ADV, delta=0.01),
    "top_entropy_mask": lambda: L.top_entropy_mask(-LOGP, MASK, quantile=0.8),
    "overlong_penalty": lambda: L.overlong_penalty(torch.tensor([3, 9, 12]), max_len=10, buffer=4),
    "zero_variance_groups": lambda: L.zero_variance_groups(R, IDS),
}


def test_every_public_function_is_covered():
    functions = {n for n in L.__all__ if callable(getattr(L, n)) and n[0].islower()}
    assert functions == {name for name in CASES if name in L.__all__}
    assert all(name in L.__all__ or name.startswith("rollout_correction_") for name in CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_fullgraph(name):
    fn = CASES[name]
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(), fn())
