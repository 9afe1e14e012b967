"""Helpers of the rlblocks.tinker tests: a tiny locally built model and float64 references (fixtures in conftest.py).

The model is served under the name ``meta-llama/Llama-3.2-1B`` because tinker-cookbook picks the ``role_colon``
renderer for it (plain ``User: ...`` / ``Assistant: ...`` text), which the tiny model's printable-ASCII char-level
tokenizer encodes exactly. Nothing is downloaded: the model and tokenizer are built locally.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

MODEL = "meta-llama/Llama-3.2-1B"


def build_ascii_hf_dir(path, *, seed: int = 0, hidden: int = 64, layers: int = 2, tie: bool = False) -> str:
    """A tiny random HF Llama with a printable-ASCII char-level tokenizer (vocab 128, ids 0-3 special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a sharper head: a random tiny model is otherwise nearly uniform
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def merged_reference(ref_model, adapter_dir: str | Path):
    """A float64 copy of ``ref_model`` with a saved adapter merged in: ``W + (alpha / r) · B @ A`` in float64."""
    import copy

    from safetensors.torch import load_file

    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    model = copy.deepcopy(ref_model)
    params = dict(model.named_parameters())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        with torch.no_grad():
            params[module + ".weight"].add_((cfg["lora_alpha"] / a.shape[0]) * (b.double() @ a.double()))
    return model


@torch.no_grad()
def ref_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """float64 ``log softmax(model(tokens))[i, targets[i]]``."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
