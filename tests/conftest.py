"""Shared test fixtures. Area-specific fixtures live in tests/<area>/conftest.py."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton reads TRITON_INTERPRET when a kernel is decorated (module import), so set it before any test imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Characters of the tiny test tokenizer: digits, arithmetic, lower-case letters and a few marks.
TINY_CHARS = list("0123456789+-*=?:;,. abcdefghijklmnopqrstuvwxyz")
TINY_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_tiny_hf_dir(path, *, seed: int = 0, vocab_size: int = 64, hidden: int = 64, layers: int = 2) -> str:
    """Save a tiny random HF Llama (head_dim 32, GQA 2:1) and a char-level tokenizer to ``path``.

    Built locally, no hub access. vLLM needs head_dim >= 32. Returns ``str(path)``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_CHARS)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def build_small_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random one-layer HF Llama whose matrices are not multiples of 128 (hidden 160, MLP 272, vocab 64): FP8
    blocks that are partial in both directions. Built in memory, no checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=160, intermediate_size=272, num_hidden_layers=1, num_attention_heads=5,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> str:
    """A tiny random HF Llama checkpoint directory with tokenizer (shared by rollout, sync and cookbook tests)."""
    return build_tiny_hf_dir(tmp_path_factory.mktemp("tiny_llama"))
