"""TorchEngine's sliced LM head against ``F.linear`` (bit for bit), its switch on a model (parameters, state dict and
tied embeddings untouched) and an engine with it against one without."""

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine, torch_head
from rlblocks.rollout.engines.torch_head import sliced_head_forward, use_sliced_head

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (3,), (64,), (2, 5)])
def test_bit_identical_to_one_linear(monkeypatch, bias, lead):
    monkeypatch.setattr(torch_head, "SLICE", 96)  # 1000 rows: ten whole slices and a partial one
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(48, 1000, bias=bias)
    x = torch.randn(*lead, 48, generator=g)
    with torch.inference_mode():
        want = F.linear(x, head.weight, head.bias)
        got = sliced_head_forward(head, x)
    assert got.shape == want.shape and torch.equal(got, want)


def test_autograd_gets_the_plain_product(monkeypatch):
    monkeypatch.setattr(torch_head, "SLICE", 8)
    head = nn.Linear(6, 40)
    x = torch.randn(4, 6, requires_grad=True)
    sliced_head_forward(head, x).square().sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    F.linear(ref, head.weight, head.bias).square().sum().backward()
    assert torch.equal(x.grad, ref.grad)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.conftest import build_tiny_hf_dir

    return build_tiny_hf_dir(tmp_path_factory.mktemp("tiny_head"))


def test_switch_keeps_parameters_state_dict_and_logits(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch_head, "SLICE", 16)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ours = copy.deepcopy(model)
    assert ours.get_output_embeddings().weight.shape[0] > 16
    keys = list(ours.state_dict())
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert use_sliced_head(ours) and not use_sliced_head(ours)  # switched once, then left as it is
    assert (ours.get_output_embeddings().weight is ours.get_input_embeddings().weight) == tied
    assert list(ours.state_dict()) == keys and "forward" in vars(ours.get_output_embeddings())
    ids = torch.randint(4, 60, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids).logits, model(input_ids=ids).logits)
    with torch.no_grad():  # a weight update reaches the sliced head: it reads the same parameter
        ours.get_output_embeddings().weight.mul_(0.5)
        model.get_output_embeddings().weight.mul_(0.5)
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids).logits, model(input_ids=ids).logits)


def test_other_heads_are_left_alone():
    class Wrapped(nn.Linear):  # a subclass stands for a LoRA- or otherwise wrapped head
        pass

    class Model(nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def get_output_embeddings(self):
            return self.head

    assert not use_sliced_head(Model(Wrapped(4, 8)))
    assert not use_sliced_head(nn.Linear(4, 8))  # no get_output_embeddings
    assert use_sliced_head(Model(nn.Linear(4, 8)))


def test_engine_generates_what_it_did_without_the_sliced_head(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch_head, "SLICE", 16)
    ours = TorchEngine.from_pretrained(tiny_dir, device="cpu")
    assert "forward" in vars(ours.model.get_output_embeddings())
    monkeypatch.setattr("rlblocks.rollout.engines.torch_head.use_sliced_head", lambda model: False)
    theirs = TorchEngine.from_pretrained(tiny_dir, device="cpu")
    assert "forward" not in vars(theirs.model.get_output_embeddings())
    prompts = [[1, 5, 6, 7], [1, 30, 31], [1, 9, 9, 9, 9, 12, 13, 14, 15], [1, 40]]

    async def run(engine):
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
        return await asyncio.gather(*[engine.generate(GenerationRequest(f"r{i}", p, sp))
                                      for i, p in enumerate(prompts)])

    for a, b in zip(asyncio.run(run(ours)), asyncio.run(run(theirs))):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs  # bit for bit
    ours.close()
    theirs.close()
