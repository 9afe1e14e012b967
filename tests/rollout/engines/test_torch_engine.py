"""TorchEngine: exactness of interrupt + resume, processed logprobs vs a float64 teacher-forced reference, weight
updates and versions, pause/abort races."""

import asyncio
import math

import pytest
import torch

from rlblocks.errors import EngineError
from rlblocks.rollout import Generation, GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.engines.torch_sampling import processed_logprobs
from rlblocks.rollout.types import RolloutEngine

PROMPTS = [[1, 5, 6, 7], [1, 30, 31], [1, 9, 9, 9, 9, 12], [1, 40], [1, 20, 21, 22, 23], [1, 15, 16]]


def run(coro, timeout=60.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


def greedy(n=24, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)


# ---------------------------------------------------------------- independent float64 reference
def ref_processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64, one row, written with a Python loop for top-p (independent of the engine's vectorised version)."""
    x = logits.double().clone()
    if temperature == 0:
        return torch.log_softmax(x, -1)
    x = x / temperature
    vocab = x.numel()
    if 0 < top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        x[x < kth] = -math.inf
    if top_p < 1.0:
        probs = torch.softmax(x, -1)
        mass = 0.0
        keep = torch.zeros(vocab, dtype=torch.bool)
        for i in sorted(range(vocab), key=lambda j: -probs[j].item()):
            if mass >= top_p:
                break
            keep[i] = True
            mass += probs[i].item()
        x[~keep] = -math.inf
    return torch.log_softmax(x, -1)


def teacher_forced(model, gen: Generation, sp: SamplingParams) -> torch.Tensor:
    """Logprob of each output token, recomputed from one full forward of prompt + output, float64 processing."""
    full = torch.tensor([gen.prompt_ids + gen.output_ids])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].double()
    p = len(gen.prompt_ids)
    out = [
        ref_processed_logprobs(logits[p - 1 + i], sp.temperature, sp.top_k, sp.top_p)[tok]
        for i, tok in enumerate(gen.output_ids)
    ]
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)


def test_processed_logprobs_matches_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (0.5, 10, 0.9), (2.0, 50, 0.99), (0.0, 3, 0.5)]
    got = processed_logprobs(
        logits,
        torch.tensor([p[0] for p in params]),
        torch.tensor([p[1] for p in params]),
        torch.tensor([p[2] for p in params]),
    )
    for row, (t, k, p) in enumerate(params):
        ref = ref_processed_logprobs(logits[row], t if t > 0 else 1.0, k, p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(ref)), (t, k, p)
        finite = torch.isfinite(ref)
        assert (got[row][finite].double() - ref[finite]).abs().max() < 1e-5


def test_protocol_and_constructor(tiny_hf_dir):
    engine = TorchEngine.from_pretrained(tiny_hf_dir, version=3)
    assert isinstance(engine, RolloutEngine)
    assert engine.version == 3
    gen = run(engine.generate(GenerationRequest("a", [1, 5], greedy(5))))
    assert gen.finish_reason == "length" and gen.num_output_tokens == 5 and gen.output_versions == [3] * 5


# ---------------------------------------------------------------- exactness of interrupt + resume
async def _wait_tokens(engine, rid, k):
    while (engine.num_output_tokens(rid) or 0) < k:
        await asyncio.sleep(0.0005)


async def _settle(engine, turns=5):
    """Let the engine act on what was just submitted, without a wall-clock wait: a few event-loop turns carry a new
    request into the engine and let its loop task see it (a step it wrongly started would be running by then), and
    ``abort([])`` (a no-op: no request named) takes the engine lock between steps, i.e. waits for such a step to end
    and record its token. A request that must wait then has no token and is not done, however busy the machine."""
    for _ in range(turns):
        await asyncio.sleep(0)
    await engine.abort([])


async def _resubmit(engine, part: Generation, sp: SamplingParams, rid: str) -> Generation:
    """The AReaL re-submission, written out by hand: prompt + partial output, remaining budget."""
    left = sp.max_new_tokens - part.num_output_tokens
    sp2 = SamplingParams(sp.temperature, sp.top_p, sp.top_k, left, sp.stop_token_ids, sp.seed)
    return await engine.generate(GenerationRequest(rid, part.prompt_ids + part.output_ids, sp2))


@pytest.mark.parametrize("inline_steps", [False, True])
def test_greedy_interrupt_resume_is_bit_identical_batched_mode(tiny_model, inline_steps):
    """Default (batched) engine, lone request: the resume continues from the aborted request's KV."""
    engine = TorchEngine(tiny_model, inline_steps=inline_steps)
    sp = greedy(24)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", PROMPTS[0], sp))
        hits = engine.stats()["prefix_cache_hits"]
        task = asyncio.ensure_future(engine.generate(GenerationRequest("x", PROMPTS[0], sp)))
        await _wait_tokens(engine, "x", 5)
        await engine.pause("abort")
        part = await task
        await engine.resume()
        rest = await _resubmit(engine, part, sp, "x2")
        return ref, part, rest, engine.stats()["prefix_cache_hits"] - hits

    ref, part, rest, hits = run(main())
    assert part.finish_reason == "abort" and 5 <= part.num_output_tokens < 24
    assert hits == 1
    assert part.output_ids + rest.output_ids == ref.output_ids
    assert part.output_logprobs + rest.output_logprobs == ref.output_logprobs  # bit-identical floats


def test_inline_steps_run_on_the_loop_thread_and_generate_the_same(tiny_model):
    """``inline_steps=True``: every step's forward runs on the event loop's thread (the worker engine's on another
    one), and a seeded batch of prompts of different lengths gives the same tokens, log-probs and versions."""
    import threading

    def traced(engine):
        threads = set()
        compute = engine._compute

        def step(live):
            threads.add(threading.get_ident())
            return compute(live)

        engine._compute = step
        return threads

    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)

    async def main(engine):
        reqs = [GenerationRequest(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)]
        gens = await asyncio.gather(*[engine.generate(r) for r in reqs])
        return gens, threading.get_ident()

    out = {}
    for inline in (False, True):
        engine = TorchEngine(tiny_model, inline_steps=inline)
        threads = traced(engine)
        gens, loop_thread = run(main(engine))
        engine.close()
        assert threads == {loop_thread} if inline else loop_thread not in threads and len(threads) == 1
        out[inline] = [(g.output_ids, g.output_logprobs, g.output_versions, g.finish_reason) for g in gens]
    assert all(len(ids) == 12 for ids, *_ in out[True])
    assert out[True] == out[False]


def test_greedy_interrupt_resume_bit_identical_under_concurrency_batch_invariant(tiny_model):
    """batch_invariant=True, no prefix cache: 6 concurrent requests interrupted at different points and
    re-submitted (full re-prefill) while others run are bit-identical to lone uninterrupted runs."""
    engine = TorchEngine(tiny_model, batch_invariant=True, prefix_cache_size=0)
    sp = greedy(12)

    async def main():
        refs = [await engine.generate(GenerationRequest(f"ref{i}", p, sp)) for i, p in enumerate(PROMPTS)]
        tasks = [
            asyncio.ensure_future(engine.generate(GenerationRequest(f"x{i}", p, sp))) for i, p in enumerate(PROMPTS)
        ]
        await _wait_tokens(engine, "x0", 3)
        await engine.abort(["x0", "x2", "x4"])
        await _wait_tokens(engine, "x1", 6)
        await engine.pause("abort")
        parts = await asyncio.gather(*tasks)
        await engine.resume()
        rests = await asyncio.gather(
            *[_resubmit(engine, part, sp, f"y{i}") for i, part in enumerate(parts)],
            engine.generate(GenerationRequest("noise", [1, 2, 3, 4, 5, 6, 7], greedy(20))),
        )
        return refs, parts, rests[: len(parts)]

    refs, parts, rests = run(main())
    assert sum(p.finish_reason == "abort" for p in parts) == len(PROMPTS)
    assert any(0 < p.num_output_tokens < 12 for p in parts)
    for ref, part, rest in zip(refs, parts, rests):
        assert part.output_ids + rest.output_ids == ref.output_ids
        assert part.output_logprobs + rest.output_logprobs == ref.output_logprobs


def test_seeded_sampling_is_reproducible_across_interrupts(tiny_model):
    engine = TorchEngine(tiny_model, batch_invariant=True, prefix_cache_size=0)
    sp = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=16, seed=1234)

    async def main():
        a = await engine.generate(GenerationRequest("a", PROMPTS[2], sp))
        b = await engine.generate(GenerationRequest("b", PROMPTS[2], sp))
        other = await engine.generate(GenerationRequest("c", PROMPTS[2], SamplingParams(1.0, 1.0, 20, 16, (), 99)))
        task = asyncio.ensure_future(engine.generate(GenerationRequest("x", PROMPTS[2], sp)))
        await _wait_tokens(engine, "x", 4)
        await engine.abort(["x"])
        part = await task
        rest = await _resubmit(engine, part, sp, "y")
        return a, b, other, part, rest

    a, b, other, part, rest = run(main())
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert other.output_ids != a.output_ids
    assert part.output_ids + rest.output_ids == a.output_ids


# ---------------------------------------------------------------- logprobs vs teacher forcing
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_logprobs_match_teacher_forced_float64(tiny_model, batch_invariant):
    engine = TorchEngine(tiny_model, batch_invariant=batch_invariant)
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=10),
        SamplingParams(temperature=1.0, max_new_tokens=10, seed=1),
        SamplingParams(temperature=0.7, top_k=5, max_new_tokens=10, seed=2),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=10, seed=3),
        SamplingParams(temperature=0.9, top_k=8, top_p=0.7, max_new_tokens=10, seed=4),
    ]
    if batch_invariant:
        params = params[2:4]
    reqs = [GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], sp) for i, sp in enumerate(params)]

    async def main():
        return await asyncio.gather(*[engine.generate(r) for r in reqs])

    gens = run(main())
    for req, gen in zip(reqs, gens):
        assert gen.num_output_tokens == 10
        ref = teacher_forced(tiny_model, gen, req.sampling)
        assert torch.isfinite(ref).all(), "a sampled token lies outside the processed support"
        diff = (gen.logprobs_tensor().double() - ref).abs().max().item()
        assert diff < 1e-4, (req.sampling, diff)
        assert all(
            isinstance(x, float) and float(torch.tensor(x, dtype=torch.float32)) == x for x in gen.output_logprobs
        )


def test_stop_length_and_zero_budget(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        ref = await engine.generate(GenerationRequest("r", PROMPTS[1], greedy(12)))
        stop_tok = ref.output_ids[4]
        first = ref.output_ids.index(stop_tok)
        stopped = await engine.generate(GenerationRequest("s", PROMPTS[1], greedy(12, stop_token_ids=(stop_tok,))))
        zero = await engine.generate(GenerationRequest("z", PROMPTS[1], greedy(0)))
        return ref, stopped, first, zero

    ref, stopped, first, zero = run(main())
    assert ref.finish_reason == "length" and ref.num_output_tokens == 12
    assert stopped.finish_reason == "stop" and stopped.output_ids == ref.output_ids[: first + 1]
    assert zero.finish_reason == "length" and zero.num_output_tokens == 0


def test_max_model_len_ends_with_length(tiny_model):
    engine = TorchEngine(tiny_model, max_model_len=8)
    gen = run(engine.generate(GenerationRequest("r", PROMPTS[0], greedy(50))))
    assert gen.finish_reason == "length" and len(gen.prompt_ids) + gen.num_output_tokens == 8
    with pytest.raises(ValueError, match="max_model_len"):
        run(engine.generate(GenerationRequest("r", list(range(1, 9)), greedy(5))))


def test_bad_requests_raise(tiny_model):
    engine = TorchEngine(tiny_model)

    async def dup():
        t = asyncio.ensure_future(engine.generate(GenerationRequest("d", [1, 2], greedy(30))))
        await asyncio.sleep(0)
        try:
            await engine.generate(GenerationRequest("d", [1, 2], greedy(3)))
        finally:
            await t

    with pytest.raises(ValueError, match="already in flight"):
        run(dup())
    with pytest.raises(ValueError, match="prompt_ids"):
        run(engine.generate(GenerationRequest("v", [1, 64], greedy(3))))
    with pytest.raises(ValueError, match="mode"):
        run(engine.pause("drain"))


# ---------------------------------------------------------------- weight updates and versions
def _perturbed(model, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_update_during_keep_pause_tags_versions_and_reprefills(tiny_model, make_tiny_model):
    engine = TorchEngine(tiny_model)
    sp = greedy(20)
    new = _perturbed(tiny_model)
    reference_new = make_tiny_model()
    reference_new.load_state_dict(new, strict=False)

    async def main():
        task = asyncio.ensure_future(engine.generate(GenerationRequest("x", PROMPTS[3], sp)))
        await _wait_tokens(engine, "x", 5)
        await engine.pause("keep")
        k = engine.num_output_tokens("x")
        prefill_before = engine.stats()["prefill_tokens"]
        await engine.update_weights(new.items(), version=7)
        assert engine.version == 7 and engine.is_paused
        await engine.resume()
        gen = await task
        return gen, k, engine.stats()["prefill_tokens"] - prefill_before

    gen, k, reprefilled = run(main())
    assert gen.finish_reason == "length" and gen.num_output_tokens == 20
    assert gen.output_versions == [0] * k + [7] * (20 - k)
    assert gen.version_spans() == [(0, 0, k), (7, k, 20)]
    assert reprefilled == len(PROMPTS[3]) + k  # the frozen KV was dropped and recomputed under the new weights
    # tokens after the update: logprobs of the NEW model on the full prefix (would fail with stale KV)
    ref_new = teacher_forced(reference_new, gen, sp)
    assert (gen.logprobs_tensor()[k:].double() - ref_new[k:]).abs().max() < 1e-4
    ref_old = teacher_forced(make_tiny_model(), gen, sp)
    assert (gen.logprobs_tensor()[:k].double() - ref_old[:k]).abs().max() < 1e-4


def test_update_weights_self_pauses_and_clears_prefix_cache(tiny_model):
    engine = TorchEngine(tiny_model)
    sp = greedy(20)
    new = _perturbed(tiny_model, seed=1)

    async def main():
        task = asyncio.ensure_future(engine.generate(GenerationRequest("x", PROMPTS[4], sp)))
        await _wait_tokens(engine, "x", 4)
        part_task = asyncio.ensure_future(engine.abort(["x"]))
        assert await part_task == ["x"]
        part = await task
        await engine.update_weights(iter(new.items()), version=1)  # not paused: pauses itself, then resumes
        assert not engine.is_paused
        hits, prefill = engine.stats()["prefix_cache_hits"], engine.stats()["prefill_tokens"]
        rest = await _resubmit(engine, part, sp, "y")
        return part, rest, engine.stats()["prefix_cache_hits"] - hits, engine.stats()["prefill_tokens"] - prefill

    part, rest, hits, prefill = run(main())
    assert hits == 0  # the KV of the aborted request belonged to version 0
    assert prefill == len(PROMPTS[4]) + part.num_output_tokens
    assert set(rest.output_versions) == {1}


def test_version_visible_only_after_last_tensor(tiny_model):
    engine = TorchEngine(tiny_model, version=2)
    seen = []
    new = _perturbed(tiny_model, seed=2)

    def stream():
        for name, t in new.items():
            seen.append(engine.version)
            yield name, t

    run(engine.update_weights(stream(), version=3))
    assert seen and set(seen) == {2}
    assert engine.version == 3
    assert torch.equal(dict(tiny_model.named_parameters())["lm_head.weight"], new["lm_head.weight"])


@pytest.mark.parametrize(
    "bad, match",
    [
        (("model.layers.0.self_attn.q_proj.wieght", torch.zeros(64, 64)), "q_proj.wieght"),
        (("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3)), r"up_proj.weight.*expected shape \[128, 64\]"),
        (("lm_head.weight", "not a tensor"), "lm_head.weight"),
    ],
)
def test_update_weights_rejects_bad_tensor_and_leaves_engine_unchanged(tiny_model, bad, match):
    engine = TorchEngine(tiny_model, version=5)
    before = {n: p.detach().clone() for n, p in tiny_model.state_dict().items()}
    good = ("model.embed_tokens.weight", torch.ones(64, 64))  # valid, listed BEFORE the bad one

    async def main():
        ref = await engine.generate(GenerationRequest("a", PROMPTS[0], greedy(8)))
        with pytest.raises(ValueError, match=match):
            await engine.update_weights([good, bad], version=6)
        after = await engine.generate(GenerationRequest("b", PROMPTS[0], greedy(8)))
        return ref, after

    ref, after = run(main())
    assert engine.version == 5 and not engine.is_paused
    for n, p in tiny_model.state_dict().items():
        assert torch.equal(p, before[n]), n
    assert after.output_ids == ref.output_ids and after.output_versions == [5] * 8


def test_update_weights_rejects_bad_version(tiny_model):
    engine = TorchEngine(tiny_model)
    with pytest.raises(ValueError, match="version"):
        run(engine.update_weights([], version="1"))


# ---------------------------------------------------------------- pause / abort races
def test_request_submitted_concurrently_with_pause_is_never_lost(tiny_model):
    engine = TorchEngine(tiny_model)
    sp = greedy(10)

    async def main():
        # submitted in the same tick as pause(abort): registered first, so it is aborted (maybe with 0 tokens)
        t1 = asyncio.ensure_future(engine.generate(GenerationRequest("a", PROMPTS[0], sp)))
        await asyncio.sleep(0)
        await engine.pause("abort")
        g1 = await t1
        # submitted while paused: waits for resume, then completes
        t2 = asyncio.ensure_future(engine.generate(GenerationRequest("b", PROMPTS[0], sp)))
        await _settle(engine)
        assert not t2.done() and engine.num_output_tokens("b") == 0
        # pause and generate racing in one gather, both orders
        g3, _ = await asyncio.gather(engine.generate(GenerationRequest("c", PROMPTS[1], sp)), engine.resume())
        await engine.resume()
        g2 = await t2
        return g1, g2, g3

    g1, g2, g3 = run(main())
    assert g1.finish_reason == "abort" and g1.num_output_tokens < 10
    assert g2.finish_reason == "length" and g2.num_output_tokens == 10
    assert g3.finish_reason == "length" and g3.num_output_tokens == 10


@pytest.mark.parametrize("inline_steps", [False, True])
def test_pause_abort_races_many_requests(tiny_model, inline_steps):
    engine = TorchEngine(tiny_model, inline_steps=inline_steps)
    sp = SamplingParams(temperature=1.0, max_new_tokens=30, seed=0)

    async def main():
        tasks = []
        for i in range(16):
            tasks.append(asyncio.ensure_future(engine.generate(GenerationRequest(f"r{i}", PROMPTS[i % 6], sp))))
            if i == 8:
                pause = asyncio.ensure_future(engine.pause("abort"))
            # jitter in event-loop turns, not seconds: submissions land at different points of the engine's step
            # (lock, forward in its thread, result), and as a step takes at least two turns, no request can reach
            # its 30 tokens before the pause, however busy the machine
            for _ in range(i % 3):
                await asyncio.sleep(0)
        await pause
        late_done = [t.done() for t in tasks[9:]]
        await engine.resume()
        return await asyncio.gather(*tasks), late_done

    gens, late_done = run(main())
    for g in gens[:9]:
        assert g.finish_reason == "abort" and len(g.output_ids) == len(g.output_logprobs) == len(g.output_versions)
    assert not any(late_done)  # submitted after pause(): waited
    assert all(g.finish_reason == "length" and g.num_output_tokens == 30 for g in gens[9:])


def test_abort_zero_tokens_and_unknown_id(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        await engine.pause("keep")
        t = asyncio.ensure_future(engine.generate(GenerationRequest("z", PROMPTS[0], greedy(10))))
        other = asyncio.ensure_future(engine.generate(GenerationRequest("o", PROMPTS[1], greedy(10))))
        await asyncio.sleep(0.01)
        unknown = await engine.abort(["nope"])
        aborted = await engine.abort(["z", "nope"])
        g = await t
        await engine.resume()
        return unknown, aborted, g, await other

    unknown, aborted, g, other = run(main())
    assert unknown == [] and aborted == ["z"]
    assert g.finish_reason == "abort" and g.output_ids == [] and g.output_logprobs == [] and g.output_versions == []
    assert other.finish_reason == "length" and other.num_output_tokens == 10  # untouched by the unknown-id abort


def test_abort_all_and_keep_pause_resume_matches_uninterrupted(tiny_model):
    engine = TorchEngine(tiny_model)
    sp = greedy(16)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", PROMPTS[5], sp))
        t = asyncio.ensure_future(engine.generate(GenerationRequest("k", PROMPTS[5], sp)))
        await _wait_tokens(engine, "k", 3)
        await engine.pause("keep")
        frozen = engine.num_output_tokens("k")
        await _settle(engine)
        assert engine.num_output_tokens("k") == frozen and not t.done()
        await engine.resume()
        kept = await t
        ts = [asyncio.ensure_future(engine.generate(GenerationRequest(f"a{i}", PROMPTS[i], sp))) for i in range(4)]
        await _wait_tokens(engine, "a0", 2)
        ids = await engine.abort()
        return ref, kept, ids, await asyncio.gather(*ts)

    ref, kept, ids, gens = run(main())
    assert kept.output_ids == ref.output_ids and kept.output_logprobs == ref.output_logprobs
    assert sorted(ids) == ["a0", "a1", "a2", "a3"]
    assert all(g.finish_reason == "abort" and g.num_output_tokens >= 1 for g in gens)


def test_cancelled_caller_does_not_disturb_others(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", PROMPTS[2], greedy(12)))
        a = asyncio.ensure_future(engine.generate(GenerationRequest("a", PROMPTS[0], greedy(40))))
        b = asyncio.ensure_future(engine.generate(GenerationRequest("b", PROMPTS[2], greedy(12))))
        await _wait_tokens(engine, "a", 2)
        a.cancel()
        gb = await b
        return ref, gb, engine.num_in_flight

    ref, gb, left = run(main())
    assert gb.output_ids == ref.output_ids and left == 0


def test_sleep_wake_and_reuse_across_event_loops(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        await engine.sleep()
        t = asyncio.ensure_future(engine.generate(GenerationRequest("s", PROMPTS[0], greedy(6))))
        await _settle(engine)
        assert not t.done() and engine.num_output_tokens("s") == 0
        await engine.wake()
        return await t

    g1 = run(main())
    g2 = run(engine.generate(GenerationRequest("s", PROMPTS[0], greedy(6))))  # a second asyncio.run
    assert g1.output_ids == g2.output_ids and g1.num_output_tokens == 6


def test_sampled_token_frequencies_follow_processed_distribution(tiny_model):
    """2000 one-token draws (distinct seeds) vs the float64 processed distribution (T=0.8, top-k 6, top-p 0.9)."""
    engine = TorchEngine(tiny_model)
    sp = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=1, seed=s) for s in range(2000)]
    prompt = PROMPTS[2]

    async def main():
        return await asyncio.gather(*[engine.generate(GenerationRequest(f"s{i}", prompt, p)) for i, p in enumerate(sp)])

    gens = run(main())
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = ref_processed_logprobs(logits, 0.8, 6, 0.9).exp()
    counts = torch.bincount(torch.tensor([g.output_ids[0] for g in gens]), minlength=probs.numel()).double()
    freq = counts / counts.sum()
    assert (freq[probs == 0] == 0).all()  # nothing outside the support
    sigma = (probs * (1 - probs) / 2000).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-3).all(), (freq[probs > 0], probs[probs > 0])


def test_forward_error_fails_callers_and_engine_recovers(tiny_model):
    engine = TorchEngine(tiny_model)
    real = engine._forward

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    async def main():
        engine._forward = broken
        results = await asyncio.gather(
            *[engine.generate(GenerationRequest(f"e{i}", PROMPTS[i], greedy(4))) for i in range(3)],
            return_exceptions=True,
        )
        engine._forward = real
        return results, await engine.generate(GenerationRequest("ok", PROMPTS[0], greedy(4)))

    results, ok = run(main())
    assert all(isinstance(r, EngineError) and "device lost" in str(r) for r in results)
    assert ok.num_output_tokens == 4 and engine.num_in_flight == 0


@pytest.mark.gpu
def test_cuda_generation_logprobs_and_sleep_wake(tiny_model):
    """On CUDA: processed logprobs match the CPU float64 reference; sleep() aborts the request in flight (its
    partial output comes back), offloads the weights, and wake() brings them back; the resumed request finishes."""
    from rlblocks.rollout import resumable_generate

    model = tiny_model.to("cuda")
    engine = TorchEngine(model)
    sp = SamplingParams(temperature=0.9, top_k=8, max_new_tokens=12, seed=3)

    async def main():
        t = asyncio.ensure_future(resumable_generate(engine, GenerationRequest("g", PROMPTS[0], sp)))
        await _wait_tokens(engine, "g", 3)
        await engine.sleep()
        on_cpu = next(model.parameters()).device.type == "cpu"
        await engine.wake()
        return on_cpu, await t

    on_cpu, gen = run(main())
    assert on_cpu and next(model.parameters()).device.type == "cuda" and gen.num_output_tokens == 12
    ref = teacher_forced(model.float().cpu(), gen, sp)
    assert (gen.logprobs_tensor().double() - ref).abs().max() < 1e-4
