"""Grouped-query SDPA for the decoders that :class:`~rlblocks.rollout.engines.TorchEngine` loads itself.

HF's ``sdpa`` attention repeats each key/value head to its query heads (``repeat_kv``: a copy of the layer's whole
KV cache) whenever an attention mask is given, and a left-padded decode batch always has one: at batch 64 of a
GQA model that copy took about a fifth of a decode step on a CPU. Here the mask goes to
``scaled_dot_product_attention(..., enable_gqa=True)``, which reads each KV head once for its query heads; the same
attention, one fewer copy. Everything else (no mask, no GQA, a position bias) is HF's ``sdpa`` path as is.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # imported with the engine's model only

NAME = "rlblocks_gqa_sdpa"
_registered = False


def gqa_sdpa_attention(
    module: nn.Module,
    query: Float[Tensor, "B Hq Q D"],
    key: Float[Tensor, "B Hkv S D"],
    value: Float[Tensor, "B Hkv S D"],
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Float[Tensor, "B Q Hq D"], None]:
    """``softmax(q kᵀ · scaling + mask) v`` per query head, query head ``h`` reading key/value head
    ``h // (Hq / Hkv)`` (HF's ``repeat_kv`` layout), with the additive or boolean ``attention_mask`` ``[B, 1, Q, S]``;
    returns ``[B, Q, Hq, D]`` (HF's attention-function contract). Without a mask or without GQA: HF's ``sdpa``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: nn.Module) -> bool:
    """Switch ``model`` from HF's ``sdpa`` attention to :func:`gqa_sdpa_attention` (registered once, with HF's
    ``sdpa`` mask); a model on another attention implementation is left as it is. Returns whether it switched."""
    global _registered
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, gqa_sdpa_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    model.set_attn_implementation(NAME)
    return True


