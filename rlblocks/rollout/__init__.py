"""Rollout: engines with interrupt/resume and per-token policy versions, batches, multi-turn agents, the capture
gateway, and MoE routing replay.

- Engine protocol and types: :class:`RolloutEngine`, :class:`SamplingParams`, :class:`GenerationRequest`,
  :class:`Generation`; engines :class:`TorchEngine`, :class:`VLLMEngine`, :class:`SGLangEngine`; :class:`Router`;
  the client-side resume loop :func:`resumable_generate`.
- Training tensors: :class:`RolloutBatch` / :func:`build_batch`; prefix trees for a prefix-shared forward,
  :func:`build_prefix_tree` / :func:`response_prefix_tree` (:class:`PrefixTree`).
- Multi-turn agents: :class:`Trajectory`, :func:`run_episode`, :class:`ToolEnv`, :class:`Tool`, the reference chat
  templates; :class:`Gateway`, an OpenAI-compatible server that captures trajectories.
- MoE routing replay (R3): :class:`RoutingRecorder`, :func:`replay_routing` and the record helpers.

``VLLMEngine`` (vllm) and ``Gateway`` (its HTTP server) are imported on first use; everything else is imported here
and needs only torch (transformers is imported inside the functions that load a model or a tokenizer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .agents import (
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    Env,
    Episode,
    EpisodeStats,
    StepResult,
    Tool,
    ToolCall,
    ToolEnv,
    Trajectory,
    calculator_tool,
    generate_turn,
    parse_tool_calls,
    python_tool,
    render_chat,
    render_chat_text,
    run_episode,
    to_tensors,
    trajectory_rows,
)
from .batch import RolloutBatch, build_batch
from .engines import SGLangEngine, TorchEngine
from .resume import ResumableResult, resumable_generate
from .router import Router
from .routing import (
    RoutingRecorder,
    concat_routing,
    pad_routing,
    replay_routing,
    response_routing,
    route_flip_fraction,
    routing_dtype,
)
from .tree import PrefixTree, build_prefix_tree, response_prefix_tree
from .types import FinishReason, Generation, GenerationRequest, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from .engines.vllm_engine import VLLMEngine, nccl_trainer_init, nccl_trainer_send
    from .gateway import Gateway

# heavy (vllm; the gateway's HTTP server): name -> module, imported on first access
_LAZY = {
    "Gateway": ".gateway",
    "VLLMEngine": ".engines.vllm_engine",
    "nccl_trainer_init": ".engines.vllm_engine",
    "nccl_trainer_send": ".engines.vllm_engine",
}

__all__ = [
    "HERMES_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "Env",
    "Episode",
    "EpisodeStats",
    "FinishReason",
    "Gateway",
    "Generation",
    "GenerationRequest",
    "PrefixTree",
    "ResumableResult",
    "RolloutBatch",
    "RolloutEngine",
    "Router",
    "RoutingRecorder",
    "SGLangEngine",
    "SamplingParams",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "TorchEngine",
    "Trajectory",
    "VLLMEngine",
    "build_batch",
    "build_prefix_tree",
    "calculator_tool",
    "concat_routing",
    "generate_turn",
    "nccl_trainer_init",
    "nccl_trainer_send",
    "pad_routing",
    "parse_tool_calls",
    "python_tool",
    "render_chat",
    "render_chat_text",
    "replay_routing",
    "response_prefix_tree",
    "response_routing",
    "resumable_generate",
    "route_flip_fraction",
    "routing_dtype",
    "run_episode",
    "to_tensors",
    "trajectory_rows",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
