"""TorchEngine against the engine contract: the weight-update rule, the KV-cache argument of new transformers,
the protocol members (is_paused, num_in_flight, stats, close) and the sleep levels."""

import asyncio
import copy
import math

import pytest
import torch

from rlblocks.errors import ArgumentError, EngineError, WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.types import RolloutEngine

PROMPT = [1, 5, 6, 7]


def run(coro, timeout=60.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def perturbed(model, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def snapshot(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_unchanged(model, before):
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


async def wait_tokens(engine, rid, k):
    while (engine.num_output_tokens(rid) or 0) < k:
        await asyncio.sleep(0.0005)


async def settle(engine, turns=5):
    """Let the engine act on what was just submitted, without a wall-clock wait: a few event-loop turns carry a new
    request into the engine and let its loop task see it (a step it wrongly started would be running by then), and
    ``abort([])`` (a no-op: no request named) takes the engine lock between steps, i.e. waits for such a step to end
    and record its token. A request that must wait then has no token and is not done, however busy the machine."""
    for _ in range(turns):
        await asyncio.sleep(0)
    await engine.abort([])


# ---------------------------------------------------------------- the weight-update rule
def test_nan_weights_are_refused_and_nothing_changes(tiny_model):
    engine = TorchEngine(tiny_model, version=2)
    before = snapshot(tiny_model)
    new = perturbed(tiny_model)
    new["model.layers.1.mlp.down_proj.weight"][3, 5] = math.nan
    with pytest.raises(WeightUpdateError, match=r"down_proj.weight.*1 of \d+ values are not finite"):
        run(engine.update_weights(new.items(), version=3))
    new["model.layers.1.mlp.down_proj.weight"][3, 5] = math.inf
    with pytest.raises(WeightUpdateError, match="not finite"):
        run(engine.update_weights(new.items(), version=3))
    assert engine.version == 2 and not engine.is_paused
    assert_unchanged(tiny_model, before)


def test_partial_update_needs_partial_true(tiny_model, make_tiny_model):
    engine = TorchEngine(tiny_model, version=0)
    before = snapshot(tiny_model)
    new = perturbed(tiny_model)
    one = [("lm_head.weight", new["lm_head.weight"])]
    with pytest.raises(WeightUpdateError, match=r"partial update covers 1 of the model's 21 weights.*partial=True"):
        run(engine.update_weights(one, version=1))
    assert engine.version == 0
    assert_unchanged(tiny_model, before)
    run(engine.update_weights(one, version=1, partial=True))
    assert engine.version == 1
    assert torch.equal(tiny_model.lm_head.weight, new["lm_head.weight"])
    # the rest kept the old weights: the engine now matches a reference with the same partial load
    reference = make_tiny_model()
    reference.lm_head.weight.data.copy_(new["lm_head.weight"])
    for n, t in reference.state_dict().items():
        assert torch.equal(t, tiny_model.state_dict()[n]), n


def test_empty_update_does_not_move_the_version(tiny_model):
    engine = TorchEngine(tiny_model, version=4)
    with pytest.raises(WeightUpdateError, match="empty"):
        run(engine.update_weights([], version=5))
    with pytest.raises(WeightUpdateError, match="empty"):
        run(engine.update_weights(iter(()), version=5, partial=True))
    assert engine.version == 4


def test_versions_only_move_forward_unless_allow_rollback(tiny_model):
    engine = TorchEngine(tiny_model, version=5)
    before = snapshot(tiny_model)
    new = perturbed(tiny_model)
    with pytest.raises(WeightUpdateError, match=r"version 3 is older than the engine's version 5.*allow_rollback"):
        run(engine.update_weights(new.items(), version=3))
    assert engine.version == 5
    assert_unchanged(tiny_model, before)
    # equal: a re-load of the current version (e.g. the first push of a run) is accepted
    run(engine.update_weights(new.items(), version=5))
    assert engine.version == 5 and torch.equal(tiny_model.lm_head.weight, new["lm_head.weight"])
    run(engine.update_weights(before.items(), version=2, allow_rollback=True))
    assert engine.version == 2
    assert_unchanged(tiny_model, before)
    with pytest.raises(ArgumentError, match="version"):
        run(engine.update_weights(before.items(), version=True))
    with pytest.raises(ArgumentError, match="partial"):
        run(engine.update_weights(before.items(), version=6, partial="yes"))


def tied_model(tiny_hf_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_hf_dir)
    cfg.tie_word_embeddings = True
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_tied_embeddings_accept_state_dict_names(tiny_hf_dir):
    model = tied_model(tiny_hf_dir)
    engine = TorchEngine(model)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.1)
    state = trained.state_dict()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state  # two names, one tensor
    run(engine.update_weights(state.items(), version=1))  # every state_dict() name: a valid complete update
    assert engine.version == 1 and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, trained.lm_head.weight)
    # either alias alone covers the tied tensor
    emb = trained.lm_head.weight.detach() * 2
    rest = [(n, t) for n, t in state.items() if n not in ("lm_head.weight", "model.embed_tokens.weight")]
    run(engine.update_weights([*rest, ("lm_head.weight", emb)], version=2))
    assert torch.equal(model.model.embed_tokens.weight, emb)
    # two aliases with different values: refused, nothing loaded
    before = snapshot(model)
    bad = [*rest, ("lm_head.weight", emb), ("model.embed_tokens.weight", emb + 1)]
    with pytest.raises(WeightUpdateError, match="one tied tensor"):
        run(engine.update_weights(bad, version=3))
    assert engine.version == 2
    assert_unchanged(model, before)


def test_bad_pairs_dtypes_and_duplicates_are_weight_update_errors(tiny_model):
    engine = TorchEngine(tiny_model)
    w = tiny_model.lm_head.weight.detach()
    cases = [
        ([("lm_head.weight",)], r"named_tensors\[0\]: expected a \(name, torch.Tensor\) pair"),
        ([("lm_head.weight", w.to(torch.int64))], "expected a floating-point dtype"),
        ([("lm_head.weight", w), ("lm_head.weight", w)], "more than once"),
        ([("nope", w)], "no weight of this name"),
    ]
    for items, match in cases:
        with pytest.raises(WeightUpdateError, match=match) as info:
            run(engine.update_weights(items, version=1, partial=True))
        assert str(info.value).startswith("TorchEngine.update_weights refused: ")
        assert str(info.value).endswith("nothing was loaded (weights and version unchanged)")
    run(engine.update_weights([("lm_head.weight", w.to(torch.bfloat16))], version=1, partial=True))  # cast on load
    assert engine.version == 1


# ---------------------------------------------------------------- the KV-cache argument of transformers >= 5.24
class CacheArgModel(torch.nn.Module):
    """A causal LM whose forward has the signature of transformers >= 5.24: the KV cache is ``cache=`` and
    ``past_key_values=`` is deprecated (transformers' ``@deprecate_kwarg("past_key_values", "5.40.0",
    new_name="cache")`` warns with a FutureWarning, and 5.40 removes it). Counts the deprecated calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.deprecated_calls = 0

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        if "past_key_values" in kwargs:
            self.deprecated_calls += 1
            cache = kwargs.pop("past_key_values")
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        return type("Out", (), {"logits": out.logits, "cache": out.past_key_values})()


def test_engine_passes_the_cache_argument_the_model_takes(tiny_model, make_tiny_model):
    ref = run(TorchEngine(make_tiny_model()).generate(GenerationRequest("a", PROMPT, greedy(10))))
    wrapped = CacheArgModel(tiny_model)
    engine = TorchEngine(wrapped)

    async def main():
        lone = await engine.generate(GenerationRequest("a", PROMPT, greedy(10)))
        many = await asyncio.gather(*[engine.generate(GenerationRequest(f"b{i}", PROMPT, greedy(10))) for i in "xyz"])
        return lone, many

    lone, many = run(main())
    assert wrapped.deprecated_calls == 0
    assert lone.output_ids == ref.output_ids and lone.output_logprobs == ref.output_logprobs
    assert all(g.output_ids == ref.output_ids for g in many)


# ---------------------------------------------------------------- protocol members
def test_protocol_members(tiny_model):
    engine = TorchEngine(tiny_model)
    assert isinstance(engine, RolloutEngine)
    assert engine.is_paused is False and engine.num_in_flight == 0

    async def main():
        t = asyncio.ensure_future(engine.generate(GenerationRequest("a", PROMPT, greedy(30))))
        await wait_tokens(engine, "a", 2)
        await engine.pause("keep")
        paused, n = engine.is_paused, engine.num_in_flight
        await engine.resume()
        await t
        return paused, n

    paused, n = run(main())
    assert paused is True and type(n) is int and n == 1 and engine.num_in_flight == 0
    stats = engine.stats()
    assert isinstance(stats, dict) and stats["decode_tokens"] > 0 and stats["steps"] >= 30
    stats["decode_tokens"] = -1  # a copy: the engine's counters are not changed through it
    assert engine.stats()["decode_tokens"] > 0


def test_close_returns_partials_then_refuses_every_call(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(GenerationRequest(f"c{i}", PROMPT, greedy(200)))) for i in "012"]
        await engine.pause("keep")
        frozen = asyncio.ensure_future(engine.generate(GenerationRequest("waiting", PROMPT, greedy(5))))
        await engine.resume()
        await wait_tokens(engine, "c0", 3)
        engine.close()
        engine.close()  # idempotent
        gens = await asyncio.gather(*tasks, frozen)
        errors = []
        for call in (
            engine.generate(GenerationRequest("late", PROMPT, greedy(3))),
            engine.abort(),
            engine.pause(),
            engine.resume(),
            engine.update_weights([("lm_head.weight", tiny_model.lm_head.weight.detach())], version=1, partial=True),
            engine.sleep(),
            engine.wake(),
        ):
            with pytest.raises(EngineError, match="closed") as info:
                await call
            errors.append(info.value)
        await engine.aclose()  # still idempotent
        return gens, errors

    gens, errors = run(main())
    assert all(g.finish_reason == "abort" for g in gens)
    assert all(len(g.output_ids) == len(g.output_logprobs) == len(g.output_versions) for g in gens)
    assert gens[0].num_output_tokens >= 3 and gens[0].num_output_tokens < 200
    assert len(errors) == 7 and engine.num_in_flight == 0


def test_aclose_waits_for_the_step_and_close_after_the_loop_ended(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        t = asyncio.ensure_future(engine.generate(GenerationRequest("a", PROMPT, greedy(100))))
        await wait_tokens(engine, "a", 2)
        await engine.aclose()
        return await t

    g = run(main())
    assert g.finish_reason == "abort" and 2 <= g.num_output_tokens < 100
    other = TorchEngine(copy.deepcopy(tiny_model))
    run(other.generate(GenerationRequest("x", PROMPT, greedy(2))))
    other.close()  # the loop of asyncio.run is closed now: nothing to resolve, no error
    with pytest.raises(EngineError):
        run(other.generate(GenerationRequest("x", PROMPT, greedy(2))))


def test_forward_failure_is_an_engine_error(tiny_model):
    engine = TorchEngine(tiny_model)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine._forward = broken
    with pytest.raises(EngineError, match=r"forward step failed.*device lost") as info:
        run(engine.generate(GenerationRequest("e", PROMPT, greedy(3))))
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------- sleep levels
def test_sleep_level_1_aborts_in_flight_keeps_weights_and_version(tiny_model):
    engine = TorchEngine(tiny_model, version=3)
    before = snapshot(tiny_model)

    async def main():
        ref = await engine.generate(GenerationRequest("ref", PROMPT, greedy(12)))
        running = asyncio.ensure_future(engine.generate(GenerationRequest("r", PROMPT, greedy(100))))
        await wait_tokens(engine, "r", 2)
        await engine.sleep()
        part = await running  # returned at sleep, partial output kept
        assert engine.is_paused and engine.stats()["steps"] > 0
        waiting = asyncio.ensure_future(engine.generate(GenerationRequest("w", PROMPT, greedy(12))))
        await settle(engine)
        assert not waiting.done() and engine.num_output_tokens("w") == 0  # asleep: new requests wait
        with pytest.raises(EngineError, match="asleep"):
            await engine.resume()
        with pytest.raises(EngineError, match="asleep"):
            await engine.update_weights(before.items(), version=4)
        await engine.sleep(1)  # same level: no-op
        with pytest.raises(EngineError, match="already asleep at level 1"):
            await engine.sleep(2)
        await engine.wake()
        after = await waiting
        await engine.wake()  # awake: no-op
        return ref, part, after

    ref, part, after = run(main())
    assert part.finish_reason == "abort" and 2 <= part.num_output_tokens < 100
    assert after.output_ids == ref.output_ids and after.output_versions == [3] * 12
    assert engine.version == 3 and not engine.is_paused
    assert_unchanged(tiny_model, before)
    with pytest.raises(ArgumentError, match="level"):
        run(engine.sleep(3))


def test_sleep_level_2_discards_weights_until_a_complete_update(tiny_model, make_tiny_model):
    engine = TorchEngine(tiny_model, version=1)
    new = perturbed(tiny_model, seed=4)
    reference = make_tiny_model()
    reference.load_state_dict(new, strict=False)
    ref_new = run(TorchEngine(reference, version=2).generate(GenerationRequest("ref", PROMPT, greedy(12))))

    async def main():
        frozen = asyncio.ensure_future(engine.generate(GenerationRequest("k", PROMPT, greedy(100))))
        await wait_tokens(engine, "k", 2)
        await engine.pause("keep")  # a frozen request must not survive a level-2 sleep
        await engine.sleep(level=2)
        part = await frozen
        assert all(p.numel() == 0 for p in tiny_model.parameters())  # storage freed
        await engine.wake()
        assert all(bool(torch.isnan(p).all()) for p in tiny_model.parameters())  # re-allocated, poisoned
        assert engine.is_paused
        waiting = asyncio.ensure_future(engine.generate(GenerationRequest("w", PROMPT, greedy(12))))
        await settle(engine)
        assert not waiting.done() and engine.num_output_tokens("w") == 0
        with pytest.raises(EngineError, match="discarded the weights"):
            await engine.resume()
        with pytest.raises(WeightUpdateError, match="must be complete"):
            await engine.update_weights([("lm_head.weight", new["lm_head.weight"])], version=2, partial=True)
        await engine.update_weights(new.items(), version=2)
        assert engine.is_paused  # the caller's own pause(keep) from before the sleep still holds
        await engine.resume()
        after = await waiting
        # without a pause of the caller, the complete update is what lets generation go on
        await engine.sleep(2)
        await engine.wake()
        again = asyncio.ensure_future(engine.generate(GenerationRequest("w2", PROMPT, greedy(12))))
        await settle(engine)
        assert not again.done() and engine.num_output_tokens("w2") == 0
        await engine.update_weights(new.items(), version=3)
        return part, after, await again

    part, after, again = run(main())
    assert part.finish_reason == "abort" and 2 <= part.num_output_tokens < 100
    assert set(part.output_versions) == {1}
    assert after.output_versions == [2] * 12 and after.output_ids == ref_new.output_ids
    assert after.output_logprobs == ref_new.output_logprobs
    assert again.output_versions == [3] * 12 and again.output_ids == ref_new.output_ids
    assert engine.version == 3 and not engine.is_paused


def test_sleep_keeps_a_pause_of_the_caller(tiny_model):
    engine = TorchEngine(tiny_model)

    async def main():
        await engine.pause("keep")
        await engine.sleep()
        await engine.wake()
        still = engine.is_paused
        t = asyncio.ensure_future(engine.generate(GenerationRequest("p", PROMPT, greedy(4))))
        await settle(engine)
        waited = not t.done() and engine.num_output_tokens("p") == 0
        await engine.resume()
        return still, waited, await t

    still, waited, g = run(main())
    assert still and waited and g.num_output_tokens == 4


def misplaced(model, byte_offset=8):
    """Move every parameter into storage whose first element is ``byte_offset`` bytes past a 64-byte boundary and
    give ``lm_head.weight`` column-major strides: a layout other than the one a fresh allocation would get."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape, n = p.shape, p.numel()
            buf = torch.empty(n + 32)
            shift = ((byte_offset - buf.data_ptr()) % 64) // 4
            if name == "lm_head.weight":
                p.data = buf[shift : shift + n].view(shape[1], shape[0]).t().copy_(p)
            else:
                p.data = buf[shift : shift + n].view(shape).copy_(p)
    return model


def test_sleep_level_2_reallocates_each_parameter_with_its_layout(tiny_model):
    model = misplaced(tiny_model)
    layout = {n: (p.shape, p.stride(), p.dtype, p.data_ptr() % 64) for n, p in model.named_parameters()}
    assert layout["lm_head.weight"][1] == (1, 64) and {a for *_, a in layout.values()} == {8}
    weights = snapshot(model)
    engine = TorchEngine(model)

    async def main():
        before = await engine.generate(GenerationRequest("a", PROMPT, greedy(12)))
        await engine.sleep(2)
        await engine.wake()
        woke = {n: (p.shape, p.stride(), p.dtype, p.data_ptr() % 64) for n, p in model.named_parameters()}
        await engine.update_weights(weights.items(), version=1)
        return before, woke, await engine.generate(GenerationRequest("b", PROMPT, greedy(12)))

    before, woke, after = run(main())
    assert woke == layout
    assert after.output_ids == before.output_ids and after.output_logprobs == before.output_logprobs


SSE42_SCRIPT = """
import asyncio, json, sys
import torch
from transformers import AutoModelForCausalLM
from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) for n, t in weights.items()}
fresh = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
fresh.load_state_dict(perturbed)
engine = TorchEngine(model)
req = lambda rid: GenerationRequest(rid, [1, 5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=12))

async def main():
    out = {"before": (await engine.generate(req("a"))).output_logprobs}
    await engine.sleep(2)
    await engine.wake()
    await engine.update_weights(weights.items(), version=1)
    out["same"] = (await engine.generate(req("b"))).output_logprobs
    await engine.sleep(2)
    await engine.wake()
    await engine.update_weights(perturbed.items(), version=2)
    out["perturbed"] = (await engine.generate(req("c"))).output_logprobs
    out["fresh"] = (await TorchEngine(fresh).generate(req("d"))).output_logprobs
    print(json.dumps(out))

asyncio.run(main())
"""


def test_sleep_level_2_is_bit_exact_on_alignment_sensitive_kernels(tiny_hf_dir):
    """MKL's SSE4.2 kernels (what MKL runs on x86 CPUs without AVX2) give a one-row GEMM other last bits for a
    weight that is not 16-byte aligned: a level-2 sleep must give each parameter back the address alignment it was
    loaded with, or the logits after sleep/wake/update leave those of an engine that never slept."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SSE42_SCRIPT, tiny_hf_dir], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] == out["before"]
    assert out["perturbed"] == out["fresh"] and out["perturbed"] != out["before"]
