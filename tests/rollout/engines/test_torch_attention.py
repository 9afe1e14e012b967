"""TorchEngine's grouped-query SDPA against HF's own ``sdpa`` attention (which repeats the KV heads): the same
logits and gradients on left-padded rows, and the same generations and log-probs from the engine."""

import asyncio
import copy

import pytest
import torch

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.engines.torch_attention import NAME, use_gqa_sdpa

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    from tests.conftest import build_tiny_hf_dir

    path = build_tiny_hf_dir(tmp_path_factory.mktemp("tiny_gqa"))  # 2 query heads on 1 KV head
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa" and model.model.layers[0].self_attn.num_key_value_groups == 2
    return path, model


def test_same_logits_and_gradients_as_hf_sdpa_on_left_padded_rows(gqa_model):
    _, model = gqa_model
    ours = copy.deepcopy(model)
    assert use_gqa_sdpa(ours) and ours.config._attn_implementation == NAME
    assert not use_gqa_sdpa(ours)  # already switched: left as it is
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 60, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding, so both paths take a mask
    mask[2, :1] = 0
    want, got = model(input_ids=ids, attention_mask=mask).logits, ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    c = torch.randn(want.shape, generator=g)
    (want[real] * c[real]).sum().backward()
    (got[real] * c[real]).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_engine_from_pretrained_generates_what_hf_sdpa_does(gqa_model, monkeypatch):
    path, _ = gqa_model
    ours = TorchEngine.from_pretrained(path, device="cpu")
    assert ours.model.config._attn_implementation == NAME
    monkeypatch.setattr("rlblocks.rollout.engines.torch_attention.use_gqa_sdpa", lambda model: False)
    theirs = TorchEngine.from_pretrained(path, device="cpu")
    assert theirs.model.config._attn_implementation == "sdpa"
    prompts = [[1, 5, 6, 7], [1, 30, 31], [1, 9, 9, 9, 9, 12, 13, 14, 15], [1, 40]]  # one decode batch, left-padded

    async def run(engine):
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
        return await asyncio.gather(*[engine.generate(GenerationRequest(f"r{i}", p, sp))
                                      for i, p in enumerate(prompts)])

    for a, b in zip(asyncio.run(run(ours)), asyncio.run(run(theirs))):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5,
                                   rtol=0)
    ours.close()
    theirs.close()
