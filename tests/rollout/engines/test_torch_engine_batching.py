"""TorchEngine's batched step: one left-padded prefill forward for prompts of different lengths gives each request
the log-probs of its prefill alone; the decode batch's KV (preallocated, written in place, rows removed by moving
the last row) holds each sequence's own keys and values; aborting one request leaves the others' outputs."""

import asyncio

import pytest
import torch

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.engines.torch_memory import _Batch

PROMPTS = [[1, 5, 6, 7], [1, 30, 31], [1, 9, 9, 9, 9, 12, 13, 14, 15], [1, 40], [1, 20, 21, 22, 23], [1, 15, 16]]


def run(coro, timeout=120.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


def greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def reqs(sp, tag="r"):
    return [GenerationRequest(f"{tag}{i}", p, sp) for i, p in enumerate(PROMPTS)]


async def together(engine, requests):
    return await asyncio.gather(*[engine.generate(r) for r in requests])


async def one_at_a_time(engine, requests):
    return [await engine.generate(r) for r in requests]


@pytest.fixture
def f64_model(make_tiny_model):
    return make_tiny_model().double()


def test_prompts_of_different_lengths_prefill_in_one_forward(tiny_model):
    engine = TorchEngine(tiny_model, prefix_cache_size=0)
    gens = run(together(engine, reqs(greedy(1))))
    assert [g.num_output_tokens for g in gens] == [1] * len(PROMPTS)
    assert len({len(p) for p in PROMPTS}) > 3 and engine.stats()["forwards"] == 1
    assert engine.stats()["prefill_tokens"] == sum(len(p) for p in PROMPTS)  # real tokens, not padding


def test_batched_prefill_logprobs_equal_one_at_a_time_float64(f64_model):
    """float64 weights: padding and batching change the logits by ~1e-15, so the fp32 log-probs agree to fp32
    rounding and the greedy tokens are the same."""
    engine = TorchEngine(f64_model, prefix_cache_size=0)
    batched = run(together(engine, reqs(greedy(12))))
    alone = run(one_at_a_time(engine, reqs(greedy(12), "a")))
    for b, a in zip(batched, alone):
        assert b.output_ids == a.output_ids
        diff = (b.logprobs_tensor().double() - a.logprobs_tensor().double()).abs().max().item()
        assert diff <= 2e-6 * max(1.0, a.logprobs_tensor().abs().max().item()), diff


def test_batched_prefill_logprobs_match_float32_one_at_a_time(tiny_model):
    engine = TorchEngine(tiny_model, prefix_cache_size=0)
    batched = run(together(engine, reqs(greedy(12))))
    alone = run(one_at_a_time(engine, reqs(greedy(12), "a")))
    for b, a in zip(batched, alone):
        assert b.output_ids == a.output_ids
        assert (b.logprobs_tensor() - a.logprobs_tensor()).abs().max() < 1e-4


def test_seeded_generations_repeat_and_batch_invariant_mode_is_exact_under_concurrency(tiny_model):
    """Batched mode: the same requests together give the same tokens and bits on a second run (same batch
    composition). batch_invariant=True promises more: each request's output does not depend on the others."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
    engine = TorchEngine(tiny_model, prefix_cache_size=0)
    first = run(together(engine, reqs(sp, "x")))
    second = run(together(engine, reqs(sp, "y")))
    assert [g.output_ids for g in first] == [g.output_ids for g in second]
    assert [g.output_logprobs for g in first] == [g.output_logprobs for g in second]
    inv = TorchEngine(tiny_model, batch_invariant=True, prefix_cache_size=0)
    conc = run(together(inv, reqs(sp, "c")))
    alone = run(one_at_a_time(inv, reqs(sp, "a")))
    assert [g.output_ids for g in conc] == [g.output_ids for g in alone]
    assert [g.output_logprobs for g in conc] == [g.output_logprobs for g in alone]


@pytest.mark.parametrize("victim", [0, 2, 5])
def test_abort_one_of_many_leaves_the_others(tiny_model, victim):
    """Abort one request (first, middle or last row) after 4 tokens: the others finish with the tokens they get
    when nothing is aborted, and log-probs equal up to the last bits a smaller batch may change."""
    n = 16
    engine = TorchEngine(tiny_model, prefix_cache_size=0)
    ref = run(together(engine, reqs(greedy(n), "ref")))

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs(greedy(n), "x")]
        while (engine.num_output_tokens(f"x{victim}") or 0) < 4:
            await asyncio.sleep(0.0005)
        await engine.pause("keep")
        assert await engine.abort([f"x{victim}"]) == [f"x{victim}"]
        await engine.resume()
        return await asyncio.gather(*tasks)

    gens = run(main())
    assert gens[victim].finish_reason == "abort" and 4 <= gens[victim].num_output_tokens < n
    k = gens[victim].num_output_tokens
    assert gens[victim].output_ids == ref[victim].output_ids[:k]
    for i, (g, r) in enumerate(zip(gens, ref)):
        if i != victim:
            assert g.finish_reason == "length" and g.output_ids == r.output_ids, i
            assert (g.logprobs_tensor() - r.logprobs_tensor()).abs().max() < 1e-4, i


# ---------------------------------------------------------------- the decode batch's memory
def _kv(rng, rows, width, layers=2, heads=2, dim=4):
    return [(torch.randn(rows, heads, width, dim, generator=rng), torch.randn(rows, heads, width, dim, generator=rng))
            for _ in range(layers)]


def test_decode_batch_rows_hold_each_sequence_kv_through_joins_steps_and_removals():
    """Random joins (narrower and wider than the batch), one-column steps and removals, checked against a plain
    per-sequence list of KV (concatenation): every row's real columns are its sequence's keys/values, its padding
    is zero, and the buffers re-allocate only O(log) times over many steps."""
    rng = torch.Generator().manual_seed(0)
    ref: dict[object, list] = {}
    seqs = [object() for _ in range(40)]
    fresh = iter(seqs)
    first = [next(fresh) for _ in range(3)]
    kv0 = _kv(rng, 3, 5)
    pads0 = [0, 2, 4]
    batch = _Batch(kv0, pads0, first, max_len=4096)
    for b, s in enumerate(first):
        ref[s] = [(k[b : b + 1, :, pads0[b] :], v[b : b + 1, :, pads0[b] :]) for k, v in kv0]
    reallocs, last_ptr = 0, batch.keys[0].data_ptr()
    for step in range(300):
        op = step % 7
        if op == 3 and batch.n < 12:  # a join, of 1-2 rows, sometimes wider than the batch
            rows = 1 + step % 2
            width = 1 + (step * 13) % (batch.width + 6)
            pads = [0, min(width - 1, 1)][:rows]
            kv = _kv(rng, rows, width)
            new = [next(fresh, None) or object() for _ in range(rows)]
            batch.add(kv, pads, new)
            for b, s in enumerate(new):
                ref[s] = [(k[b : b + 1, :, pads[b] :], v[b : b + 1, :, pads[b] :]) for k, v in kv]
        elif op == 5 and batch.n > 2:  # a removal, anywhere
            gone = batch.seqs[(step * 7) % batch.n]
            batch.remove([gone])
            del ref[gone]
        # a decode step: one column per row, written in place through the cache layers
        batch.trim()
        batch.reserve(1)
        if batch.keys[0].data_ptr() != last_ptr:
            reallocs, last_ptr = reallocs + 1, batch.keys[0].data_ptr()
        cache = batch.cache()
        col = _kv(rng, batch.n, 1)
        for layer, (k, v) in enumerate(col):
            cache.layers[layer].update(k, v)
        batch.end += 1
        for b, s in enumerate(batch.seqs):
            ref[s] = [(torch.cat([rk, k[b : b + 1]], -2), torch.cat([rv, v[b : b + 1]], -2))
                      for (rk, rv), (k, v) in zip(ref[s], col)]
        assert set(batch.row_of) == set(batch.seqs) == set(ref) and len(batch.seqs) == batch.n
        for b, s in enumerate(batch.seqs):
            assert batch.row_of[s] == b
            for (k, v), (rk, rv) in zip(batch.row_kv(b), ref[s]):
                assert torch.equal(k, rk) and torch.equal(v, rv)
            for bk in batch.keys:  # the row's padding inside the window is zero
                assert not bk[b, :, batch.start : batch.start + batch.pads[b]].any()
        assert min(batch.pads) == 0  # trimmed: no column every row pads
    assert reallocs <= 12, reallocs  # geometric growth, not one allocation per step


def test_identical_prompts_prefill_once_and_sample_like_one_at_a_time_float64(f64_model):
    """A GRPO group (K requests with one prompt) plus distinct prompts: each distinct prompt is computed once in the
    prefill forward (the others' rows copied), and every request's tokens and log-probs equal its own run alone,
    sampled with its own seed."""
    group = [PROMPTS[2]] * 4 + [PROMPTS[0]] * 3 + [PROMPTS[3]]
    requests = [GenerationRequest(f"g{i}", p, SamplingParams(temperature=1.0, max_new_tokens=6, seed=100 + i))
                for i, p in enumerate(group)]
    engine = TorchEngine(f64_model, prefix_cache_size=0)
    batched = run(together(engine, requests))
    stats = engine.stats()
    distinct = len(PROMPTS[2]) + len(PROMPTS[0]) + len(PROMPTS[3])
    assert stats["prefill_tokens"] == distinct
    assert stats["prefill_tokens_shared"] == sum(map(len, group)) - distinct
    alone = run(one_at_a_time(TorchEngine(f64_model, prefix_cache_size=0), requests))
    for b, a in zip(batched, alone):
        assert b.output_ids == a.output_ids
        torch.testing.assert_close(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs),
                                   rtol=0, atol=1e-5)
