"""Impossible values at the rollout boundary, tried as an attacker and as a new user would: token ids, log-probs
and versions no engine produces never reach the training tensors; a router is refused anything that is not an
engine at construction (not at its first request); the gateway refuses ``n`` that is not an integer."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from rlblocks._checks import LOGPROB_SLACK
from rlblocks.errors import ArgumentError, GatewayError
from rlblocks.rollout import Generation, GenerationRequest, ResumableResult, Router, build_batch
from rlblocks.rollout.gateway import schema


def _gen(**kw) -> Generation:
    base = {"request_id": "r", "prompt_ids": [5, 6], "output_ids": [7, 8], "output_logprobs": [-0.5, -1.5],
            "output_versions": [0, 1]}
    return Generation(**{**base, **kw})


# --------------------------------------------------------------------------------- Generation and build_batch
BAD = [
    ("output_ids", [7, -1], r"output_ids\[1\]: expected an int >= 0, got -1"),
    ("prompt_ids", [-3, 6], r"prompt_ids\[0\]: expected an int >= 0, got -3"),
    ("output_ids", [7, 2.0], r"output_ids\[1\]: expected an int >= 0, got 2\.0 \(float\)"),
    ("output_ids", [True, 8], r"output_ids\[0\]: expected an int >= 0, got True \(bool\)"),
    ("output_logprobs", [-0.5, 0.5], r"output_logprobs\[1\]: expected a log-probability .* got 0\.5"),
    ("output_logprobs", [2 * LOGPROB_SLACK, -1.0], r"output_logprobs\[0\]: expected a log-probability"),
    ("output_logprobs", [math.nan, -1.0], r"output_logprobs\[0\]: expected a log-probability .* got nan"),
    ("output_logprobs", [-0.5, math.inf], r"output_logprobs\[1\]: expected a log-probability .* got inf"),
    ("output_versions", [0, -5], r"output_versions\[1\]: expected an int >= 0, got -5"),
    ("output_versions", [0, 1.0], r"output_versions\[1\]: expected an int >= 0, got 1\.0 \(float\)"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_a_generation_with_an_impossible_value_is_refused(field, value, message):
    with pytest.raises(ArgumentError, match=rf"^{message}"):
        _gen(**{field: value})
    with pytest.raises(ArgumentError, match=rf"^{message}"):  # a subclass (resumable_generate's result) too
        ResumableResult(**{"request_id": "r", "prompt_ids": [5, 6], "output_ids": [7, 8],
                           "output_logprobs": [-0.5, -1.5], "output_versions": [0, 1], field: value})


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_build_batch_refuses_a_value_changed_after_construction(field, value, message):
    """The lists of a generation are plain lists that a caller may edit after construction: ``build_batch``
    checks them again and names the generation, so the value never reaches the tensors."""
    gens = [_gen(), _gen()]
    setattr(gens[1], field, value)
    with pytest.raises(ArgumentError, match=rf"^generations\[1\]\.{message}"):
        build_batch(gens, pad_id=0)


def test_rounding_above_zero_and_negative_zero_pass_unchanged():
    """``log p <= 0``, but an fp32 log-softmax of a near-certain token can round just above 0: up to
    ``LOGPROB_SLACK`` passes, unchanged (not clamped), as does ``-0.0`` and ``-inf`` (an underflowed probability)."""
    tiny = float(np.float32(1e-7))
    g = _gen(output_ids=[7, 8, 9], output_logprobs=[tiny, -0.0, -math.inf], output_versions=[0, 0, 0])
    assert g.output_logprobs == [tiny, 0.0, -math.inf] and math.copysign(1.0, g.output_logprobs[1]) == -1.0
    b = build_batch([g], pad_id=0)
    assert b.rollout_logp[0].tolist() == [tiny, 0.0, -math.inf]
    assert _gen(output_logprobs=[LOGPROB_SLACK, -1.0]).output_logprobs[0] == LOGPROB_SLACK


def test_numpy_and_tensor_scalars_are_accepted_as_the_values_they_hold():
    g = _gen(prompt_ids=[np.int64(5), torch.tensor(6)], output_ids=np.array([7, 8]).tolist(),
             output_logprobs=[np.float32(-0.5), torch.tensor(-1.5)], output_versions=[np.int32(0), 1])
    assert g.prompt_ids == [5, 6] and all(type(t) is int for t in g.prompt_ids)
    assert g.output_logprobs == [-0.5, -1.5] and all(type(v) is float for v in g.output_logprobs)
    assert g.output_versions == [0, 1] and all(type(v) is int for v in g.output_versions)


def test_build_batch_refuses_ids_outside_the_vocabulary_when_it_is_given():
    gens = [_gen(), _gen(output_ids=[7, 10])]
    with pytest.raises(ArgumentError, match=r"^generations\[1\]\.output_ids\[1\]: expected a token id in \[0, 10\)"):
        build_batch(gens, pad_id=0, vocab_size=10)
    with pytest.raises(ArgumentError, match=r"^generations\[0\]\.prompt_ids\[1\]: expected a token id in \[0, 6\)"):
        build_batch(gens, pad_id=0, vocab_size=6)
    with pytest.raises(ArgumentError, match=r"^pad_id: expected an int token id >= 0 and < vocab_size \(11\), got 11"):
        build_batch(gens, pad_id=11, vocab_size=11)
    for bad in (0, -1, 10.0, True):
        with pytest.raises(ArgumentError, match=r"^vocab_size: expected an int >= 1"):
            build_batch(gens, pad_id=0, vocab_size=bad)
    # in range: the same tensors as without the vocabulary (ids 5..10, pad 0, 11 entries)
    with_vocab, without = build_batch(gens, pad_id=0, vocab_size=11), build_batch(gens, pad_id=0)
    assert torch.equal(with_vocab.input_ids, without.input_ids)
    assert with_vocab.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, 10]]


def test_a_request_with_an_impossible_prompt_is_refused():
    for bad, msg in (([4, -1], r"prompt_ids\[1\]: expected an int >= 0, got -1"),
                     ([1.5], r"prompt_ids\[0\]: expected an int >= 0, got 1\.5"), ([], "at least one token")):
        with pytest.raises(ArgumentError, match=msg):
            GenerationRequest("r", bad)


# ------------------------------------------------------------------------------------------------------ Router
class _NoGenerate:
    """Every protocol member but ``generate``; ``version`` raises if evaluated (an HTTP engine's property may call
    its server): the check must not evaluate it."""

    @property
    def version(self):
        raise AssertionError("a property was evaluated by the check")

    is_paused = num_in_flight = False

    def stats(self):
        return {}

    async def abort(self, request_ids=None):
        return []

    async def pause(self, mode="abort"):
        pass

    async def resume(self):
        pass

    async def update_weights(self, named_tensors, *, version, partial=False, allow_rollback=False):
        pass

    async def sleep(self, level=1):
        pass

    async def wake(self):
        pass

    def close(self):
        pass


class _Engine(_NoGenerate):
    async def generate(self, request):
        return Generation(request.request_id, request.prompt_ids)


@pytest.mark.parametrize(("engines", "message"), [
    ([None], r"^engines\[0\]: expected a rollout engine \(the RolloutEngine protocol\), got NoneType without abort"),
    ([_Engine(), _NoGenerate()], r"^engines\[1\]: expected a rollout engine .* got _NoGenerate without generate$"),
    ([_Engine(), "engine"], r"^engines\[1\]: expected a rollout engine .* got str without"),
    (None, r"^engines: expected a sequence of rollout engines, got NoneType"),
    ("ab", r"^engines: expected a sequence of rollout engines, got str"),
])
def test_a_router_refuses_what_is_not_an_engine_at_construction(engines, message):
    with pytest.raises(ArgumentError, match=message):
        Router(engines)


def test_a_non_callable_method_is_refused_and_a_complete_engine_is_accepted():
    broken = _Engine()
    broken.generate = None
    with pytest.raises(ArgumentError, match=r"^engines\[0\]: .* without generate \(not callable\)"):
        Router([broken])
    router = Router([_Engine(), _Engine()])
    out = asyncio.run(router.generate(GenerationRequest("r1", [1, 2])))
    assert out.request_id == "r1" and out.prompt_ids == [1, 2]

    async def rejoin():
        router.alive[0] = False
        await router.rejoin(0, engine=object())

    with pytest.raises(ArgumentError, match=r"^engine: expected a rollout engine .* got object without"):
        asyncio.run(rejoin())
    assert router.alive[0] is False


# ----------------------------------------------------------------------------------------------------- gateway
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model", [schema.ChatCompletionRequest, schema.CompletionRequest])
@pytest.mark.parametrize(("n", "code"), [(1.0, "invalid_type"), (True, "invalid_type"), ("1", "invalid_type"),
                                         (2, "unsupported_value"), (0, "unsupported_value")])
def test_the_gateway_refuses_n_that_is_not_the_integer_one(model, n, code):
    body = {**CHAT, "n": n} if model is schema.ChatCompletionRequest else {"model": "m", "prompt": "hi", "n": n}
    with pytest.raises(GatewayError) as e:
        schema.parse(model, body)
    assert e.value.status == 400 and e.value.code == code and e.value.param == "n"
    assert schema.parse(model, {**body, "n": 1}).n is None
