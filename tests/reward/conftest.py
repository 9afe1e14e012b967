"""Fixtures of the reward tests: a tiny sequence-classification reward model built locally (no hub access)."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_rm_dir(tiny_hf_dir, tmp_path_factory) -> str:
    """The tiny Llama of tests/conftest.py as a one-label LlamaForSequenceClassification, saved with its tokenizer."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(tiny_hf_dir, num_labels=1)
    with torch.no_grad():  # a head of unit scale, so that different texts get clearly different rewards
        model.score.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_hf_dir).save_pretrained(path)
    return str(path)
