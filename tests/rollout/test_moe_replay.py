"""Routing replay (R3) on Hugging Face MoE models: records, recorder, replay, perturbation figures.

Every model here is tiny, random and built locally. References: the routers' own forward (bit for bit), float64
formulas of each gate-weight rule, finite differences (gradcheck), and the engine's own log-probs.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout.moe_replay import (
    RoutingRecorder,
    concat_routing,
    pad_routing,
    replay_routing,
    response_routing,
    route_flip_fraction,
    routing_dtype,
    routing_spec,
)

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from _moe_replay_models import VOCAB, response_logp, tiny_moe  # noqa: E402

# --------------------------------------------------------------------------------------------------------- records


def test_routing_dtype():
    assert routing_dtype(8) == torch.uint8
    assert routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.uint16
    assert routing_dtype(65536) == torch.uint16
    for bad in (0, 65537, 8.0, True):
        with pytest.raises(ArgumentError, match="num_experts"):
            routing_dtype(bad)


def _rec(rows):
    return torch.tensor(rows, dtype=torch.uint8).view(len(rows), 1, 2)


def test_concat_routing_first_record_wins_and_starts():
    a = _rec([[0, 1], [2, 3], [4, 5]])  # positions 0..2
    b = _rec([[7, 6], [7, 6], [7, 6], [1, 0], [3, 2]])  # a resumed call: positions 0..4, recomputed
    got = concat_routing([a, b])
    assert torch.equal(got, _rec([[0, 1], [2, 3], [4, 5], [1, 0], [3, 2]]))
    # vLLM's routed_experts_prompt_start: the second turn returns only its new positions 3..4
    got = concat_routing([a, b[3:]], starts=[0, 3])
    assert torch.equal(got, _rec([[0, 1], [2, 3], [4, 5], [1, 0], [3, 2]]))
    # a record entirely inside what is covered adds nothing; uint8 + uint16 -> uint16
    wide = b.to(torch.uint16)
    got = concat_routing([a, wide[:2]])
    assert got.dtype == torch.uint16 and torch.equal(got.to(torch.int32), a.to(torch.int32))
    assert concat_routing([a, wide]).dtype == torch.uint16


def test_concat_routing_errors():
    a = _rec([[0, 1], [2, 3]])
    with pytest.raises(ArgumentError, match="starts\\[1\\]"):
        concat_routing([a, a], starts=[0, 3])  # gap at position 2
    with pytest.raises(ArgumentError, match="starts"):
        concat_routing([a, a], starts=[0])
    with pytest.raises(ArgumentError, match="records\\[1\\]"):
        concat_routing([a, torch.zeros(2, 2, 2, dtype=torch.uint8)])
    with pytest.raises(ArgumentError, match="records\\[0\\]"):
        concat_routing([a.to(torch.int64)])
    with pytest.raises(ArgumentError, match="records"):
        concat_routing([])


def test_pad_routing_layout_and_dtype():
    r0 = _rec([[0, 1], [2, 3], [4, 5]])
    r2 = _rec([[6, 7]])
    got = pad_routing([r0, None, r2], seq_len=4)
    assert got.dtype == torch.int16 and got.shape == (3, 4, 1, 2)
    want = torch.full((3, 4, 1, 2), -1, dtype=torch.int16)
    want[0, :3] = r0.to(torch.int16)
    want[2, :1] = r2.to(torch.int16)
    assert torch.equal(got, want)
    wide = torch.tensor([[[300, 1]]], dtype=torch.int64).to(torch.uint16)
    got = pad_routing([r0, wide], seq_len=3)
    assert got.dtype == torch.int32 and int(got[1, 0, 0, 0]) == 300
    with pytest.raises(ArgumentError, match="seq_len"):
        pad_routing([r0], seq_len=2)
    with pytest.raises(ArgumentError, match="every row is None"):
        pad_routing([None], seq_len=2)
    with pytest.raises(ArgumentError, match="records\\[1\\]"):
        pad_routing([r0, torch.zeros(1, 2, 2, dtype=torch.uint8)], seq_len=4)


def test_response_routing_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    full = torch.randint(0, 8, (3, 7, 2, 2), generator=g).to(torch.int16)
    prompt_lens = torch.tensor([2, 4, 6])
    got = response_routing(full, prompt_lens, 4)
    for b in range(3):
        for t in range(4):
            p = int(prompt_lens[b]) + t
            want = full[b, p] if p < 7 else torch.full((2, 2), -1, dtype=torch.int16)
            assert torch.equal(got[b, t], want)
    with pytest.raises(ArgumentError, match="prompt_lens"):
        response_routing(full, torch.tensor([1, 2]), 4)
    with pytest.raises(ArgumentError, match="routed_experts"):
        response_routing(full.to(torch.uint8), prompt_lens, 4)


def test_route_flip_fraction():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]], [[-1, -1]]])
    b = torch.tensor([[[1, 0]], [[2, 4]], [[4, 5]], [[6, 7]]])  # same set, flipped, same, no record
    assert float(route_flip_fraction(a, b)) == pytest.approx(1 / 3)
    mask = torch.tensor([True, False, True, True])
    assert float(route_flip_fraction(a, b, mask)) == 0.0
    assert torch.isnan(route_flip_fraction(a[3:], b[3:]))
    with pytest.raises(ArgumentError, match="routed_b"):
        route_flip_fraction(a, b[:2])
    with pytest.raises(ArgumentError, match="mask"):
        route_flip_fraction(a, b, mask[:2])


# --------------------------------------------------------------------------------------------------------- routers

# class name -> (module, float64 reference of the gate weights over the forced experts)
ROUTERS = {
    "Qwen3MoeTopKRouter": "qwen3_moe",
    "Qwen2MoeTopKRouter": "qwen2_moe",
    "OlmoeTopKRouter": "olmoe",
    "Qwen3NextTopKRouter": "qwen3_next",
    "FlexOlmoTopKRouter": "flex_olmo",
    "Qwen3_5MoeTopKRouter": "qwen3_5_moe",
    "Qwen3VLMoeTextTopKRouter": "qwen3_vl_moe",
    "MixtralTopKRouter": "mixtral",
    "MiniMaxTopKRouter": "minimax",
    "GptOssTopKRouter": "gpt_oss",
    "DeepseekV3TopkRouter": "deepseek_v3",
    "Glm4MoeTopkRouter": "glm4_moe",
}


def _reference_weights(cls: str, router, logits: torch.Tensor, experts: torch.Tensor, norm: bool) -> torch.Tensor:
    """The gate weights over ``experts`` in float64, written from each model's definition."""
    z = logits.double()
    if cls == "GptOssTopKRouter":
        return torch.softmax(z.gather(1, experts), dim=-1)
    if cls in ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"):
        s = torch.sigmoid(z).gather(1, experts)
        if norm:
            s = s / s.sum(-1, keepdim=True)
        return s * router.routed_scaling_factor
    p = torch.softmax(z, dim=-1).gather(1, experts)
    return p / p.sum(-1, keepdim=True) if norm else p


def _make_router(cls: str, *, norm: bool = True, dtype=torch.float32):
    mod = importlib.import_module(f"transformers.models.{ROUTERS[cls]}.modeling_{ROUTERS[cls]}")
    cfg = SimpleNamespace(
        hidden_size=16, num_experts=8, num_local_experts=8, num_experts_per_tok=3, norm_topk_prob=norm,
        n_group=2, topk_group=2, routed_scaling_factor=2.5,
    )
    router = getattr(mod, cls)(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape))
    return router.to(dtype)


@pytest.mark.parametrize("cls", sorted(ROUTERS))
def test_each_router_rule(cls):
    norms = (True, False) if cls not in ("Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "MixtralTopKRouter",
                                           "MiniMaxTopKRouter", "GptOssTopKRouter") else (True,)
    for norm in norms:
        router = _make_router(cls, norm=norm)
        h = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
        _, own_w, own_idx = router(h)
        # 1) forcing the router's own choice gives its own gate weights bit for bit
        with replay_routing(router, own_idx.view(40, 1, 3)):
            logits, w, idx = router(h)
        assert torch.equal(idx, own_idx) and torch.equal(w, own_w) and w.dtype == own_w.dtype
        # 2) other experts: the model's rule over them, against float64
        forced = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:3] for i in range(40)])
        with replay_routing(router, forced.view(40, 1, 3)):
            logits, w, idx = router(h)
        assert torch.equal(idx, forced)
        want = _reference_weights(cls, router, logits, forced, norm)
        torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cls", sorted(ROUTERS))
def test_router_gradients_under_replay_match_a_float64_reference(cls):
    """d(sum(coef * gate_weights)) / d(router weight) with forced experts, against autograd through the float64
    formula (the routers compute their softmax/sigmoid in fp32 whatever the input dtype, so a finite-difference
    check would measure fp32 rounding)."""
    router = _make_router(cls)
    h = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    forced = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:3] for i in range(12)])
    coef = torch.randn(12, 3, generator=torch.Generator().manual_seed(3))
    with replay_routing(router, forced.view(12, 1, 3)):
        _, w, _ = router(h)
    (w.float() * coef).sum().backward()
    got = router.weight.grad

    weight = router.weight.detach().double().requires_grad_(True)
    bias = getattr(router, "bias", None)
    logits = torch.nn.functional.linear(h.double(), weight, None if bias is None else bias.detach().double())
    want_w = _reference_weights(cls, router, logits, forced, norm=True)
    (want_w * coef.double()).sum().backward()
    assert bool((got != 0).any())
    torch.testing.assert_close(got.double(), weight.grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_replaying_the_models_own_routing_is_bitwise_exact(kind):
    model = tiny_moe(kind)
    spec = routing_spec(model)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec:
        ref = model(ids).logits
    record = rec.take()
    assert record.dtype == torch.uint8 and record.shape == (33, spec.num_layers, spec.top_k)
    routed = record.view(3, 11, spec.num_layers, spec.top_k)
    with torch.no_grad(), replay_routing(model, routed):
        assert torch.equal(model(ids).logits, ref)
    # vLLM's layout (one entry per decoder layer; the dense layers' rows are ignored)
    if spec.num_decoder_layers != spec.num_layers:
        full = torch.randint(0, 8, (3, 11, spec.num_decoder_layers, spec.top_k), dtype=torch.int16)
        full[:, :, list(spec.decoder_layers)] = routed.to(torch.int16)
        with torch.no_grad(), replay_routing(model, full):
            assert torch.equal(model(ids).logits, ref)


def test_dense_layers_and_padding_rows():
    model = tiny_moe("qwen3", mlp_only_layers=[1])  # decoder layer 1 is dense
    spec = routing_spec(model)
    assert spec.num_layers == 3 and spec.decoder_layers == (0, 2, 3) and spec.num_decoder_layers == 4
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec:
        ref = model(ids).logits
    routed = rec.take().view(2, 9, 3, 2).to(torch.int16)
    routed[1, 5:] = -1  # no record: these tokens keep the live router's choice
    with torch.no_grad(), replay_routing(model, routed):
        assert torch.equal(model(ids).logits, ref)


def test_recorder_inside_replay_records_the_forced_experts_and_nesting_rules():
    model = tiny_moe("mixtral", layers=2)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    forced = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(12)])
    forced = forced.view(1, 6, 2, 2)
    rec = RoutingRecorder(model)
    with torch.no_grad(), rec, replay_routing(model, forced):  # recorder entered first, replay still wins
        model(ids)
    assert torch.equal(rec.take().view(1, 6, 2, 2).long(), forced)
    with rec, pytest.raises(ArgumentError, match="already active"):
        rec.__enter__()
    with replay_routing(model, forced), pytest.raises(ArgumentError, match="do not nest"):
        with replay_routing(model, forced):
            pass
    # hooks are gone after the blocks: no replay, no recording
    with torch.no_grad():
        model(ids)
    assert rec.take().shape[0] == 0


def test_gradients_reach_the_router_and_match_the_unreplayed_ones():
    model = tiny_moe("qwen3", layers=2).train()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    rec = RoutingRecorder(model)
    with rec:
        loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    own = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    model.zero_grad()
    routed = rec.take().view(2, 8, 2, 2)
    with replay_routing(model, routed):
        loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    for n, g in own.items():
        got = dict(model.named_parameters())[n].grad
        assert bool((got != 0).any()), n
        torch.testing.assert_close(got, g, atol=1e-6, rtol=1e-5)


def test_activation_checkpointing_replays_the_recomputed_forward():
    model = tiny_moe("qwen3", layers=2)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    forced = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(32)])
    forced = forced.view(2, 8, 2, 2)
    grads = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model).train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with replay_routing(m, forced):
            m(ids).logits.float().logsumexp(-1).mean().backward()
        grads.append(m.model.layers[0].mlp.gate.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_bad_input_names_the_argument(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    with pytest.raises(ArgumentError, match="model: no recognised MoE router"):
        RoutingRecorder(dense)
    with pytest.raises(ArgumentError, match="model"):
        routing_spec("not a model")
    granite = importlib.import_module("transformers.models.granitemoe.modeling_granitemoe")
    unsupported = granite.GraniteMoeTopKRouter(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2,
                                                               hidden_size=16))
    with pytest.raises(ArgumentError, match="unsupported MoE router"):
        routing_spec(torch.nn.Sequential(unsupported))

    model = tiny_moe("qwen3", layers=2)
    good = torch.zeros(1, 5, 2, 2, dtype=torch.int64)
    good[..., 1] = 1
    cases = [
        (good[..., :1], "top_k=2"),
        (torch.zeros(1, 5, 3, 2, dtype=torch.int64), "expected 2 layers"),
        (good.float(), "integer dtype"),
        (good[0, 0], "expected \\[B, L, layers, top_k\\]"),
        (good + 7, "< num_experts=8"),
        (good + 2**32, "< num_experts=8"),
        (good - 2, "other than -1"),
        (torch.where(torch.arange(2) == 0, -1, good), "mixes -1"),
        (torch.zeros(1, 5, 2, 2, dtype=torch.int64), "same expert twice"),
        ([[0, 1]], "expected a tensor"),
    ]
    for bad, match in cases:
        with pytest.raises(ArgumentError, match=f"routed_experts: .*{match}"), replay_routing(model, bad):
            pass
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(ArgumentError, match="routes 6 tokens"), replay_routing(model, good), torch.no_grad():
        model(ids)


# ------------------------------------------------------------------------------------- engine, perturbation figures


def _engine_rollouts(model, prompts, *, max_new_tokens: int, temperature: float = 1.0):
    """Generate one prompt at a time on a TorchEngine over ``model`` with a RoutingRecorder around the engine's
    forwards (one request in flight, so the recorder's rows are that request's positions in order)."""
    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines import TorchEngine

    engine = TorchEngine(model)
    recorder = RoutingRecorder(model)
    gens, records = [], []

    async def run():
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=i)
            with recorder:
                gens.append(await engine.generate(GenerationRequest(f"r{i}", prompt, sp)))
            records.append(recorder.take())

    asyncio.run(run())
    return gens, records


def _prompts(n: int, length: int = 6):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def _mismatch(trainer, batch, routed, replay: bool):
    spec = routing_spec(trainer)
    rec = RoutingRecorder(trainer)
    ctx = replay_routing(trainer, routed) if replay else contextlib.nullcontext()
    with torch.no_grad(), ctx, rec:
        lp = response_logp(trainer, batch.input_ids, batch.prompt_lens, batch.response_mask, batch.attention_mask)
    used = rec.take().view(*batch.input_ids.shape, spec.num_layers, spec.top_k)
    d = (lp - batch.rollout_logp).abs()[batch.response_mask]
    flips = route_flip_fraction(routed, used, batch.attention_mask)
    return float(d.max()), float(d.mean()), float(flips)


def test_engine_records_every_fed_position_and_replay_matches_its_logprobs():
    from rlblocks.rollout import build_batch

    model = tiny_moe("qwen3")
    gens, records = _engine_rollouts(model, _prompts(3), max_new_tokens=10)
    for g, r in zip(gens, records):
        assert r.shape == (len(g.prompt_ids) + len(g.output_ids) - 1, 4, 2)
    batch = build_batch(gens, pad_id=0)
    routed = pad_routing(records, seq_len=batch.input_ids.shape[1])
    no_replay = _mismatch(model, batch, routed, replay=False)
    replay = _mismatch(model, batch, routed, replay=True)
    # Same fp32 weights: only the KV-cache decode vs full-forward rounding differs, so with replay the trainer
    # matches the engine to rounding; without it, it does too unless that rounding flipped a route.
    assert replay[2] == 0.0 and replay[0] <= 1e-4, replay
    assert no_replay[0] <= 1e-4 or no_replay[2] > 0, no_replay


def test_multi_turn_records_merge_and_replay():
    """Turn 2's prompt is turn 1's prompt + output + new tokens; the merged record replays both turns."""
    from rlblocks.rollout import Generation, GenerationRequest, SamplingParams, build_batch
    from rlblocks.rollout.engines import TorchEngine

    model = tiny_moe("mixtral")
    engine = TorchEngine(model)
    recorder = RoutingRecorder(model)

    async def turn(rid, prompt):
        with recorder:
            g = await engine.generate(GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=6, seed=3)))
        return g, recorder.take()

    p1 = _prompts(1)[0]
    g1, r1 = asyncio.run(turn("t1", p1))
    p2 = p1 + g1.output_ids + [5, 6, 7]  # the environment's tokens
    g2, r2 = asyncio.run(turn("t2", p2))
    assert r1.shape[0] == len(p1) + 5 and r2.shape[0] == len(p2) + 5
    merged = concat_routing([r1, r2])
    assert torch.equal(merged[: len(r1)], r1) and torch.equal(merged[len(r1):], r2[len(r1):])
    # One trajectory row: both turns' model tokens, each scored against its engine's log-prob.
    traj = Generation("traj", p1, [*g1.output_ids, 5, 6, 7, *g2.output_ids],
                      g1.output_logprobs + [0.0] * 3 + g2.output_logprobs, [0] * (len(g1.output_ids) + 9))
    batch = build_batch([traj], pad_id=0)
    model_tokens = torch.ones_like(batch.response_mask)
    model_tokens[0, 6:9] = False
    batch.response_mask = batch.response_mask & model_tokens
    routed = pad_routing([merged], seq_len=batch.input_ids.shape[1])
    assert routed.shape[1] == merged.shape[0] + 1  # the last token is never fed
    mx, _, flips = _mismatch(model, batch, routed, replay=True)
    assert flips == 0.0 and mx <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_replay_brings_trainer_logprobs_back_to_the_engine(kind, capsys):
    """Perturbations that flip routes, the mismatch |trainer - engine| with and without replay (figures printed):

    (a) bf16 engine (TorchEngine over the bf16 model) vs fp32 trainer over the same, bf16-rounded, weights;
    (b) an fp32 engine vs a trainer whose weights moved by a small update (N(0, 1e-3 * mean |w|) per tensor).
    """
    from rlblocks.rollout import build_batch

    # near-tied routers (std 0.1), experts that differ (x3), an unsharpened head (bf16 logit rounding stays small)
    base = tiny_moe(kind, gate_std=0.1, expert_scale=3.0, sharpen=1.0)
    prompts = _prompts(8)
    figures = {}
    for case in ("bf16_vs_fp32", "weight_update"):
        if case == "bf16_vs_fp32":
            engine_model = copy.deepcopy(base).to(torch.bfloat16)
            trainer = copy.deepcopy(engine_model).float()
        else:
            engine_model, trainer = base, copy.deepcopy(base)
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.abs().mean())
        gens, records = _engine_rollouts(engine_model, prompts, max_new_tokens=24)
        batch = build_batch(gens, pad_id=0)
        routed = pad_routing(records, seq_len=batch.input_ids.shape[1])
        without = _mismatch(trainer, batch, routed, replay=False)
        with_ = _mismatch(trainer, batch, routed, replay=True)
        figures[case] = (without, with_)
        assert without[2] > 0.002, f"{case}: the perturbation flipped no route {without}"
        assert with_[2] == 0.0, f"{case}: replay left flipped routes {with_}"
        assert with_[0] < without[0] / 4 and with_[1] < without[1] / 2, f"{case}: {without} -> {with_}"
    with capsys.disabled():
        for case, (w, r) in figures.items():
            print(f"\n[R3 {kind} {case}] without replay: max|dlogp| {w[0]:.4f} mean {w[1]:.5f} flipped routes "
                  f"{w[2]:.2%}; with replay: max {r[0]:.4f} mean {r[1]:.5f} flipped {r[2]:.2%}")
