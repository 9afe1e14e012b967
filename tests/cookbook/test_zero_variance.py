"""A GRPO step whose groups all scored flat (every sample of each prompt got the same reward): its advantages are 0,
so its policy gradient is exactly 0. ``grpo_step`` (the update both GRPO loops run) counts such groups, flags the
step and says so on stderr; checked against a count written out here and against the weights (unchanged)."""

from __future__ import annotations

import math

import grpo
import pytest
import torch

from tests.cookbook.test_grpo_step import TablePolicy, cfg_of, make_batch


def count_flat(rewards, group_ids, trained) -> tuple[int, int]:
    """The independent count: per trained group, all rewards equal (Python floats, NaN never equal)."""
    groups: dict[int, list[float]] = {}
    for r, g, t in zip(rewards.tolist(), group_ids.tolist(), trained.tolist()):
        if t:
            groups.setdefault(g, []).append(r)
    flat = sum(1 for rs in groups.values() if all(r == rs[0] and not math.isnan(r) for r in rs))
    return flat, len(groups)


@pytest.mark.parametrize(
    ("rewards", "group_ids", "trained"),
    [
        ([1.0, 0, 0, 1, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], [True] * 8),  # both groups varied
        ([1.0, 1, 1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], [True] * 8),  # one flat
        ([0.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0, 1, 1, 1, 1], [True] * 8),  # all flat
        ([1.0, 0, 1, 0, 2, 2, 2, 2], [3, 3, 3, 3, 7, 7, 7, 7], [False] * 4 + [True] * 4),  # failed group not counted
        ([float("nan"), 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [True] * 6),  # a NaN reward: varied, not flat
        ([0.3, 0.3, 1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2], [True] * 6),  # interleaved ids
    ],
)
def test_zero_variance_groups_match_an_independent_count(rewards, group_ids, trained):
    r, g, t = torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_ids), torch.tensor(trained)
    assert grpo.zero_variance_groups(r, g, t) == count_flat(r, g, t)


def test_all_flat_step_is_counted_warned_and_moves_nothing(capsys):
    bt = make_batch()
    bt["rewards"] = torch.tensor([0.0] * 4 + [1.0] * 4, dtype=torch.float64)  # group 0 all wrong, group 1 all right
    policy = TablePolicy(0)
    w0 = policy.w.detach().clone()
    m = grpo.grpo_step(cfg_of(), policy, torch.optim.SGD(policy.parameters(), lr=1.0), bt, step=4)
    assert m["zero_variance_groups"] == 2 and m["zero_variance_step"] == 1
    assert m["grad_norm"] == 0.0
    torch.testing.assert_close(policy.w.detach(), w0, rtol=0, atol=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("step 5: all 2 groups have zero reward variance") and "--temperature" in err[0]


def test_a_step_with_one_varied_group_is_not_flagged(capsys):
    bt = make_batch()
    bt["rewards"] = torch.tensor([1.0] * 4 + [0.0, 1, 0, 0], dtype=torch.float64)
    policy = TablePolicy(0)
    m = grpo.grpo_step(cfg_of(), policy, torch.optim.SGD(policy.parameters(), lr=1.0), bt, step=0)
    assert m["zero_variance_groups"] == 1 and m["zero_variance_step"] == 0
    assert m["grad_norm"] > 0.0
    assert "zero reward variance" not in capsys.readouterr().err


def test_an_unresolved_correction_is_refused():
    from rlblocks.errors import ArgumentError

    policy = TablePolicy(0)
    with pytest.raises(ArgumentError, match=r"cfg\.correction"):
        grpo.grpo_step(cfg_of(correction="auto"), policy, torch.optim.SGD(policy.parameters(), lr=1.0),
                       make_batch(), step=0)
