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
    # multi-turn agents: trajectories, episodes and tools, the capture gateway, reference chat templates
    "PrefixMismatchError": ".trajectory",
    "Trajectory": ".trajectory",
    "render_chat": ".trajectory",
    "to_tensors": ".trajectory",
    "trajectory_rows": ".trajectory",
    "Env": ".agent",
    "Episode": ".agent",
    "EpisodeStats": ".agent",
    "StepResult": ".agent",
    "Tool": ".agent",
    "ToolCall": ".agent",
    "ToolEnv": ".agent",
    "calculator_tool": ".agent",
    "generate_turn": ".agent",
    "parse_tool_calls": ".agent",
    "python_tool": ".agent",
    "run_episode": ".agent",
    "Gateway": ".gateway",
    "HERMES_TEMPLATE": ".chat_templates",
    "LLAMA3_TEMPLATE": ".chat_templates",
    # MoE routing replay (R3): record the engine's experts, force them in the training forward
    "RoutingRecorder": ".routing",
    "concat_routing": ".routing",
    "pad_routing": ".routing",
    "replay_routing": ".routing",
    "response_routing": ".routing",
    "route_flip_fraction": ".routing",
}

__all__ = [
    "FinishReason",
    "Generation",
    "GenerationRequest",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "build_batch",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
