"""Every sched entry point (and the rollout request types sched consumes) refuses non-integers where it counts
tokens, positions or versions: floats, ``True``/``False`` and negative numbers raise ``ArgumentError`` naming the
argument instead of being truncated or read as 1/0."""

from __future__ import annotations

import math

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout.types import GenerationRequest, SamplingParams
from rlblocks.sched import (
    DynamicSampler,
    PartialRollout,
    PartialRolloutBuffer,
    StalenessController,
    StalenessQueue,
    balance_partitions,
    pack_sequences,
    token_budget_microbatches,
)


def rollout(**kw):
    base = dict(group_id="g", prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5], output_versions=[0],
                remaining_tokens=2)
    base.update(kw)
    return PartialRollout(**base)


BAD = [
    # PartialRollout: token ids, versions, budget, flags
    ("prompt_ids", lambda: rollout(prompt_ids=[1.5, 2])),
    ("prompt_ids", lambda: rollout(prompt_ids=[1.0, 2])),
    ("prompt_ids", lambda: rollout(prompt_ids=[True, 2])),
    ("prompt_ids", lambda: rollout(prompt_ids=[-1, 2])),
    ("output_ids", lambda: rollout(output_ids=[3.0])),
    ("output_ids", lambda: rollout(output_ids=[False])),
    ("output_ids", lambda: rollout(output_ids=[-4])),
    ("output_versions", lambda: rollout(output_versions=[0.5])),
    ("output_versions", lambda: rollout(output_versions=[True])),
    ("output_versions", lambda: rollout(output_versions=[-1])),
    ("output_logprobs", lambda: rollout(output_logprobs=[True])),
    ("output_logprobs", lambda: rollout(output_logprobs=["x"])),
    ("remaining_tokens", lambda: rollout(remaining_tokens=True)),
    ("remaining_tokens", lambda: rollout(remaining_tokens=2.0)),
    ("remaining_tokens", lambda: rollout(remaining_tokens=-1)),
    ("finished", lambda: rollout(finished="yes")),
    ("request_id", lambda: rollout(request_id=7)),
    # DynamicSampler
    ("over_sampling", lambda: DynamicSampler(target_groups=2, over_sampling=True)),
    ("target_groups", lambda: DynamicSampler(target_groups=True)),
    ("keep_when_insufficient", lambda: DynamicSampler(target_groups=2, keep_when_insufficient="no")),
    # packing: lengths are token counts
    (r"lengths\[0\]", lambda: pack_sequences([True, 3], max_tokens=8)),
    (r"lengths\[1\]", lambda: pack_sequences([3, 2.0], max_tokens=8)),
    (r"lengths\[0\]", lambda: token_budget_microbatches([False], max_tokens=8)),
    (r"lengths\[0\]", lambda: balance_partitions([-3, 1], 2)),
    ("max_tokens", lambda: pack_sequences([3], max_tokens=True)),
    # queue and controller
    ("timeout", lambda: StalenessQueue(max_staleness=0).get_batch(1, current_version=0, timeout=True)),
    ("timeout", lambda: StalenessQueue(max_staleness=0).put("x", 0, timeout=False)),
    ("max_staleness", lambda: StalenessQueue(max_staleness=True)),
    ("version", lambda: StalenessQueue(max_staleness=0).put("x", 1.0)),
    ("batch_size", lambda: StalenessController(batch_size=True, max_staleness=0, max_concurrent=4)),
    ("version", lambda: StalenessController(batch_size=4, max_staleness=0, max_concurrent=4).capacity(0.0)),
    # rollout request types read by the partial-rollout buffer and the cookbook loops
    ("temperature", lambda: SamplingParams(temperature=True)),
    ("temperature", lambda: SamplingParams(temperature=math.inf)),
    ("temperature", lambda: SamplingParams(temperature="1")),
    ("top_p", lambda: SamplingParams(top_p=True)),
    ("top_k", lambda: SamplingParams(top_k=True)),
    ("max_new_tokens", lambda: SamplingParams(max_new_tokens=True)),
    ("max_new_tokens", lambda: SamplingParams(max_new_tokens=4.0)),
    ("max_new_tokens", lambda: SamplingParams(max_new_tokens=-1)),
    ("seed", lambda: SamplingParams(seed=True)),
    ("seed", lambda: SamplingParams(seed=1.5)),
    (r"stop_token_ids\[0\]", lambda: SamplingParams(stop_token_ids=(2.7,))),
    (r"stop_token_ids\[0\]", lambda: SamplingParams(stop_token_ids=(True,))),
    (r"stop_token_ids\[1\]", lambda: SamplingParams(stop_token_ids=(1, -1))),
    (r"prompt_ids\[0\]", lambda: GenerationRequest("r", [1.5, 2])),
    (r"prompt_ids\[1\]", lambda: GenerationRequest("r", [1, True])),
    (r"prompt_ids\[0\]", lambda: GenerationRequest("r", [-3])),
]


@pytest.mark.parametrize(("arg", "call"), BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_refused_and_named(arg, call):
    with pytest.raises(ArgumentError, match=arg):
        call()


def test_integer_like_values_still_accepted():
    """Refusing floats and bools must not refuse the integer types callers really pass: numpy / torch integers."""
    np = pytest.importorskip("numpy")
    assert pack_sequences([np.int64(3), torch.tensor(2)], max_tokens=8) == [[0, 1]]
    r = rollout(prompt_ids=[np.int32(1), torch.tensor(2)], output_versions=[np.int64(0)])
    assert r.prompt_ids == [1, 2] and type(r.prompt_ids[0]) is int and type(r.output_versions[0]) is int
    req = GenerationRequest("r", torch.tensor([4, 5]))
    assert req.prompt_ids == [4, 5] and all(type(t) is int for t in req.prompt_ids)
    sp = SamplingParams(temperature=0, top_p=1, max_new_tokens=np.int64(3), stop_token_ids=[np.int64(2)])
    assert sp.max_new_tokens == 3 and sp.stop_token_ids == (2,)
    assert DynamicSampler(target_groups=2, over_sampling=2).over_sampling == 2.0
    buf = PartialRolloutBuffer(group_size=1)
    buf.add(rollout(remaining_tokens=np.int64(2)))
    assert buf.stats()["groups_ready"] == 1
