"""Rollout engines behind one protocol (:class:`~rlblocks.rollout.types.RolloutEngine`): :class:`TorchEngine`
(plain PyTorch, CPU or GPU), :class:`VLLMEngine` (vLLM's ``AsyncLLM``), :class:`SGLangEngine` (an SGLang server
over HTTP).

Layout: ``lifecycle.py`` (the request lifecycle every engine shares: pause / sleep / wake / close state, requests
in flight, version spans, state queries), ``_weights.py`` (the weight-update rule every engine and sync receiver
applies), one module per engine with its helpers by concern beside it (``torch_compute.py``, ``torch_memory.py``,
``torch_sampling.py``; ``sglang_http.py``, ``sglang_weights.py``). ``VLLMEngine`` and its
trainer-side NCCL helpers import vllm and load on first use; the rest needs only torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .lifecycle import Lifecycle
from .sglang_engine import SGLangEngine, SGLangEngineStats
from .torch_engine import EngineStats, TorchEngine

if TYPE_CHECKING:
    from .vllm_engine import VLLMEngine, VLLMEngineStats, nccl_trainer_init, nccl_trainer_send

# heavy (vllm): name -> module, imported on first access
_LAZY = {
    "VLLMEngine": ".vllm_engine",
    "VLLMEngineStats": ".vllm_engine",
    "nccl_trainer_init": ".vllm_engine",
    "nccl_trainer_send": ".vllm_engine",
}

__all__ = [
    "EngineStats",
    "Lifecycle",
    "SGLangEngine",
    "SGLangEngineStats",
    "TorchEngine",
    "VLLMEngine",
    "VLLMEngineStats",
    "nccl_trainer_init",
    "nccl_trainer_send",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
