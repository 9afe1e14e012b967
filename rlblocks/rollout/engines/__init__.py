"""Rollout engines behind one protocol (:class:`~rlblocks.rollout.types.RolloutEngine`): :class:`TorchEngine`
(plain PyTorch, CPU or GPU), :class:`VLLMEngine` (vLLM's ``AsyncLLM``), :class:`SGLangEngine` (an SGLang server
over HTTP).

Layout: ``lifecycle.py`` (the request lifecycle every engine shares: pause / sleep / wake / close state, requests
in flight, version spans, state queries), ``_weights.py`` (the weight-update rule every engine and sync receiver
applies), one module per engine with its helpers by concern beside it (``torch_compute.py``, ``torch_memory.py``,
``torch_sampling.py``; ``sglang_http.py``, ``sglang_weights.py``; ``vllm_outputs.py``, ``vllm_weights.py``,
``vllm_lora.py``). ``VLLMEngine`` and its trainer-side NCCL helpers import vllm and load on first use; the rest
needs only torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
