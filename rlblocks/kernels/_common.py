"""Host-side helpers shared by every kernel op: argument checks, backend choice, chunk sizes, the launch grid,
combining partial softmax stats, and the backward's vocab-chunk loop. Imports no triton (``_tiles.py`` holds the
Triton building blocks).

Conventions used by every op in this package:

- ``z = logits / temperature`` in fp32 (inputs may be fp32, bf16 or fp16; accumulation is always fp32).
- Per-row softmax statistics are carried as ``(m, s, a)`` with ``m = max_j z_j``, ``s = Σ_j exp(z_j − m)`` and
  ``a = Σ_j exp(z_j − m)·(z_j − m)``. Then ``lse = m + log s`` and the entropy is ``H = log s − a / s``.
  Partial stats over disjoint vocabulary ranges (Triton vocab tiles, or vocab-parallel ranks) are merged exactly by
  ``merge_partials`` / ``allreduce_stats``.
- ``−inf`` logits (a masked vocabulary entry) are valid input: they get probability 0 and add nothing to any sum
  (every ``0·(−inf)`` is guarded). A row whose logits are all ``−inf`` has no distribution and gives NaN.
- Rows whose label equals ``ignore_index`` (or whose ``mask`` is false) give 0 for every output and receive no
  gradient; their inputs are never read into a sum (NaN/inf there cannot leak).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import as_bool_mask, check_bool, check_floating, check_int, check_integer, check_real, shape_str
from rlblocks.errors import ArgumentError

# Bytes of fp32 logits one chunk of rows may hold in the torch path (per temporary). 64 MiB (512 rows at V=32768)
# keeps the chunk GEMMs efficient on CPU (at 16 MiB they ran ~1.7x slower here) while the extra memory stays a
# small fraction of the naive [N, V] path (measured 0.097x at T=4096, H=512, V=32768; benchmarks/kernels/results).
TORCH_CHUNK_BYTES = 64 << 20
# Bytes of the exp(z − m) temporary of the torch path's entropy sum (one column block of a chunk at a time, so the
# chunk needs no second [rows, V] buffer).
TORCH_COL_BLOCK_BYTES = 4 << 20
# Bytes of the [N, vocab-chunk] logits-gradient block the Triton backward may allocate (the cuBLAS contractions
# run once per block, so fewer, larger blocks are faster; 256 MiB is ~0.13x of bf16 logits at N=8192, V=131072).
TRITON_GRAD_CHUNK_BYTES = 256 << 20
# Bytes of the [rows, V] probability block the fused-loss path holds per row chunk (see linear_logprobs_loss.py).
FUSED_CHUNK_BYTES = 512 << 20

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


def check_same_device(**tensors: Tensor) -> torch.device:
    """All tensors on one device (a Triton kernel launches on one device and reads every pointer there)."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ArgumentError(f"{name}: expected the device of {first_name} ({first}), got {dev}")
    return first


def device_guard(t: Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s CUDA device current for a launch: Triton launches on the current device, so a tensor on
    ``cuda:1`` while ``cuda:0`` is current would otherwise be read from the wrong device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def check_float_input(name: str, x: Tensor) -> Tensor:
    check_floating(name, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise ArgumentError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def check_temperature(temperature: object) -> float:
    """A finite host number > 0 (Python or numpy int/float; a tensor would need a host sync, a bool is a mistake)."""
    return check_real("temperature", temperature, finite=True, gt=0)


def check_flags(**flags: object) -> None:
    """Each keyword a real ``True`` / ``False`` (``return_entropy="no"`` or ``1`` is a caller's mistake, and a
    truthy string would switch an output on)."""
    for name, value in flags.items():
        check_bool(name, value)


def check_labels(
    labels: Tensor, lead_shape: torch.Size, num_classes: int, ignore_index: int, *, like: str, validate: bool = True
) -> Int[Tensor, " N"]:
    """Check ``labels`` (integer, shape ``lead_shape``) and values in ``[0, num_classes)`` or ``== ignore_index``.

    The value check reads the tensor (one host sync of a single bool); it is skipped while ``torch.compile`` traces
    and when ``validate=False``. Returns the flattened int64 labels.
    """
    check_int("ignore_index", ignore_index, what="an int (the label value of ignored positions)")
    check_integer("labels", labels)
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


def apply_mask(
    labels: Int[Tensor, " N"], mask: Tensor | None, lead_shape: torch.Size, ignore_index: int, *, like: str
) -> Int[Tensor, " N"]:
    """Flat labels with ``ignore_index`` wherever ``mask`` (shape ``lead_shape``; bool or 0/1) is false, so a masked
    position is treated exactly like an ignored one: output 0, no gradient, its inputs never read into a sum."""
    if mask is None:
        return labels
    ref = torch.empty(lead_shape, device="meta")
    keep = as_bool_mask(mask, ref, name="mask", like_name=like).reshape(-1).to(labels.device)
    return torch.where(keep, labels, ignore_index)


def rows_per_chunk(n_cols: int, budget_bytes: int | None = None, multiple: int = 8) -> int:
    """Rows of an fp32 ``[rows, n_cols]`` block that fit ``budget_bytes`` (default ``TORCH_CHUNK_BYTES``, read at
    call time) — at least ``multiple``."""
    budget = TORCH_CHUNK_BYTES if budget_bytes is None else budget_bytes
    rows = budget // (4 * max(n_cols, 1))
    return max(multiple, (rows // multiple) * multiple)


def cols_per_block(n_rows: int, budget_bytes: int | None = None, multiple: int = 256) -> int:
    """Columns of an fp32 ``[n_rows, cols]`` block that fit ``budget_bytes`` (default ``TORCH_COL_BLOCK_BYTES``)."""
    budget = TORCH_COL_BLOCK_BYTES if budget_bytes is None else budget_bytes
    cols = budget // (4 * max(n_rows, 1))
    return max(multiple, (cols // multiple) * multiple)


def merge_partials(
    m: Float[Tensor, "S N"], s: Float[Tensor, "S N"], a: Float[Tensor, "S N"] | None
) -> tuple[Float[Tensor, " N"], Float[Tensor, " N"], Float[Tensor, " N"] | None]:
    """Merge stats of ``S`` disjoint vocabulary ranges into one ``(m, s, a)`` per row (see module docstring).

    A range whose logits are all ``−inf`` (``m = −inf``, ``s = 0``) adds nothing. fp32 throughout.
    """
    mm = m.amax(dim=0)
    mm_safe = torch.where(torch.isfinite(mm), mm, 0.0)  # an all −inf row stays −inf/NaN below, but raises nothing
    w = torch.exp(m - mm_safe)
    s_out = (w * s).sum(dim=0)
    a_out = None
    if a is not None:
        # An empty range has m = -inf and s = 0: its weight is 0 and its shift term must not become -inf·0.
        a_out = (w * (a + torch.where(s > 0, m - mm_safe, 0.0) * s)).sum(dim=0)
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
    mg_safe = torch.where(torch.isfinite(mg), mg, 0.0)
    w = torch.exp(m - mg_safe)
    parts = [w * s]
    if a is not None:
        parts.append(w * (a + torch.where(s > 0, m - mg_safe, 0.0) * s))
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


def zero_ignored_rows(x: Tensor, valid: Bool[Tensor, " N"]) -> Tensor:
    """``x`` with rows of ignored positions set to 0 (``torch.where``, so NaN/inf there cannot propagate)."""
    return torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def triton_dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact IEEE fp32 for fp32 inputs (1e-5 contract), native tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_splits(n: int, v: int, device: torch.device, row_block: int = 128) -> int:
    """Vocabulary splits of a (row block × vocab split) grid, so that it has about two programs per SM.

    Under the CPU interpreter 2 splits (when the vocabulary has more than one tile), so tests cover the merge."""
    if interpret_mode() or device.type != "cuda":
        return min(2, max(1, -(-v // 64)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row_blocks = max(1, -(-n // row_block))
    return max(1, min(-(-2 * sms // row_blocks), -(-v // 256)))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H100/H200 SXM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_count(n: int, v: int, block_n: int, block_v: int) -> int:
    """Output tiles of an ``[n, v]`` tile grid."""
    return -(-n // block_n) * -(-v // block_v)


def persistent_programs(n_tiles: int, device: torch.device, ctas_per_sm: int) -> int:
    """Programs of a persistent launch: one per resident CTA slot (SMs × ``ctas_per_sm``), never more than tiles.

    Each program walks the tile list with stride = program count, so the whole grid is resident at once (one
    wave) and programs differ by at most one tile of work. ``ctas_per_sm`` is the config's declared residency,
    which the static resource report checks against registers and shared memory. Under the CPU interpreter 3
    programs, so tests cover the stride loop and an uneven tail."""
    if device.type != "cuda":
        return max(1, min(n_tiles, 3))
    return max(1, min(n_tiles, num_sms(device) * ctas_per_sm))


def grad_scale(row_bound: Float[Tensor, " N"], dtype: torch.dtype, target: float = 2.0**14) -> Float[Tensor, " 1"]:
    """Power-of-two factor the logits gradient is multiplied by before it is stored in ``dtype`` (1 unless fp16).

    fp16 values of ``p·g`` with ``g ≈ 1/num_tokens`` fall into fp16's subnormal range or flush to 0, so an fp16
    gradient block is stored times ``2^e`` with ``2^e·max(row_bound) ≈ target`` and unscaled after the fp32-output
    GEMMs. ``row_bound`` is the caller's bound on ``|∂L/∂z_j|`` per row; ``target`` leaves headroom below fp16's
    max (65504). A power of two makes scaling and unscaling exact. No host sync (a device tensor); bf16 has fp32's
    range and fp32 needs nothing, so both get 1."""
    one = torch.ones(1, dtype=torch.float32, device=row_bound.device)
    if dtype != torch.float16 or row_bound.numel() == 0:
        return one
    top = row_bound.abs().amax().clamp_min(1e-30)
    return torch.exp2(torch.floor(torch.log2(target / top))).reshape(1).clamp(2.0**-100, 2.0**100)


def mm_fp32(a: Tensor, b: Tensor) -> Float[Tensor, "M N"]:
    """``a @ b`` with an fp32 result accumulated in fp32 (one rounding at the end, never through bf16/fp16).

    CUDA bf16/fp16: ``torch.mm(..., out_dtype=float32)`` (cuBLAS tensor cores, fp32 output; torch >= 2.8). Elsewhere
    (CPU, the interpreter tests, older torch) the operands are upcast and multiplied in fp32."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # this torch build has no fp32-output mm for these dtypes: the exact upcast below gives the same sums
    return torch.mm(a.float(), b.float())


def contract_grad_chunks(
    h: Float[Tensor, "N H"],
    w: Float[Tensor, "V H"],
    fill_chunk: Callable[[Tensor, int, int], None],
    need_h: bool,
    need_w: bool,
    scale: Float[Tensor, " 1"] | None = None,
    budget_bytes: int | None = None,
) -> tuple[Float[Tensor, "N H"] | None, Float[Tensor, "V H"] | None]:
    """The backward's vocab-chunk loop shared by the fused-linear ops.

    For each chunk ``[c0, c0 + c)`` of the vocabulary, ``fill_chunk(gz, c0, c)`` writes the logits gradient
    ``∂L/∂(h @ Wᵀ)`` of that chunk (times ``scale``) into ``gz [N, c]`` (dtype of ``h``: tensor-core GEMMs); then
    ``grad_hidden += gz @ W[c0:c0+c]`` (fp32 output and fp32 accumulation across chunks: ``mm_fp32``) and
    ``grad_weight[c0:c0+c] = gzᵀ @ h`` (each row written once). Returns fp32 ``grad_hidden`` and ``grad_weight``
    in ``w.dtype`` (unscaled), or ``None`` for what is not needed.
    """
    n, hdim = h.shape
    v = w.shape[0]
    gz_dtype = h.dtype
    elt = torch.empty((), dtype=gz_dtype).element_size()
    budget = TRITON_GRAD_CHUNK_BYTES if budget_bytes is None else budget_bytes
    vc = budget // max(1, n * elt)
    vc = min(v, max(128, (vc // 128) * 128))
    gbuf = torch.empty(n, vc, dtype=gz_dtype, device=h.device)
    gh = torch.zeros(n, hdim, dtype=torch.float32, device=h.device) if need_h else None
    gw = torch.empty_like(w) if need_w else None
    unscale = None if scale is None or h.dtype != torch.float16 else 1.0 / scale
    for c0 in range(0, v, vc):
        c = min(vc, v - c0)
        gz = gbuf[:, :c]
        fill_chunk(gz, c0, c)
        if need_w:
            if unscale is None:
                torch.mm(gz.t(), h, out=gw[c0 : c0 + c])
            else:
                gw[c0 : c0 + c] = mm_fp32(gz.t(), h).mul_(unscale)
        if need_h:
            gh += mm_fp32(gz, w[c0 : c0 + c])
    if need_h and unscale is not None:
        gh.mul_(unscale)
    return gh, gw

