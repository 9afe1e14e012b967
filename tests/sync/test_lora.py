"""LoRA sync: merge_lora against peft's own merge_and_unload (independent reference), and LoraSyncer end to end
over a sync group (base once, adapters afterwards)."""

from __future__ import annotations

import copy

import pytest
import torch

from rlblocks.errors import ArgumentError, WeightUpdateError
from rlblocks.sync import LoraSyncer, WeightReceiver, WeightSender, lora_state, merge_lora
from rlblocks.sync.lora import base_state, split_lora_message

from ._launch import run_ranks


def _peft_model(seed=0, **lora_kw):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
    )
    kw = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens"]}
    kw.update(lora_kw)
    return peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(init_lora_weights=False, **kw))


def _peft_merged(pm) -> dict[str, torch.Tensor]:
    return copy.deepcopy(pm).merge_and_unload().state_dict()


@pytest.mark.parametrize(
    "lora_kw",
    [
        {},
        {"use_rslora": True, "r": 8, "lora_alpha": 4},
        {"alpha_pattern": {"v_proj": 32}, "rank_pattern": {"q_proj": 2}},
    ],
)
def test_merge_lora_matches_peft_merge_and_unload(lora_kw):
    pm = _peft_model(**lora_kw)
    ref = _peft_merged(pm)
    base = dict(base_state(pm))
    ours = dict(merge_lora(base.items(), lora_state(pm)))
    assert ours.keys() == ref.keys()
    changed = 0
    for name, t in ref.items():
        torch.testing.assert_close(ours[name], t, atol=1e-6, rtol=0, msg=name)
        changed += not torch.equal(ours[name], base[name])
    assert changed == 2 * 3 + 1  # q, v, down in each of 2 layers, plus the embedding


def test_lora_state_holds_adapters_only():
    pm = _peft_model()
    st = lora_state(pm)
    assert st["config"]["r"] == 4 and st["config"]["lora_alpha"] == 8
    assert all(".lora_" in k and k.startswith("base_model.model.") for k in st["tensors"])
    assert len(st["tensors"]) == 2 * (2 * 3 + 1)


def test_merge_lora_refuses_incomplete_or_unmatched():
    pm = _peft_model()
    st = lora_state(pm)
    base = dict(base_state(pm))
    no_b = {**st, "tensors": {k: v for k, v in st["tensors"].items() if "q_proj.lora_B" not in k}}
    with pytest.raises(ValueError, match="expected an A and a B"):
        list(merge_lora(base, no_b))
    short = {k: v for k, v in base.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(ValueError, match=r"no '<module>\.weight' for LoRA module"):
        list(merge_lora(short, st))


def test_lora_syncer_sends_base_once_then_adapters():
    pm = _peft_model(seed=1)
    steps = 3
    merged_refs = []

    def trainer(g):
        syncer = LoraSyncer(WeightSender(g, bucket_bytes=16 << 10).send, keep=2)
        kinds = []
        for v in range(1, steps + 1):
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if "lora_" in n:
                        p.add_(0.1 * torch.randn_like(p))
            merged_refs.append(_peft_merged(pm))
            kinds.append(syncer.sync(pm, version=v))
        return kinds, syncer.sent_bytes, list(syncer.live_versions)

    def rollout(g):
        recv = WeightReceiver(g)
        base, out = None, []
        for _ in range(steps):
            version, it = recv.receive()
            b, st, info = split_lora_message(it)
            if info["kind"] == "base+adapter":
                base = b
            out.append((version, info, dict(merge_lora(base, st))))
        return out

    (kinds, sent, live), got = run_ranks([trainer, rollout], timeout=30.0)
    assert kinds == ["base+adapter", "adapter", "adapter"]
    assert sent[1] < 0.2 * sent[0] and sent[1] == sent[2]
    assert live == [2, 3]
    for (version, info, merged), ref in zip(got, merged_refs):
        assert info["version"] == version and info["base_version"] == 1
        assert merged.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(merged[n], ref[n], atol=1e-6, rtol=0, msg=n)


def _train_step(pm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def test_lora_syncer_into_a_torch_engine_update_weights():
    """LoraSyncer(engine.update_weights): merged HF weights, awaited; the engine holds exactly our merge, which
    matches peft's own merge_and_unload, and the engine's version follows."""
    import asyncio

    from transformers import LlamaForCausalLM

    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines import TorchEngine

    pm = _peft_model(seed=2)
    engine_model = LlamaForCausalLM(pm.get_base_model().config)  # other random weights, same layout
    engine = TorchEngine(engine_model)
    syncer = LoraSyncer(engine.update_weights, keep=2)
    assert syncer.merge and syncer.is_async

    async def run():
        out = []
        for v in (1, 2):
            _train_step(pm, v)
            kind = await syncer.async_sync(pm, version=v)
            ours = dict(merge_lora(base_state(pm), lora_state(pm)))
            held = {n: t.clone() for n, t in engine.model.state_dict().items()}
            exact = all(torch.equal(held[n], t) for n, t in ours.items())
            req = GenerationRequest(f"r{v}", [1, 5, 7], SamplingParams(temperature=0.0, max_new_tokens=3))
            gen = await engine.generate(req)
            out.append((kind, engine.version, exact, _peft_merged(pm), held, gen.output_versions))
        with pytest.raises(ArgumentError, match="async_sync"):
            syncer.sync(pm, version=3)  # an async send cannot run from sync(): refused, nothing sent
        return out

    got = asyncio.run(run())
    assert [k for k, *_ in got] == ["base+adapter", "adapter"]
    for v, (_, version, exact, ref, held, versions) in enumerate(got, start=1):
        assert version == v and exact and versions == [v] * 3
        for n, t in ref.items():
            torch.testing.assert_close(held[n], t, atol=1e-6, rtol=0, msg=n)
    assert engine.version == 2 and list(syncer.live_versions) == [1, 2]


def test_merged_updates_after_the_first_are_partial_when_send_accepts_it():
    pm = _peft_model(seed=3)
    calls = []

    async def update_weights(named_tensors, *, version, partial=False):
        calls.append(([n for n, _ in named_tensors], version, partial))

    import asyncio

    syncer = LoraSyncer(update_weights)
    for v in (1, 2):
        _train_step(pm, v)
        asyncio.run(syncer.async_sync(pm, version=v))
    base_names = [n for n, _ in base_state(pm)]
    (first, v1, p1), (second, v2, p2) = calls
    assert first == base_names and (v1, p1) == (1, False)
    targets = ("q_proj", "v_proj", "down_proj", "embed_tokens")
    assert second == [n for n in base_names if any(t in n for t in targets)] and (v2, p2) == (2, True)
    assert syncer.sent_bytes[1] < syncer.sent_bytes[0]


def test_lora_syncer_takes_version_by_keyword_only():
    pm = _peft_model(seed=4)
    got = []
    with pytest.raises(ArgumentError, match=r"^send: expected a callable taking `version` by keyword"):
        LoraSyncer(lambda named, v: got.append(v))  # a send taking the version positionally
    syncer = LoraSyncer(lambda named, *, version: got.append(version))
    with pytest.raises(TypeError):
        syncer.sync(pm, 5)
    assert syncer.sync(pm, version=5) == "base+adapter"
    assert got == [5]
    with pytest.raises(ValueError, match="expected > 5"):
        syncer.sync(pm, version=5)


def test_split_lora_message_refuses_a_bad_config_tensor():
    from rlblocks.sync.lora import CONFIG_TENSOR

    bad = torch.tensor(list(b'{"kind": "adapter"'), dtype=torch.uint8)
    # a refused weight update on a receiver: WeightUpdateError, as from every engine, handoff and delta receiver
    with pytest.raises(WeightUpdateError, match="not a LoraSyncer config"):
        split_lora_message([(CONFIG_TENSOR, bad)])
    with pytest.raises(WeightUpdateError, match="not a LoraSyncer message"):
        split_lora_message([("w", torch.ones(2))])
