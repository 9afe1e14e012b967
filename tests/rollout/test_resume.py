"""resumable_generate: stitching across aborts, version spans and stale masks, paused engines, exactness."""

import asyncio
import math

import pytest
import torch

from rlblocks.rollout import Generation, GenerationRequest, ResumableResult, SamplingParams, resumable_generate
from rlblocks.rollout.engines import TorchEngine


def run(coro, timeout=60.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


def _teacher_forced_untempered(model, prompt, output):
    full = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=full).logits[0].double(), -1)
    p = len(prompt)
    return torch.stack([logp[p - 1 + i, t] for i, t in enumerate(output)])


async def _wait_tokens(engine, rid, k):
    while (engine.num_output_tokens(rid) or 0) < k:
        await asyncio.sleep(0.0005)


# ---------------------------------------------------------------- scripted fake engine (stitching logic only)
class ScriptedEngine:
    """Returns scripted (ids, finish_reason) chunks and records every request it receives."""

    def __init__(self, chunks, version=0, has_pause_flag=True):
        self.chunks = list(chunks)
        self.requests = []
        self._version = version
        if has_pause_flag:
            self.is_paused = False

    @property
    def version(self):
        return self._version

    async def generate(self, request):
        self.requests.append(request)
        ids, reason, version = self.chunks.pop(0)
        ids = ids[: request.sampling.max_new_tokens]
        return Generation(
            request.request_id, request.prompt_ids, ids, [-0.5 - t for t in ids], [version] * len(ids), reason
        )


def test_stitching_budget_versions_and_masks():
    eng = ScriptedEngine([([10, 11], "abort", 0), ([], "abort", 1), ([12, 13, 14], "abort", 1), ([15], "stop", 2)])
    req = GenerationRequest("r", [1, 2], SamplingParams(temperature=1.0, max_new_tokens=10, seed=5), session_id="s")
    res = run(resumable_generate(eng, req, mask_stale=True, poll_interval=0.001))
    assert isinstance(res, ResumableResult)
    assert res.prompt_ids == [1, 2] and res.output_ids == [10, 11, 12, 13, 14, 15]
    assert res.output_logprobs == [-10.5, -11.5, -12.5, -13.5, -14.5, -15.5]
    assert res.output_versions == [0, 0, 1, 1, 1, 2] and res.finish_reason == "stop"
    assert res.version_spans() == [(0, 0, 2), (1, 2, 5), (2, 5, 6)]
    assert res.final_version == 2 and res.stale == [True] * 5 + [False] and res.num_stale_tokens == 5
    assert res.loss_mask == [False] * 5 + [True]
    assert res.num_submissions == 4 and res.resubmitted_tokens == 4 + 4 + 7
    sent = [(r.prompt_ids, r.sampling.max_new_tokens) for r in eng.requests]
    assert sent == [([1, 2], 10), ([1, 2, 10, 11], 8), ([1, 2, 10, 11], 8), ([1, 2, 10, 11, 12, 13, 14], 5)]
    assert all(r.request_id == "r" and r.session_id == "s" and r.sampling.seed == 5 for r in eng.requests)


def test_abort_with_budget_spent_is_length_and_report_mode_keeps_mask():
    eng = ScriptedEngine([([1, 2, 3], "abort", 0), ([4, 5], "abort", 1)], has_pause_flag=False)
    res = run(resumable_generate(eng, GenerationRequest("r", [9], SamplingParams(max_new_tokens=5))))
    assert res.output_ids == [1, 2, 3, 4, 5] and res.finish_reason == "length" and res.num_submissions == 2
    assert res.stale == [True, True, True, False, False] and res.loss_mask == [True] * 5


def test_zero_token_aborts_back_off_without_pause_flag_and_max_submissions():
    eng = ScriptedEngine([([], "abort", 0)] * 3 + [([7], "length", 0)], version=4, has_pause_flag=False)
    res = run(
        resumable_generate(eng, GenerationRequest("r", [9], SamplingParams(max_new_tokens=1)), poll_interval=0.001)
    )
    assert res.output_ids == [7] and res.num_submissions == 4 and res.finish_reason == "length"
    eng = ScriptedEngine([([], "abort", 0)] * 3, version=4)
    res = run(
        resumable_generate(
            eng, GenerationRequest("r", [9], SamplingParams(max_new_tokens=3)), max_submissions=2, poll_interval=0.001
        )
    )
    assert res.finish_reason == "abort" and res.output_ids == [] and res.final_version == 4
    assert res.num_submissions == 2
    with pytest.raises(ValueError, match="max_submissions"):
        run(resumable_generate(eng, GenerationRequest("r", [9]), max_submissions=0))


def test_zero_budget_makes_no_call():
    eng = ScriptedEngine([])
    res = run(resumable_generate(eng, GenerationRequest("r", [9], SamplingParams(max_new_tokens=0))))
    assert res.output_ids == [] and res.finish_reason == "length" and res.num_submissions == 0


# ---------------------------------------------------------------- against TorchEngine
def test_interrupted_resumable_greedy_is_bit_identical(tiny_model):
    engine = TorchEngine(tiny_model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    req = GenerationRequest("g", [1, 5, 6, 7], sp)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", req.prompt_ids, sp))
        task = asyncio.ensure_future(resumable_generate(engine, req))
        await _wait_tokens(engine, "g", 4)
        await engine.pause("abort")
        await asyncio.sleep(0.02)
        await engine.resume()
        return ref, await task

    ref, res = run(main())
    assert res.num_submissions == 2 and res.finish_reason == "length"
    assert res.output_ids == ref.output_ids and res.output_logprobs == ref.output_logprobs
    assert res.version_spans() == [(0, 0, 20)] and not any(res.stale)


def test_version_spans_after_update_during_pause(tiny_model, make_tiny_model):
    engine = TorchEngine(tiny_model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    req = GenerationRequest("v", [1, 30, 31], sp)
    g = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=g) for n, p in tiny_model.named_parameters()}
    old_model, new_model = make_tiny_model(), make_tiny_model()
    new_model.load_state_dict(new, strict=False)

    async def main():
        task = asyncio.ensure_future(resumable_generate(engine, req, mask_stale=True))
        await _wait_tokens(engine, "v", 5)
        await engine.pause("abort")
        await asyncio.sleep(0.01)  # the client re-submits while paused: it must wait, not fail
        await engine.update_weights(new.items(), version=1)
        await engine.resume()
        return await task

    res = run(main())
    k = res.version_spans()[0][2]
    assert 5 <= k < 16 and res.version_spans() == [(0, 0, k), (1, k, 16)]
    assert res.stale == [True] * k + [False] * (16 - k) and res.loss_mask == [not s for s in res.stale]
    assert res.resubmitted_tokens == 3 + k
    # old-policy tokens carry old-policy logprobs; new ones those of the new weights on the full prefix
    lp = res.logprobs_tensor().double()
    assert (lp[:k] - _teacher_forced_untempered(old_model, req.prompt_ids, res.output_ids)[:k]).abs().max() < 1e-4
    assert (lp[k:] - _teacher_forced_untempered(new_model, req.prompt_ids, res.output_ids)[k:]).abs().max() < 1e-4


def test_abort_before_first_token_then_resume(tiny_model):
    engine = TorchEngine(tiny_model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", [1, 40], sp))
        await engine.pause("keep")
        task = asyncio.ensure_future(resumable_generate(engine, GenerationRequest("z", [1, 40], sp)))
        while engine.num_output_tokens("z") is None:  # until the request is in flight (held: the engine is paused)
            await asyncio.sleep(0)
        assert await engine.abort(["z"]) == ["z"]  # zero tokens produced
        for _ in range(5):  # event-loop turns, not seconds: the client sees the abort, and must wait for the resume
            await asyncio.sleep(0)
        assert not task.done() and engine.is_paused
        await engine.resume()
        return ref, await task

    ref, res = run(main())
    assert res.output_ids == ref.output_ids and res.num_submissions >= 2 and res.resubmitted_tokens >= 2


def test_client_loop_survives_repeated_pause_update_resume(tiny_model, make_tiny_model):
    engine = TorchEngine(tiny_model)
    sp = SamplingParams(temperature=1.0, top_k=16, max_new_tokens=32, seed=None)
    reqs = [GenerationRequest(f"r{i}", [1, 5 + i, 6 + i], sp) for i in range(16)]
    g = torch.Generator().manual_seed(1)
    states = []
    for _ in range(2):
        states.append(
            {n: p.detach() + 0.3 * torch.randn(p.shape, generator=g) for n, p in tiny_model.named_parameters()}
        )

    async def main():
        tasks = [asyncio.ensure_future(resumable_generate(engine, r)) for r in reqs]
        for v, sd in enumerate(states, start=1):
            while max(engine.num_output_tokens(r.request_id) or 0 for r in reqs) < 3:
                await asyncio.sleep(0.0005)
            await engine.pause("abort")
            await engine.update_weights(sd.items(), version=v)
            await engine.resume()
        return await asyncio.gather(*tasks)

    results = run(main())
    assert sum(len(r.version_spans()) == 3 for r in results) >= 8  # most requests crossed both updates
    final_model = make_tiny_model()
    final_model.load_state_dict(states[-1], strict=False)
    for res in results:
        assert res.num_output_tokens == 32 and res.finish_reason == "length"
        assert res.output_versions == sorted(res.output_versions) and set(res.output_versions) <= {0, 1, 2}
        assert len(res.output_ids) == len(res.output_logprobs) == len(res.stale) == 32
        assert all(math.isfinite(x) and x <= 0 for x in res.output_logprobs)
    # the tokens of the final version: processed (T=1, top-k 16) logprobs of the final weights
    res = next(r for r in results if r.final_version == 2 and not all(r.stale))
    full = torch.tensor([res.prompt_ids + res.output_ids])
    with torch.no_grad():
        logits = final_model(input_ids=full).logits[0].double()
    p = len(res.prompt_ids)
    for i, (tok, lp, st) in enumerate(zip(res.output_ids, res.output_logprobs, res.stale)):
        if st:
            continue
        row = logits[p - 1 + i]
        kth = row.sort(descending=True).values[15]
        row = torch.where(row < kth, torch.tensor(-math.inf, dtype=torch.float64), row)
        assert abs(torch.log_softmax(row, -1)[tok].item() - lp) < 1e-4
