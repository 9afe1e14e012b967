"""rlblocks.tinker: the Tinker training API served from rlblocks blocks, for the official ``tinker`` SDK (0.38) and
tinker-cookbook recipes on your own hardware.

``python -m rlblocks.tinker --model NAME=HF_DIR [--model ...] [--host 127.0.0.1] [--port 8000] [--engine torch|vllm]
[--state-dir DIR] [--max-num-samples N] [--max-request-tokens N] [--stable-reinforce-as ppo|cispo|importance_sampling]``
(``--help`` lists them all), then point the SDK at it: ``TINKER_BASE_URL=http://127.0.0.1:8000`` and any
``TINKER_API_KEY`` starting with ``tml-``.

Modules: ``wire`` (the SDK's protobuf and JSON formats), ``losses`` (each ``loss_fn`` on ``rlblocks.losses``),
``training`` (LoRA adapters on a shared base, log-probs through ``rlblocks.kernels``, AdamW), ``sampling`` (weight
snapshots on a ``RolloutEngine``), ``futures`` (request ids, long polls, idempotent retries), ``store``
(checkpoints under ``--state-dir``), ``service`` (the API without HTTP), ``server`` (FastAPI + uvicorn).
Names are imported lazily: ``import rlblocks.tinker`` imports neither torch-heavy modules nor fastapi.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

_LAZY = {
    "TinkerService": ".service",
    "ServerThread": ".server",
    "create_app": ".server",
    "SERVED": ".server",
    "REFUSED": ".server",
    "LOSS_FNS": ".losses",
    "tinker_loss": ".losses",
    "TrainingHost": ".training",
    "LoraSpec": ".training",
    "SamplerHost": ".sampling",
    "WireDatum": ".wire",
}

if TYPE_CHECKING:
    from .losses import LOSS_FNS, tinker_loss
    from .sampling import SamplerHost
    from .server import REFUSED, SERVED, ServerThread, create_app
    from .service import TinkerService
    from .training import LoraSpec, TrainingHost
    from .wire import WireDatum

__all__ = ["LOSS_FNS", "REFUSED", "SERVED", "LoraSpec", "SamplerHost", "ServerThread", "TinkerService",
           "TrainingHost", "WireDatum", "create_app", "tinker_loss"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
