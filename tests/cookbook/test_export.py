"""``--save-hf``: the trained policy written as an HF directory loads back (transformers, independently of the
loops' fused log-prob path) with the in-memory policy's log-probs: full fine-tuning, LoRA merged, LoRA adapter."""

from __future__ import annotations

import pytest
import torch
from plumbing import PolicyLogprobs, apply_lora, load_hf, save_hf
from plumbing.models import chat_ids

pytestmark = pytest.mark.slow


def _batch(tok):
    """Two chat prompts with responses (right-padded), the next-token labels of the response tokens."""
    rows = []
    for q, a in (("Calculate 23 + 58.", "<answer>81</answer>"), ("Name a colour.", "Blue, like the sky.")):
        p = chat_ids(tok, q)
        rows.append((p, p + tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]))
    width = max(len(s) for _, s in rows)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for _, s in rows])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for _, s in rows])
    labels = torch.full((len(rows), width - 1), -100)
    for i, (p, s) in enumerate(rows):
        labels[i, len(p) - 1 : len(s) - 1] = ids[i, len(p) : len(s)]
    return ids, mask, labels


def _hf_logprobs(model, ids, mask, labels):
    """The reference: transformers' own forward of the loaded directory, log_softmax in float64, gathered."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(labels != -100, lp, 0.0)


def _trained(lm, seed: int) -> None:
    """A stand-in for training: every trainable tensor moved by a small random step."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * (p.std() if p.numel() > 1 else 1.0)
                       + (torch.randn(p.shape, generator=g) * 0.01 if p.std() == 0 else 0.0))


@pytest.mark.parametrize("form", ["full", "merged", "adapter"])
def test_saved_policy_loads_back_with_equal_logprobs(smollm2_dir, tmp_path, form):
    from transformers import AutoModelForCausalLM

    tok, lm = load_hf(smollm2_dir, torch.device("cpu"))
    peft_model = apply_lora(lm, 4) if form != "full" else None
    _trained(lm, seed=1)
    ids, mask, labels = _batch(tok)
    with torch.no_grad():
        want = PolicyLogprobs(lm.eval())(ids, mask, labels).double()  # the in-memory policy, fused log-probs
    base = _hf_logprobs(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval(), ids, mask,
                        labels)
    assert (want - base).abs().max() > 1e-2  # the "training" changed the policy: the comparison below can fail

    out = save_hf(tmp_path / "policy", peft_model if peft_model is not None else lm, tok,
                  lora="adapter" if form == "adapter" else "merged")
    if form == "adapter":
        from peft import PeftModel

        assert (tmp_path / "policy" / "adapter_config.json").is_file()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32),
                                           out)
    else:
        assert not (tmp_path / "policy" / "adapter_config.json").exists()
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = _hf_logprobs(loaded.eval(), ids, mask, labels)
    assert (got - want).abs().max() < 2e-4, (got - want).abs().max()
    # the tokenizer and its chat template came along
    from transformers import AutoTokenizer

    assert chat_ids(AutoTokenizer.from_pretrained(out), "hi") == chat_ids(tok, "hi")
    if peft_model is not None:  # saving merged a copy: the live model still trains its adapters
        assert any("lora_" in n for n, _ in lm.named_parameters())
        with torch.no_grad():
            assert torch.equal(PolicyLogprobs(lm)(ids, mask, labels).double(), want)
