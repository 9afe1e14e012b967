"""Fused log-prob / entropy / full-vocabulary KL ops with forward and backward (Triton on CUDA, chunked torch on CPU).

Ops are imported lazily, so ``import rlblocks.kernels`` imports neither triton nor any kernel module (one op per
file: ``logprobs.py``, ``linear_logprobs.py``, ``kl.py``, ``linear_kl.py``, each holding its Triton kernels, its
autograd.Function, its chunked torch path and the public wrapper):

- ``token_logprobs(logits, labels, ...)``: label log-prob (+ entropy) from logits; with ``top_k`` / ``top_p`` (the
  engine's sampling parameters) under the distribution the engine sampled from (sampling-mask replay,
  ``_sampling.py``; the same parameters on ``linear_token_logprobs``, ``linear_token_logprobs_loss`` and
  ``causal_lm_logprobs``).
- ``linear_token_logprobs(hidden, weight, labels, ..., process_group=None)``: the same from hidden states and the LM
  head without materialising ``[N, V]``; vocab-parallel aware.
- ``linear_token_logprobs_loss(hidden, weight, labels, coef, entropy_coef=...)``: the fused-loss path for losses
  whose per-token coefficients are known up front (on-policy GRPO/PPO, SFT): the logits gradient is formed in the
  forward, so the logits GEMM runs once.
- ``vocab_kl(student_logits, teacher_logits, kind=...)``: per-token forward / reverse KL or JSD over the vocabulary.
- ``linear_vocab_kl(student_hidden, student_weight, teacher_hidden, teacher_weight, ...)``: the same from hidden
  states without materialising either logits tensor.
- ``causal_lm_logprobs(model, input_ids, prompt_lens, response_mask, ...)`` (``hf.py``): per-token log-probs of an
  HF causal LM aligned with ``rlblocks.rollout.RolloutBatch``, through ``linear_token_logprobs``.

Shared pieces: ``_common.py`` (host-side checks, chunk sizes, merging partial softmax stats, the backward's
vocab-chunk loop), ``_sampling.py`` (the top-k / top-p kept sets as per-row thresholds) and ``_tiles.py`` (Triton
tile helpers and autotune configs).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "token_logprobs": ".logprobs",
    "linear_token_logprobs": ".linear_logprobs",
    "linear_token_logprobs_loss": ".linear_logprobs",
    "vocab_kl": ".kl",
    "linear_vocab_kl": ".linear_kl",
    "causal_lm_logprobs": ".hf",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
