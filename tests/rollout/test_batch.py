"""build_batch: generations -> right-padded tensors, checked position by position against the generations."""

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout import Generation, build_batch
from rlblocks.rollout.resume import ResumableResult


def _gens():
    return [
        Generation("a", [1, 2, 3], [7, 8], [-0.5, -0.25], [3, 4], "stop"),
        Generation("b", [4], [9, 10, 11, 12], [-1.0, -2.0, -3.0, -4.0], [4, 4, 4, 4], "length"),
        Generation("c", [5, 6], [], [], [], "abort"),
    ]


def test_layout_matches_the_generations_token_by_token():
    gens = _gens()
    b = build_batch(gens, pad_id=0, group_ids=[0, 0, 1], rewards=[1.0, 0.0, 0.5])
    assert b.input_ids.shape == (3, 5) and b.response_ids.shape == (3, 4)
    for i, g in enumerate(gens):
        p, k = len(g.prompt_ids), len(g.output_ids)
        assert b.prompt_lens[i] == p
        assert b.input_ids[i, : p + k].tolist() == g.prompt_ids + g.output_ids
        assert not b.attention_mask[i, p + k :].any() and b.attention_mask[i, : p + k].all()
        assert b.response_ids[i, :k].tolist() == g.output_ids
        # response position t is sequence position P + t
        assert b.input_ids[i, p : p + k].tolist() == b.response_ids[i, :k].tolist()
        assert b.response_mask[i].tolist() == [True] * k + [False] * (4 - k)
        assert b.loss_mask[i].tolist() == b.response_mask[i].tolist()
        assert b.rollout_logp[i, :k].tolist() == g.output_logprobs
        assert (b.rollout_logp[i, k:] == 0).all()
        assert b.versions[i, :k].tolist() == g.output_versions and (b.versions[i, k:] == -1).all()
    assert b.group_ids.tolist() == [0, 0, 1]
    assert b.rewards.dtype == torch.float32 and b.rewards.tolist() == [1.0, 0.0, 0.5]
    assert int(b.num_tokens) == 6


def test_own_loss_mask_and_stop_truncation():
    r = ResumableResult("r", [1], [5, 2, 6], [-0.1, -0.2, -0.3], [0, 1, 1], "stop",
                        final_version=1, stale=[True, False, False], loss_mask=[False, True, True])
    b = build_batch([r], pad_id=0)
    assert b.loss_mask[0].tolist() == [False, True, True]
    b2 = build_batch([r], pad_id=0, stop_token_ids=[2])  # stop id 2 ends the response at position 1
    assert b2.response_mask[0].tolist() == [True, True] and b2.loss_mask[0].tolist() == [False, True]
    assert b2.input_ids[0].tolist() == [1, 5, 2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"generations": []}, "generations"),
        ({"generations": ["x"]}, r"generations\[0\]"),
        ({"pad_id": 0.5}, "pad_id"),
        ({"group_ids": [0, 1]}, "group_ids"),
        ({"rewards": [1.0]}, "rewards"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = {"generations": _gens(), "pad_id": 0, **kwargs}
    with pytest.raises(ArgumentError, match=match):
        build_batch(args.pop("generations"), **args)
