"""Tiny random Hugging Face MoE causal LMs for the routing-replay tests (built locally, no hub access)."""

from __future__ import annotations

import torch

VOCAB = 64


def tiny_moe(kind: str, *, seed: int = 0, gate_std: float = 0.5, expert_scale: float = 1.0, sharpen: float = 10.0,
             layers: int = 4, **extra):
    """A tiny random HF MoE causal LM. Router weights ~ N(0, gate_std) (small: near-tied routes, which rounding
    flips); ``expert_scale`` > 1 makes the experts differ more (a flipped route then moves the logits more); the
    LM head is multiplied by ``sharpen`` (peaked next-token distributions)."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "qwen3":
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
                             **common, **extra)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             num_experts=8, norm_topk_prob=False, **common, **extra)
        model = Qwen2MoeForCausalLM(cfg)
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=32, num_local_experts=8, **common, **extra))
    elif kind == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(intermediate_size=32, num_experts=8, **common, **extra))
    elif kind == "gpt_oss":
        cfg = GptOssConfig(intermediate_size=32, num_local_experts=8, layer_types=["full_attention"] * layers,
                           **common, **extra)
        model = GptOssForCausalLM(cfg)
    elif kind == "deepseek_v3":
        cfg = DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, n_group=2,
                               topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                               **{**common, "head_dim": 16}, **extra)
        model = DeepseekV3ForCausalLM(cfg)
    else:
        raise AssertionError(kind)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")) and p.dim() == 2 and p.shape[0] == 8:
                p.normal_(0, gate_std)
            if ".experts." in name:
                p.mul_(expert_scale)
            if kind == "gpt_oss" and ".experts." in name and p.abs().sum() == 0:
                p.normal_(0, 0.02 * expert_scale)
    return model.eval()


def response_logp(model, input_ids, prompt_lens, response_mask, attention_mask=None):
    """``[B, T]`` log-probs of the response tokens (position ``t`` of row ``b`` is sequence position ``P_b + t``)."""
    logits = model(input_ids, attention_mask=attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    t = response_mask.shape[1]
    pos = (prompt_lens[:, None] - 1 + torch.arange(t)).clamp(max=lp.shape[1] - 1)
    return torch.where(response_mask, lp.gather(1, pos), torch.zeros(()))
