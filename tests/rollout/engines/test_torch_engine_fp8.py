"""TorchEngine receiving weights in the block-FP8 wire format of rlblocks.sync.fp8.

Reference: ``dequantize_fp8`` of the very tensors sent (itself checked against float64 and vLLM in
tests/sync/test_fp8.py), compared bit for bit with the engine's parameters; refusals leave weights and version as
they were.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlblocks.errors import WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.sync import dequantize_fp8, quantize_named
from rlblocks.sync.fp8 import FP8_DTYPE, SCALE_SUFFIX
from tests.conftest import build_small_llama


def _expected(fp8: dict, dtype: torch.dtype) -> dict:
    return {n: dequantize_fp8(t, fp8[n + SCALE_SUFFIX], dtype=dtype) if t.dtype == FP8_DTYPE else t.to(dtype)
            for n, t in fp8.items() if not n.endswith(SCALE_SUFFIX)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_update_gives_exactly_the_dequantised_weights(dtype):
    engine = TorchEngine(build_small_llama(0, dtype))
    fp8 = dict(quantize_named(build_small_llama(1, torch.bfloat16).state_dict()))
    assert sum(t.dtype == FP8_DTYPE for t in fp8.values()) == 7
    try:
        asyncio.run(engine.update_weights(list(fp8.items()), version=3))
        assert engine.version == 3
        want = _expected(fp8, dtype)
        got = engine.model.state_dict()
        assert set(got) == set(want)
        for n, p in got.items():
            assert p.dtype == dtype and torch.equal(p, want[n]), n
    finally:
        engine.close()


def test_fp8_rollout_policy_is_the_dequantised_one():
    """Greedy generation after an FP8 update equals that of an engine given the dequantised weights directly."""
    sent = build_small_llama(1)
    fp8 = dict(quantize_named(sent.state_dict()))
    a, b = TorchEngine(build_small_llama(0), batch_invariant=True), TorchEngine(build_small_llama(0),
                                                                                batch_invariant=True)
    req = GenerationRequest("r", [1, 5, 9, 2], SamplingParams(temperature=0.0, max_new_tokens=8))

    async def go():
        await a.update_weights(list(fp8.items()), version=1)
        await b.update_weights(list(_expected(fp8, torch.float32).items()), version=1)
        return await a.generate(req), await b.generate(req)

    try:
        ga, gb = asyncio.run(go())
        assert ga.output_ids == gb.output_ids and ga.output_logprobs == gb.output_logprobs
        # and it is not the unquantised policy's: the FP8 rounding changes the logprobs
        c = TorchEngine(build_small_llama(0), batch_invariant=True)
        try:
            asyncio.run(c.update_weights(list(sent.state_dict().items()), version=1))
            gc = asyncio.run(c.generate(req))
        finally:
            c.close()
        assert gc.output_logprobs != ga.output_logprobs
    finally:
        a.close()
        b.close()


def test_partial_fp8_update():
    engine = TorchEngine(build_small_llama(0))
    fp8 = dict(quantize_named(build_small_llama(1).state_dict()))
    w = "model.layers.0.mlp.down_proj.weight"
    before = {n: p.clone() for n, p in engine.model.state_dict().items()}
    try:
        asyncio.run(engine.update_weights([(w, fp8[w]), (w + SCALE_SUFFIX, fp8[w + SCALE_SUFFIX])], version=1,
                                          partial=True))
        after = engine.model.state_dict()
        assert torch.equal(after[w], dequantize_fp8(fp8[w], fp8[w + SCALE_SUFFIX], dtype=torch.float32))
        assert all(torch.equal(after[n], before[n]) for n in before if n != w)
    finally:
        engine.close()


def test_broken_fp8_updates_are_refused_weights_and_version_unchanged():
    engine = TorchEngine(build_small_llama(0))
    fp8 = dict(quantize_named(build_small_llama(1).state_dict()))
    w = "model.layers.0.mlp.down_proj.weight"
    before = {n: p.clone() for n, p in engine.model.state_dict().items()}
    nan = dict(fp8)
    nan[w] = fp8[w].clone()
    nan[w].view(torch.uint8)[0, 0] = 0x7F  # the e4m3fn NaN
    cases = [
        ({n: t for n, t in fp8.items() if n != w + SCALE_SUFFIX}, r"down_proj\.weight' is torch\.float8_e4m3fn but"),
        ({n: t for n, t in fp8.items() if n != w}, r"weight_scale_inv' are FP8 scales, but their weight"),
        ({**fp8, w + SCALE_SUFFIX: fp8[w + SCALE_SUFFIX][:, :1]}, r"expected float32 scales of shape \[2, 3\]"),
        ({**fp8, w + SCALE_SUFFIX: -fp8[w + SCALE_SUFFIX]}, "not finite and positive"),
        (nan, r"down_proj\.weight': 1 of 43520 values are not finite"),
    ]
    try:
        for update, msg in cases:
            with pytest.raises(WeightUpdateError, match=msg) as e:
                asyncio.run(engine.update_weights(list(update.items()), version=1))
            assert str(e.value).startswith("TorchEngine.update_weights refused:")
            assert engine.version == 0
            assert all(torch.equal(p, before[n]) for n, p in engine.model.state_dict().items())
    finally:
        engine.close()
