"""Rollout engines with interrupt/resume, per-token policy versions, logprobs and weight updates.

Engines are imported lazily: ``from rlblocks.rollout import VLLMEngine`` imports vllm only when asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from .batch import RolloutBatch, build_batch
from .types import FinishReason, Generation, GenerationRequest, RolloutEngine, SamplingParams

_LAZY = {
    "resumable_generate": ".resume",
    "ResumableResult": ".resume",
    "TorchEngine": ".torch_engine",
    "VLLMEngine": ".vllm_engine",
    "SGLangEngine": ".sglang_engine",
    "Router": ".router",
}

__all__ = [
    "FinishReason",
    "RolloutBatch",
    "build_batch",
    "Generation", "GenerationRequest", "RolloutEngine", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
