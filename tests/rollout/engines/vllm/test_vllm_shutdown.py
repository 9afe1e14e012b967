"""VLLMEngine.aclose/close on the shared engine. This file sorts last in the folder on purpose: it closes the
session engine (the fixture's own aclose at teardown is then a no-op, as close is idempotent)."""

from __future__ import annotations

import asyncio

import pytest

from rlblocks.errors import EngineError
from rlblocks.rollout import GenerationRequest, SamplingParams

pytestmark = pytest.mark.vllm


def test_aclose_returns_partials_then_every_call_raises(vllm_engine, run, wait_tokens):
    async def scenario():
        running = asyncio.ensure_future(
            vllm_engine.generate(GenerationRequest("close-me", [1, 10, 11, 12], SamplingParams(max_new_tokens=200)))
        )
        await wait_tokens(vllm_engine, running, "close-me", 1)
        await vllm_engine.aclose()
        part = await running
        await vllm_engine.aclose()  # idempotent
        vllm_engine.close()
        for call in (
            vllm_engine.generate(GenerationRequest("late", [1, 2], SamplingParams(max_new_tokens=2))),
            vllm_engine.abort(),
            vllm_engine.pause(),
            vllm_engine.resume(),
            vllm_engine.sleep(),
            vllm_engine.wake(),
        ):
            with pytest.raises(EngineError, match="closed"):
                await call
        return part

    part = run(scenario())
    assert part.finish_reason == "abort" and 0 < part.num_output_tokens < 200
    assert len(part.output_ids) == len(part.output_logprobs) == len(part.output_versions)
