"""Stream full tensors out of an FSDP2 / DTensor-sharded model, one parameter at a time.

``get_model_state_dict(full_state_dict=True)`` materialises the whole model at once; for weight sync only one full
tensor needs to exist at a time. :func:`full_tensors` all-gathers a parameter (``DTensor.full_tensor()``), yields it,
drops its own reference and moves on, so the extra memory is about one parameter (plus whatever the consumer keeps).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from jaxtyping import Shaped
from torch import Tensor, nn

from rlblocks._checks import check_bool
from rlblocks.errors import ArgumentError

__all__ = ["clean_name", "full_tensors"]

AnyTensor = Shaped[Tensor, "..."]

# Name components inserted by module wrappers: torch.compile, activation checkpointing, FSDP1, CPU offload wrappers.
_WRAPPER_PARTS = frozenset(
    {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_offload_wrapped_module"}
)


def clean_name(name: str) -> str:
    """Remove wrapper components (``_orig_mod``, ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``,
    ``_offload_wrapped_module``) from a dotted parameter name, so it matches the unwrapped (HF) state dict."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _named_state(model: nn.Module, buffers: bool, remove_duplicate: bool) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    if not buffers:
        return
    for mod_name, mod in model.named_modules(remove_duplicate=remove_duplicate):
        for buf_name, buf in mod._buffers.items():
            if buf is None or buf_name in mod._non_persistent_buffers_set:
                continue
            yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


def full_tensors(
    model: nn.Module,
    *,
    buffers: bool = False,
    cpu_offload: bool = False,
    dtype: torch.dtype | None = None,
    remove_duplicate: bool = True,
) -> Iterator[tuple[str, AnyTensor]]:
    """Yield ``(name, full tensor)`` for every parameter of ``model``, gathering DTensor shards one at a time.

    * A ``DTensor`` parameter (FSDP2 ``fully_shard``, or TP via DTensor) is replaced by ``full_tensor()``, a
      collective: every rank of the mesh must iterate the same model in the same order. Plain tensors pass through
      detached (no copy, unless ``dtype`` / ``cpu_offload`` asks for one).
    * ``buffers=True`` adds the persistent buffers (those in ``state_dict()``) after the parameters.
    * Names are cleaned of wrapper components (see :func:`clean_name`); a ``DistributedDataParallel`` root's
      ``module.`` prefix is removed. With ``remove_duplicate=True`` a tied parameter is yielded once, under its first
      name (as ``named_parameters`` does); ``False`` yields it under every name, like ``state_dict()``.
    * ``dtype`` casts floating-point tensors (integer buffers keep their dtype) and ``cpu_offload`` moves each
      result to CPU; both happen right after the gather, so only one full tensor exists on the device at a time.

    Values are bit-exact copies of the unsharded parameters (no arithmetic). Runs under ``torch.no_grad()``; yielded
    tensors do not require grad. The generator keeps no reference to a tensor after it has been yielded. The
    arguments are checked at the call (the flags must be real bools), not at the first ``next()``.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ArgumentError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
    for name, flag in (("buffers", buffers), ("cpu_offload", cpu_offload), ("remove_duplicate", remove_duplicate)):
        check_bool(name, flag)
    return _full_tensors(model, buffers, cpu_offload, dtype, remove_duplicate)


def _full_tensors(
    model: nn.Module, buffers: bool, cpu_offload: bool, dtype: torch.dtype | None, remove_duplicate: bool
) -> Iterator[tuple[str, AnyTensor]]:
    dtensor = _dtensor_type()
    ddp_prefix = isinstance(model, nn.parallel.DistributedDataParallel)
    for raw_name, tensor in _named_state(model, buffers, remove_duplicate):
        name = clean_name(raw_name)
        if ddp_prefix and name.startswith("module."):
            name = name[len("module.") :]
        with torch.no_grad():
            full = tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor.detach()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            if cpu_offload:
                full = full.to("cpu")
        yield name, full
        del full
