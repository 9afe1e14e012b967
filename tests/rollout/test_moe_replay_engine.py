"""Routing records carried by the rollout types: ``TorchEngine(record_routing=True)``, ``Generation.routed_experts``,
``resumable_generate`` and ``build_batch``; each record checked by replaying it in a trainer forward."""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout import Generation, GenerationRequest, SamplingParams, build_batch
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.moe_replay import RoutingRecorder, pad_routing, replay_routing, route_flip_fraction, routing_spec
from rlblocks.rollout.resume import resumable_generate

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from _moe_replay_models import VOCAB, response_logp, tiny_moe


def _replay_mismatch(model, batch, *, mask=None):
    """max |trainer - engine| log-prob over ``mask`` (default: the response) with the batch's routing replayed,
    and the fraction of routes the trainer would have chosen differently on its own."""
    spec = routing_spec(model)
    mask = batch.response_mask if mask is None else mask
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec:
        model(batch.input_ids, attention_mask=batch.attention_mask)
    own = rec.take().view(*batch.input_ids.shape, spec.num_layers, spec.top_k)
    with torch.no_grad(), replay_routing(model, batch.routed_experts):
        lp = response_logp(model, batch.input_ids, batch.prompt_lens, batch.response_mask, batch.attention_mask)
    d = (lp - batch.rollout_logp).abs()[mask]
    return float(d.max()), float(route_flip_fraction(batch.routed_experts, own, batch.attention_mask))


def test_concurrent_requests_each_get_their_own_rows():
    """8 requests of 3 prompt lengths at once: grouped prefills, a left-padded decode batch, rows leaving it."""
    model = tiny_moe("qwen3")
    engine = TorchEngine(model, record_routing=True)
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(f"r{i}", torch.randint(4, VOCAB, (4 + i % 3,), generator=g).tolist(),
                              SamplingParams(max_new_tokens=6 + i, seed=i)) for i in range(8)]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    gens = asyncio.run(run())
    for gen in gens:
        assert gen.routed_experts.dtype == torch.uint8
        assert gen.routed_experts.shape == (len(gen.prompt_ids) + len(gen.output_ids) - 1, 4, 2)
    batch = build_batch(gens, pad_id=0)
    assert batch.routed_experts.shape == (*batch.input_ids.shape, 4, 2)
    want = pad_routing([gen.routed_experts for gen in gens], seq_len=batch.input_ids.shape[1])
    assert torch.equal(batch.routed_experts, want)
    for b, gen in enumerate(gens):  # the last token of each row was never fed: no record
        assert bool((batch.routed_experts[b, len(gen.prompt_ids) + len(gen.output_ids) - 1 :] == -1).all())
    worst, flips = _replay_mismatch(model, batch)
    assert worst <= 1e-4, worst  # a row given another row's routing would be far off
    assert flips <= 0.01, flips  # and the records are the routes the model takes (up to batch-shape rounding)


def test_resume_through_the_prefix_cache_keeps_the_routing():
    model = tiny_moe("mixtral")
    engine = TorchEngine(model, record_routing=True)
    prompt = torch.randint(4, VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    req = GenerationRequest("r", prompt, SamplingParams(max_new_tokens=20, seed=3))

    async def run():
        task = asyncio.create_task(resumable_generate(engine, req))
        while (engine.num_output_tokens("r") or 0) < 5:
            await asyncio.sleep(0)
        await engine.pause("abort")
        await engine.resume()
        return await task

    res = asyncio.run(run())
    assert res.num_submissions == 2 and engine.stats()['prefix_cache_hits'] == 1
    assert res.routed_experts.shape == (len(prompt) + 19, 4, 2)
    worst, _ = _replay_mismatch(model, build_batch([res], pad_id=0))
    assert worst <= 1e-4, worst


def test_weight_update_re_records_every_position():
    """A request frozen by pause("keep") across a weight update is re-prefilled from position 0 under the new
    weights: its record is then the new weights' routing for every position."""
    model = tiny_moe("qwen3")
    new = tiny_moe("qwen3", seed=1)
    engine = TorchEngine(model, record_routing=True)
    prompt = torch.randint(4, VOCAB, (6,), generator=torch.Generator().manual_seed(2)).tolist()

    async def run():
        task = asyncio.create_task(engine.generate(GenerationRequest("r", prompt, SamplingParams(max_new_tokens=16,
                                                                                                 seed=4))))
        while (engine.num_output_tokens("r") or 0) < 5:
            await asyncio.sleep(0)
        await engine.pause("keep")
        await engine.update_weights(new.state_dict().items(), version=1)
        await engine.resume()
        return await task

    gen = asyncio.run(run())
    assert 0 in gen.output_versions and 1 in gen.output_versions
    assert gen.routed_experts.shape == (len(prompt) + 15, 4, 2)
    batch = build_batch([gen], pad_id=0)
    after = batch.response_mask & (batch.versions == 1)
    worst, _ = _replay_mismatch(copy.deepcopy(new), batch, mask=after)
    assert worst <= 1e-4, worst


def test_bad_records_and_models_are_refused(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ArgumentError, match="model: no recognised MoE router"):
        TorchEngine(AutoModelForCausalLM.from_pretrained(tiny_hf_dir), record_routing=True)
    ok = torch.zeros(3, 2, 2, dtype=torch.uint8)
    Generation("g", [1, 2], [3, 4], [0.0, 0.0], [0, 0], routed_experts=ok)
    for bad in (ok.long(), ok[0], torch.zeros(5, 2, 2, dtype=torch.uint8), [[0, 1]]):
        with pytest.raises(ArgumentError, match="routed_experts"):
            Generation("g", [1, 2], [3, 4], [0.0, 0.0], [0, 0], routed_experts=bad)
