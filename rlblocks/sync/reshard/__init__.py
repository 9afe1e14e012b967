"""Resharding a trainer's weights into whole HF-named tensors for an engine: :func:`full_tensors` (FSDP2 DTensors
gathered one parameter at a time) and the megatron-core <-> HF conversions (:func:`hf_to_megatron`,
:func:`megatron_to_hf`, :func:`megatron_to_hf_streaming`, with :class:`GPTDims` from :func:`gpt_dims`).

Only torch is imported (megatron-core never is: the conversions read and write plain state dicts).
"""

from __future__ import annotations

from .fsdp import full_tensors
from .megatron import GPTDims, gpt_dims, hf_to_megatron, megatron_to_hf, megatron_to_hf_streaming

__all__ = ["GPTDims", "full_tensors", "gpt_dims", "hf_to_megatron", "megatron_to_hf", "megatron_to_hf_streaming"]
