"""Rollout: the engine protocol with interrupt/resume and per-token policy versions, training batches, an engine pool.

- Protocol and types: :class:`RolloutEngine`, :class:`SamplingParams`, :class:`GenerationRequest`,
  :class:`Generation`, :data:`FinishReason`; the client-side resume loop :func:`resumable_generate`
  (:class:`ResumableResult`).
- Training tensors: :class:`RolloutBatch` / :func:`build_batch`.
- :class:`Router` (``engine_pool.py``): one engine over several, with session affinity and fail-over.

Each subpackage is its own face, and its names are imported from there only:

- :mod:`rlblocks.rollout.engines`: ``TorchEngine``, ``VLLMEngine``, ``SGLangEngine`` (vllm loads on first use);
- :mod:`rlblocks.rollout.agents`: ``Trajectory``, ``run_episode``, ``ToolEnv``, ``Tool``, the chat templates;
- :mod:`rlblocks.rollout.gateway`: ``Gateway``, the OpenAI-compatible capture server;
- :mod:`rlblocks.rollout.moe_replay`: MoE routing replay (R3), ``RoutingRecorder``, ``replay_routing``.

Prefix trees (the layout of a prefix-shared forward) are :mod:`rlblocks.sched`'s. ``import rlblocks.rollout``
needs only torch (transformers is imported inside the functions that load a model or a tokenizer).
"""

from __future__ import annotations

from .batch import RolloutBatch, build_batch
from .engine_pool import Router
from .resume import ResumableResult, resumable_generate
from .types import FinishReason, Generation, GenerationRequest, RolloutEngine, SamplingParams

__all__ = [
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "ResumableResult",
    "RolloutBatch",
    "RolloutEngine",
    "Router",
    "SamplingParams",
    "build_batch",
    "resumable_generate",
]
