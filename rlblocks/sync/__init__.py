"""Moving weights from training to inference: buckets, broadcast across jobs, colocated shared-memory handoff,
delta sync, LoRA sync, resharding (FSDP2 full tensors, megatron-core <-> HF).

- :func:`pack_buckets` / :func:`unpack_bucket`: flat ``uint8`` buckets with JSON-safe metadata, bit-exact.
- :func:`init_sync_group`, :class:`WeightSender`, :class:`WeightReceiver`: a broadcast group of its own (never the
  default process group), manifest checked on every rank before a byte moves.
- :class:`HandoffSender`, :func:`update_from_handoff`, :func:`open_handoff`: colocated trainer and engine share the
  buckets (POSIX shared memory on the CPU, CUDA IPC on a GPU).
- :class:`DeltaEncoder`, :class:`DeltaDecoder`, :class:`DirectoryTransport`, :class:`GroupDeltaTransport`: sparse
  delta packets with checksums, and their transports.
- :func:`lora_state`, :func:`merge_lora`, :class:`LoraSyncer`, :func:`split_lora_message`: LoRA adapters only.
- :func:`quantize_named`, :func:`dequantize_named`, :class:`FP8Rules`, :func:`save_fp8_checkpoint`: blockwise FP8
  (``weight`` + ``weight_scale_inv``, 128 x 128 blocks) on the way to the rollout engine.
- :func:`full_tensors` (FSDP2), :func:`hf_to_megatron`, :func:`megatron_to_hf`, :func:`megatron_to_hf_streaming`.

Every module here needs only torch (peft is imported inside :func:`lora_state`; megatron-core is never imported).
"""

from __future__ import annotations

from .broadcast import SyncGroup, WeightReceiver, WeightSender, init_sync_group
from .buckets import Bucket, TensorMeta, pack_buckets, unpack_bucket
from .delta import DeltaDecoder, DeltaEncoder, DeltaPacket
from .delta_transport import DirectoryTransport, GroupDeltaTransport
from .fp8 import (
    FP8Rules,
    dequantize_fp8,
    dequantize_named,
    quantize_fp8,
    quantize_named,
    quantized_specs,
    save_fp8_checkpoint,
)
from .handoff import HandoffMessage, HandoffSender, open_handoff, update_from_handoff
from .lora import LoraSyncer, lora_state, merge_lora, split_lora_message
from .reshard import GPTDims, full_tensors, gpt_dims, hf_to_megatron, megatron_to_hf, megatron_to_hf_streaming

__all__ = [
    "Bucket",
    "DeltaDecoder",
    "DeltaEncoder",
    "DeltaPacket",
    "DirectoryTransport",
    "FP8Rules",
    "GPTDims",
    "GroupDeltaTransport",
    "HandoffMessage",
    "HandoffSender",
    "LoraSyncer",
    "SyncGroup",
    "TensorMeta",
    "WeightReceiver",
    "WeightSender",
    "dequantize_fp8",
    "dequantize_named",
    "full_tensors",
    "gpt_dims",
    "hf_to_megatron",
    "init_sync_group",
    "lora_state",
    "megatron_to_hf",
    "megatron_to_hf_streaming",
    "merge_lora",
    "open_handoff",
    "pack_buckets",
    "quantize_fp8",
    "quantize_named",
    "quantized_specs",
    "save_fp8_checkpoint",
    "split_lora_message",
    "unpack_bucket",
    "update_from_handoff",
]
