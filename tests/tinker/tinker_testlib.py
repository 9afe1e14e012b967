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


def build_ascii_hf_dir(path, *, seed: int = 0, hidden: int = 64, layers: int = 2, tie: bool = False,
                       sharpen: float = 8.0) -> str:
    """A tiny random HF Llama with a printable-ASCII char-level tokenizer (vocab 128, ids 0-3 special); its LM head
    is scaled by ``sharpen`` (a random tiny model is otherwise nearly uniform: greedy near-ties everywhere)."""
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
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
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


RL_MODEL = "meta-llama/Llama-3.2-3B"
"""A second served name (tinker-cookbook also renders it with ``role_colon``) for the rl_loop recipe's model."""

# rl_loop.py's prompt (its few-shot example and question suffix), so that the warmed-up model's answers parse
RL_PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry? Provide a numerical answer without units, written "
     "inside \\boxed{}."},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w "
     "6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]
RL_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
GSM8K_ROWS = [  # GSM8K's columns; every answer is 1 or 2, which the warmed-up model guesses half of the time
    {"question": f"What is {a} plus {b}?", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"}
    for a, b in [(0, 1), (1, 1), (0, 2), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2)]
]


def build_boxed_answer_dir(path, questions: list[str], *, steps: int = 150, seed: int = 0, context: int = 48,
                           lr: float = 2e-3) -> str:
    """A tiny ASCII model (unsharpened head) briefly supervised to answer rl_loop's prompts with `` \\boxed{1}``
    or `` \\boxed{2}``
    (a coin flip, whatever the question), so that the recipe's groups get mixed rewards and really train."""
    import random

    from tinker_cookbook import renderers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = build_ascii_hf_dir(Path(path) / "base", seed=seed + 1, sharpen=1.0)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    renderer = renderers.get_renderer("role_colon", tok)
    # the last ``context`` prompt tokens are enough to learn the answer format, at a fraction of the cost
    prompts = [renderer.build_generation_prompt([*RL_PREFIX, {"role": "user", "content": q + RL_SUFFIX}]).to_ints()
               [-context:] for q in questions]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows, labels = [], []
        for _ in range(8):
            p = rng.choice(prompts)
            ans = tok.encode(f" \\boxed{{{rng.choice('12')}}}\n\nUser:", add_special_tokens=False)
            rows.append(p + ans)
            labels.append([-100] * len(p) + ans)
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = Path(path) / "model"
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
