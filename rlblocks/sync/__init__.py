"""Moving weights from training to inference: buckets, broadcast across jobs, colocated shared-memory handoff,
delta sync, LoRA sync, resharding.

Names are imported lazily so that ``import rlblocks.sync`` stays light (no peft, megatron or transformers).
``rlblocks.sync.megatron`` is a submodule: ``from rlblocks.sync.megatron import hf_to_megatron``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Bucket": ".buckets",
    "TensorMeta": ".buckets",
    "pack_buckets": ".buckets",
    "unpack_bucket": ".buckets",
    "init_sync_group": ".broadcast",
    "SyncGroup": ".broadcast",
    "WeightSender": ".broadcast",
    "WeightReceiver": ".broadcast",
    "SyncError": ".broadcast",
    "SyncMismatchError": ".broadcast",
    "DeltaEncoder": ".delta",
    "DeltaDecoder": ".delta",
    "DeltaPacket": ".delta",
    "DeltaError": ".delta",
    "DirectoryTransport": ".delta_transport",
    "GroupDeltaTransport": ".delta_transport",
    "lora_state": ".lora",
    "merge_lora": ".lora",
    "LoraSyncer": ".lora",
    "split_lora_message": ".lora",
    "full_tensors": ".fsdp",
    "HandoffSender": ".handoff",
    "HandoffMessage": ".handoff",
    "open_handoff": ".handoff",
    "update_from_handoff": ".handoff",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
