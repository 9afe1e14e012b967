"""Fused log-prob / entropy / full-vocabulary KL ops with forward and backward (Triton on CUDA, chunked torch on CPU).

- ``token_logprobs(logits, labels, ...)``: label log-prob (+ entropy) from logits; with ``top_k`` / ``top_p`` (the
  engine's sampling parameters) under the distribution the engine sampled from (sampling-mask replay; the same
  parameters on ``linear_token_logprobs``, ``linear_token_logprobs_loss`` and ``causal_lm_logprobs``).
- ``linear_token_logprobs(hidden, weight, labels, ..., process_group=None)``: the same from hidden states and the LM
  head without materialising ``[N, V]``; vocab-parallel aware.
- ``linear_token_logprobs_loss(hidden, weight, labels, coef, entropy_coef=...)``: the fused-loss path for losses
  whose per-token coefficients are known up front (on-policy GRPO/PPO, SFT): the logits gradient is formed in the
  forward, so the logits GEMM runs once.
- ``vocab_kl(student_logits, teacher_logits, kind=...)``: per-token forward / reverse KL or JSD over the vocabulary.
- ``linear_vocab_kl(student_hidden, student_weight, teacher_hidden, teacher_weight, ...)``: the same from hidden
  states without materialising either logits tensor.
- ``causal_lm_logprobs(model, input_ids, prompt_lens, response_mask, ...)``: per-token log-probs of an HF causal LM
  aligned with ``rlblocks.rollout.RolloutBatch``, through ``linear_token_logprobs``; with ``cp_group=`` context
  parallel (each rank forwards a zigzag shard of the sequence, ``ring_attention`` across the group).
- ``ring_attention(q, k, v, group)``, ``zigzag_positions``: causal ring attention over zigzag shards (forward and
  backward); ``ring_attention_local``: every rank's part of it in one process (the one-device check of the
  ring's math and kernels); ``cp_shard_mask``: the response tokens a rank scores (the loss side);
  ``enable_context_parallel``: register the ring attention as the model's attention implementation (done on the
  first ``cp_group`` call).

Every op module imports triton (where installed) when it is imported, so all of them load on first use:
``import rlblocks.kernels`` imports neither triton nor any kernel module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

if TYPE_CHECKING:
    from .context_parallel import cp_shard_mask, enable_context_parallel
    from .hf import causal_lm_logprobs
    from .kl import vocab_kl
    from .linear_kl import linear_vocab_kl
    from .linear_logprobs import linear_token_logprobs
    from .linear_logprobs_loss import linear_token_logprobs_loss
    from .logprobs import token_logprobs
    from .ring import ring_attention, ring_attention_local, zigzag_positions

# heavy (triton): name -> module, imported on first access
_LAZY = {
    "causal_lm_logprobs": ".hf",
    "cp_shard_mask": ".context_parallel",
    "enable_context_parallel": ".context_parallel",
    "linear_token_logprobs": ".linear_logprobs",
    "linear_token_logprobs_loss": ".linear_logprobs_loss",
    "linear_vocab_kl": ".linear_kl",
    "ring_attention": ".ring",
    "ring_attention_local": ".ring",
    "token_logprobs": ".logprobs",
    "vocab_kl": ".kl",
    "zigzag_positions": ".ring",
}

__all__ = [
    "causal_lm_logprobs",
    "cp_shard_mask",
    "enable_context_parallel",
    "linear_token_logprobs",
    "linear_token_logprobs_loss",
    "linear_vocab_kl",
    "ring_attention",
    "ring_attention_local",
    "token_logprobs",
    "vocab_kl",
    "zigzag_positions",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
