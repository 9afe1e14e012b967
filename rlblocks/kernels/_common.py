"""Shared helpers of the kernel ops: argument checks, backend choice, chunk sizes, combining partial softmax stats.

Conventions used by every op in this package:

- ``z = logits / temperature`` in fp32 (inputs may be fp32, bf16 or fp16; accumulation is always fp32).
- Per-row softmax statistics are carried as ``(m, s, a)`` with ``m = max_j z_j``, ``s = Σ_j exp(z_j − m)`` and
  ``a = Σ_j exp(z_j − m)·(z_j − m)``. Then ``lse = m + log s`` and the entropy is ``H = log s − a / s``.
  Partial stats over disjoint vocabulary ranges (Triton vocab splits, or vocab-parallel ranks) are merged exactly by
  ``merge_partials`` / ``allreduce_stats``.
- Rows whose label equals ``ignore_index`` give 0 for every output and receive no gradient; their inputs are never
  read into a sum (NaN/inf there cannot leak).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rlblocks._validate import check_floating, check_tensor, shape_str
from rlblocks.errors import ArgumentError

# Bytes of fp32 logits one chunk of rows may hold in the torch path (per temporary). 64 MiB (512 rows at V=32768)
# keeps the chunk GEMMs efficient on CPU (at 16 MiB they ran ~1.7x slower here) while the extra memory stays a
# small fraction of the naive [N, V] path (measured 0.097x at T=4096, H=512, V=32768; benchmarks/kernels/results).
TORCH_CHUNK_BYTES = 64 << 20
# Bytes of the [N, vocab-chunk] gradient buffer the Triton backward may allocate.
TRITON_GRAD_CHUNK_BYTES = 256 << 20

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    """True when ``import triton`` works (triton is the optional ``kernels`` extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str | None, *tensors: Tensor) -> str:
    """Pick ``"triton"`` or ``"torch"``.

    ``None``/``"auto"``: Triton when every tensor is on CUDA and triton imports, else the chunked torch path.
    ``"triton"`` on CPU tensors works only under ``TRITON_INTERPRET=1`` (how CI runs the kernels).
    """
    if backend in (None, "auto"):
        on_cuda = all(t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise ArgumentError("backend: 'triton' was requested but triton is not installed (rlblocks[kernels] extra)")
        if not all(t.is_cuda for t in tensors) and not interpret_mode():
            raise ArgumentError(
                "backend: 'triton' needs CUDA tensors, or "
                "TRITON_INTERPRET=1 set before importing triton"
            )
        return "triton"
    raise ArgumentError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")


def check_float_input(name: str, x: Tensor) -> Tensor:
    check_floating(name, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise ArgumentError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def check_temperature(temperature: float) -> float:
    if isinstance(temperature, Tensor) or not isinstance(temperature, (int, float)):
        raise ArgumentError(f"temperature: expected a Python float > 0, got {type(temperature).__name__}")
    if not temperature > 0 or temperature != temperature or temperature == float("inf"):
        raise ArgumentError(f"temperature: expected a finite float > 0, got {temperature}")
    return float(temperature)


def check_labels(
    labels: Tensor, lead_shape: torch.Size, num_classes: int, ignore_index: int, *, like: str, validate: bool = True
) -> Int[Tensor, " N"]:
    """Check ``labels`` (integer, shape ``lead_shape``) and values in ``[0, num_classes)`` or ``== ignore_index``.

    The value check reads the tensor (one host sync of a single bool); it is skipped while ``torch.compile`` traces
    and when ``validate=False``. Returns the flattened int64 labels.
    """
    check_tensor("labels", labels)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ArgumentError(f"labels: expected an integer tensor, got dtype {labels.dtype}")
    if labels.shape != lead_shape:
        raise ArgumentError(f"labels: expected the leading shape of {like} [{', '.join(map(str, lead_shape))}], "
                         f"got {shape_str(labels)}")
    flat = labels.reshape(-1).long().contiguous()
    if validate and not torch.compiler.is_compiling() and flat.numel() > 0:
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= num_classes))
        if bool(bad.any()):
            first = int(flat[bad][0])
            raise ArgumentError(
                f"labels: expected values in [0, {num_classes}) or ignore_index={ignore_index}, got {first}"
            )
    return flat


def rows_per_chunk(n_cols: int, budget_bytes: int | None = None, multiple: int = 8) -> int:
    """Rows of an fp32 ``[rows, n_cols]`` block that fit ``budget_bytes`` (default ``TORCH_CHUNK_BYTES``, read at
    call time) — at least ``multiple``."""
    budget = TORCH_CHUNK_BYTES if budget_bytes is None else budget_bytes
    rows = budget // (4 * max(n_cols, 1))
    return max(multiple, (rows // multiple) * multiple)


def merge_partials(
    m: Float[Tensor, "S N"], s: Float[Tensor, "S N"], a: Float[Tensor, "S N"] | None
) -> tuple[Float[Tensor, " N"], Float[Tensor, " N"], Float[Tensor, " N"] | None]:
    """Merge stats of ``S`` disjoint vocabulary ranges into one ``(m, s, a)`` per row (see module docstring).

    Every range is non-empty, so each ``m`` is finite for finite inputs.
    """
    mm = m.amax(dim=0)
    w = torch.exp(m - mm)
    s_out = (w * s).sum(dim=0)
    a_out = None
    if a is not None:
        # An empty range has m = -inf and s = 0: its weight is 0 and its shift term must not become -inf·0.
        a_out = (w * (a + torch.where(s > 0, m - mm, 0.0) * s)).sum(dim=0)
    return mm, s_out, a_out


def allreduce_stats(
    m: Float[Tensor, " N"],
    s: Float[Tensor, " N"],
    a: Float[Tensor, " N"] | None,
    extra: Float[Tensor, "K N"] | None,
    group: Any,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Combine per-rank vocab-shard stats with two all-reduces: MAX of ``m``, then SUM of the rescaled ``s``, ``a``
    and of ``extra`` rows (e.g. the label logit, which is 0 on ranks that do not own the label)."""
    import torch.distributed as dist

    mg = m.clone()
    dist.all_reduce(mg, op=dist.ReduceOp.MAX, group=group)
    w = torch.exp(m - mg)
    parts = [w * s]
    if a is not None:
        parts.append(w * (a + (m - mg) * s))
    if extra is not None:
        parts.extend(extra.unbind(0))
    buf = torch.stack(parts)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    s_out = buf[0]
    a_out = buf[1] if a is not None else None
    k = 2 if a is not None else 1
    extra_out = buf[k:] if extra is not None else None
    return mg, s_out, a_out, extra_out


def shard_offset(weight_rows: int, group: Any) -> tuple[int, int]:
    """Vocabulary offset and full vocabulary size of this rank's shard (megatron layout: equal contiguous shards,
    rank r holds rows ``[r·V_local, (r+1)·V_local)``)."""
    if group is None:
        return 0, weight_rows
    import torch.distributed as dist

    rank = dist.get_rank(group=group)
    world = dist.get_world_size(group=group)
    return rank * weight_rows, weight_rows * world


def zero_ignored_rows(x: Tensor, valid: Tensor) -> Tensor:
    """``x`` with rows of ignored positions set to 0 (``torch.where``, so NaN/inf there cannot propagate)."""
    return torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def triton_dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE fp32 for fp32 inputs (1e-5 contract), native tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
