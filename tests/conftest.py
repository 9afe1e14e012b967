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


# A byte-level BPE tokenizer trained here, in well under a second, on local text (the shipped GSM8K-style prompts,
# the chat templates' own text, tool calls): real merges, so a sampled token sequence is often NOT the tokenizer's
# canonical encoding of its text, as with the tokenizers of real models.
GSM8K_STYLE = os.path.join(os.path.dirname(__file__), "cookbook", "data", "gsm8k_style.jsonl")
BPE_SPECIALS = {
    "hermes": {"pad": "<|endoftext|>", "eos": "<|im_end|>", "bos": None,
               "extra": ["<|im_start|>"], "added": ["<tool_call>", "</tool_call>", "<tool_response>",
                                                    "</tool_response>"]},
    "llama3": {"pad": "<|finetune_right_pad_id|>", "eos": "<|eot_id|>", "bos": "<|begin_of_text|>",
               "extra": ["<|start_header_id|>", "<|end_header_id|>"], "added": []},
}


def bpe_training_text() -> list[str]:
    """The local text the test BPE tokenizers are trained on."""
    import json

    from rlblocks.rollout.agents.chat_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE

    text = []
    with open(GSM8K_STYLE) as f:
        for line in f:
            row = json.loads(line)
            text += [row["question"], row["answer"]]
    text += [HERMES_TEMPLATE, LLAMA3_TEMPLATE]
    text += [f'{{"name": "calc", "arguments": {{"expr": "{a}*{b}"}}}} the answer is {a * b}.'
             for a in range(3, 60, 7) for b in range(11, 99, 13)]
    return text


def build_bpe_tokenizer(style: str = "hermes", *, vocab_size: int = 600):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (merges learned from :func:`bpe_training_text`) with the
    special tokens and chat template of ``style``: ``hermes`` (Qwen2.5-style ChatML with Hermes tool calls, EOS
    ``<|im_end|>``, ``<tool_call>`` as added tokens as in Qwen) or ``llama3`` (Llama 3.1 headers, BOS
    ``<|begin_of_text|>``, EOS ``<|eot_id|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlblocks.rollout.agents.chat_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE

    sp = BPE_SPECIALS[style]
    specials = [t for t in (sp["pad"], sp["bos"], sp["eos"], *sp["extra"]) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bpe_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=sp["pad"], eos_token=sp["eos"],
                                   bos_token=sp["bos"], additional_special_tokens=sp["extra"])
    if sp["added"]:
        fast.add_tokens(sp["added"])
    fast.chat_template = HERMES_TEMPLATE if style == "hermes" else LLAMA3_TEMPLATE
    return fast


def build_bpe_hf_dir(path, *, style: str = "hermes", seed: int = 0, hidden: int = 64, layers: int = 2,
                     positions: int = 512) -> str:
    """Save a tiny random HF Llama over :func:`build_bpe_tokenizer`'s vocabulary, with that tokenizer, to
    ``path``. Returns ``str(path)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = build_bpe_tokenizer(style)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=positions,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def bpe_chat_dir(tmp_path_factory) -> str:
    """A tiny random HF Llama with a byte-level BPE tokenizer and a Hermes (Qwen-style) chat template."""
    return build_bpe_hf_dir(tmp_path_factory.mktemp("bpe_llama"))


@pytest.fixture(scope="session")
def bpe_tokenizers() -> dict:
    """The test BPE tokenizers by style: ``hermes`` (Qwen-style ChatML) and ``llama3`` (Llama 3.1 headers)."""
    return {"hermes": build_bpe_tokenizer("hermes"), "llama3": build_bpe_tokenizer("llama3")}
