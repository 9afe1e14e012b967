"""Fixtures of the rollout tests: tiny HF models loaded from the shared ``tiny_hf_dir`` checkpoint."""

import pytest
import torch


def _load_tiny_model(path: str, sharpen: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture
def make_tiny_model(tiny_hf_dir):
    """Factory of fresh tiny Llamas in fp32 eval mode (tests may update their weights). ``sharpen`` scales
    ``lm_head`` so that next-token distributions are peaked: a random tiny model is nearly uniform, which makes
    top-k/top-p uninformative and greedy decoding a matter of near-ties."""
    return lambda sharpen=20.0: _load_tiny_model(tiny_hf_dir, sharpen)


@pytest.fixture
def tiny_model(make_tiny_model):
    """A fresh sharpened tiny Llama."""
    return make_tiny_model()
