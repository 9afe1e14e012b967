"""Blockwise FP8 weights for the rollout side: quantise on the way to the engine, dequantise (or load as FP8) there.

Format: the Hugging Face layout of DeepSeek-V3 and Qwen3-FP8 checkpoints, which vLLM's block-FP8 loader reads. A
quantised weight ``W`` of shape ``[..., M, N]`` (leading dimensions, e.g. the experts of a stacked MoE tensor, are
independent matrices) travels as two tensors:

* ``<name>``: ``torch.float8_e4m3fn`` of the same shape (finite range +-448, 3 mantissa bits, no infinities);
* ``<name>_scale_inv``: ``float32`` of shape ``[..., ceil(M / 128), ceil(N / 128)]``, one value per 128 x 128
  block, the *dequantisation multiplier*: ``W[i, j] ~= float32(q[i, j]) * scale_inv[i // 128, j // 128]``.

Quantisation of one block ``B`` (:func:`quantize_fp8`): ``s = float32(amax(|B|) / 448)``,
``q = e4m3(clamp(B / s, -448, 448))`` (saturating, round-to-nearest-even): the error of each element is at most
``amax / 28``, and relatively at most 1/16 of the element in e4m3's normal range. An all-zero block gets
``s = 1.0``; a NaN or an infinity anywhere in a weight is refused with its name
(:class:`~rlblocks.errors.ArgumentError`). A partial last block's scale is the amax of its real elements (what
zero-padding would give); nothing is padded on the wire. Dequantisation (:func:`dequantize_fp8`):
``float32(q) * scale_inv`` in float32, rounded once to the output dtype: bit-identical to vLLM's ``block_dequant``.

What stays in bf16 (:class:`FP8Rules`): embeddings, the LM head, norms, MoE routers and gates, biases; only floating
tensors with at least 2 dimensions named ``*.weight`` are candidates. :func:`quantize_named` turns a stream of
``(name, tensor)`` into the FP8 stream that every transport of :mod:`rlblocks.sync` carries bit-exactly;
``TorchEngine`` dequantises it, ``VLLMEngine`` loads it as FP8 into an engine started from
:func:`save_fp8_checkpoint`'s checkpoint. A bf16 weight costs ``2 M N`` bytes, its FP8 form
``M N + 4 ceil(M / 128) ceil(N / 128)``. Every rule, with the error bound derived: ``docs/sync.md`` (FP8).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.sync.buckets import TensorMeta

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "FP8Rules",
    "dequantize_fp8",
    "dequantize_named",
    "fp8_nbytes",
    "quantize_fp8",
    "quantize_named",
    "quantized_specs",
    "save_fp8_checkpoint",
    "scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
"""The FP8 format on the wire (OCP e4m3 without infinities: finite range +-448)."""

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value: the saturation bound, and the divisor of the block amax."""

BLOCK = (128, 128)
"""Default block: rows x columns of the weight covered by one scale (DeepSeek-V3 / Qwen3-FP8, vLLM's default)."""

SCALE_SUFFIX = "_scale_inv"
"""``<weight name> + SCALE_SUFFIX`` names a quantised weight's scales (``...down_proj.weight_scale_inv``)."""

DEFAULT_KEEP = (
    r"embed",  # embed_tokens, embed_in, word_embeddings, embed_out (the GPT-NeoX head)
    r"(^|\.)(wte|wpe)\.",  # GPT-2 style embeddings
    r"(^|\.)lm_head\.",
    r"^output\.weight$",  # a top-level output projection (original Llama layout)
    r"norm",  # every norm (layernorm, rmsnorm, q_norm, ...)
    r"(^|\.)ln_",  # GPT-2 style norms
    r"(^|\.)gate\.weight$",  # MoE routers: mlp.gate (Qwen-MoE, DeepSeek), block_sparse_moe.gate (Mixtral)
    r"router",
    r"shared_expert_gate",
    r"\.bias$",
)
"""Default :attr:`FP8Rules.keep` patterns (``re.search`` in the tensor's name)."""



def scale_shape(shape: Iterable[int], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of the scales of a weight of ``shape`` (``[..., M, N] -> [..., ceil(M / bm), ceil(N / bn)]``)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ArgumentError(f"shape: expected at least 2 dimensions, got {list(shape)}")
    bm, bn = _check_block(block)
    return (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bn))


def _check_matrix(name: str, x: Tensor) -> None:
    """The last two dimensions (the ``[M, N]`` matrix the blocks tile) are not empty."""
    if x.shape[-2] == 0 or x.shape[-1] == 0:
        raise ArgumentError(f"{name}: expected a [..., M, N] weight with M > 0 and N > 0, got {list(x.shape)}")


def _check_block(block: object) -> tuple[int, int]:
    if (
        not isinstance(block, tuple | list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ArgumentError(f"block: expected two positive ints (rows, columns), got {block!r}")
    return int(block[0]), int(block[1])


def _chunk_rows(n: int, bm: int, bn: int) -> int:
    """Rows per chunk: whole blocks, ~1 M float32 elements (4 MB, reused across chunks: fresh large allocations
    are page-faulted in, which costs more than the arithmetic)."""
    return max(bm, (1 << 20) // (-(-n // bn) * bn) // bm * bm)


def _load_f32(buf: Tensor, x: Tensor, bm: int) -> Tensor:
    """``x`` (a row chunk) copied as float32 into the reused buffer ``buf``, zero-padded to whole blocks."""
    mr, n = x.shape
    view = buf[: -(-mr // bm) * bm]
    if view.shape[0] != mr or view.shape[1] != n:
        view.zero_()  # zeros never raise an amax: the rule of the partial blocks
    view[:mr, :n].copy_(x)
    return view


def quantize_fp8(
    weight: Float[Tensor, "*batch M N"], *, block: tuple[int, int] = BLOCK, name: str = "weight"
) -> tuple[Shaped[Tensor, "*batch M N"], Float[Tensor, "*batch MB NB"]]:
    """Blockwise FP8 of ``weight``: ``(q, scale_inv)`` with ``q`` ``float8_e4m3fn`` of ``weight``'s shape and
    ``scale_inv`` ``float32`` of :func:`scale_shape` (see the module docstring for the formula, rounding, saturation
    and the last partial block). Runs on ``weight``'s device; ``name`` only labels errors.

    Raises :class:`~rlblocks.errors.ArgumentError` for a non-floating or 0/1-D tensor, a matrix with no rows or
    no columns (``M == 0`` or ``N == 0``: no block, no scale), and for NaN or infinite values (the message names
    ``name`` and counts them). Leading (``*batch``) dimensions of 0 give empty results.
    """
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() < 2:
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ArgumentError(f"{name}: expected a floating tensor with at least 2 dimensions, got {got}")
    _check_matrix(name, weight)
    bm, bn = _check_block(block)
    w = weight.detach()
    m, n = w.shape[-2], w.shape[-1]
    mats = w.reshape(-1, m, n)
    q = torch.empty(mats.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((mats.shape[0], -(-m // bm), -(-n // bn)), dtype=torch.float32, device=w.device)
    nb = s.shape[2]
    rows = _chunk_rows(n, bm, bn)
    buf = torch.empty((min(rows, -(-m // bm) * bm), nb * bn), dtype=torch.float32, device=w.device)
    for b in range(mats.shape[0]):
        for r0 in range(0, m, rows):
            x = _load_f32(buf, mats[b, r0 : r0 + rows], bm)
            mr, mb = min(rows, m - r0), x.shape[0] // bm
            blocks = x.view(mb, bm, nb, bn)
            # amax(|x|) as max(max, -min): two reductions instead of an |x| temporary
            amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), blocks.amin(dim=3).amin(dim=1).neg_())
            if not bool(torch.isfinite(amax).all()):
                bad = int((~torch.isfinite(w)).sum())
                raise ArgumentError(
                    f"{name}: {bad} of {w.numel()} values are not finite (NaN or inf); refused to quantise to FP8"
                )
            sc = amax / FP8_MAX
            sc = torch.where(sc > 0, sc, torch.ones_like(sc))  # all-zero (or underflowing) block: zeros, scale 1
            s[b, r0 // bm : r0 // bm + mb] = sc
            blocks.div_(sc[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
            q[b, r0 : r0 + mr].copy_(x[:mr, :n])  # round to nearest even onto the e4m3 grid
    return q.view(w.shape), s.view(scale_shape(w.shape, (bm, bn)))


def dequantize_fp8(
    q: Shaped[Tensor, "*batch M N"],
    scale_inv: Float[Tensor, "*batch MB NB"],
    *,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> Float[Tensor, "*batch M N"]:
    """``float32(q) * scale_inv`` per block (float32 products), rounded once to ``dtype``: the inverse of
    :func:`quantize_fp8` up to its rounding, bit-identical to vLLM's ``block_dequant`` / ``scaled_dequantize``.

    Checked (:class:`~rlblocks.errors.ArgumentError` naming ``name``): ``q`` is ``float8_e4m3fn`` with
    ``M, N > 0``, ``scale_inv`` is float32 of :func:`scale_shape`, every scale finite and positive. NaN bytes in
    ``q`` dequantise to NaN (the caller's finiteness check sees them).
    """
    bm, bn = _check_block(block)
    if not isinstance(q, Tensor) or q.dtype != FP8_DTYPE or q.dim() < 2:
        got = f"{q.dtype} {list(q.shape)}" if isinstance(q, Tensor) else type(q).__name__
        raise ArgumentError(f"{name}: expected a float8_e4m3fn tensor with at least 2 dimensions, got {got}")
    _check_matrix(name, q)
    want = scale_shape(q.shape, (bm, bn))
    if not isinstance(scale_inv, Tensor) or scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        got = f"{scale_inv.dtype} {list(scale_inv.shape)}" if isinstance(scale_inv, Tensor) else type(scale_inv)
        raise ArgumentError(f"{name}{SCALE_SUFFIX}: expected float32 scales of shape {list(want)}, got {got}")
    s = scale_inv.detach().to(q.device)
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        bad = int((~(torch.isfinite(s) & (s > 0))).sum())
        raise ArgumentError(f"{name}{SCALE_SUFFIX}: {bad} of {s.numel()} scales are not finite and positive")
    m, n = q.shape[-2], q.shape[-1]
    mats, scales = q.reshape(-1, m, n), s.reshape(-1, *want[-2:])
    out = torch.empty(mats.shape, dtype=dtype, device=q.device)
    nb = want[-1]
    rows = _chunk_rows(n, bm, bn)
    buf = torch.empty((min(rows, -(-m // bm) * bm), nb * bn), dtype=torch.float32, device=q.device)
    for b in range(mats.shape[0]):
        for r0 in range(0, m, rows):
            x = _load_f32(buf, mats[b, r0 : r0 + rows], bm)
            mr, mb = min(rows, m - r0), x.shape[0] // bm
            x.view(mb, bm, nb, bn).mul_(scales[b, r0 // bm : r0 // bm + mb][:, None, :, None])
            out[b, r0 : r0 + mr].copy_(x[:mr, :n])
    return out.view(q.shape)


@dataclass(frozen=True)
class FP8Rules:
    """Which tensors travel as FP8, and the block size (see "What stays in bf16" in the module docstring).

    A tensor is quantised when it is floating, has at least 2 dimensions, its name matches one of ``include``
    (``re.search``), none of ``keep``, and its module (the name without its last component) is not in ``modules``.
    ``FP8Rules(keep=DEFAULT_KEEP + (r"layers\\.0\\.",))`` also keeps the first layer in bf16;
    ``FP8Rules(keep=())`` quantises every 2-D ``.weight``.
    """

    keep: tuple[str, ...] = DEFAULT_KEEP
    include: tuple[str, ...] = (r"\.weight$",)
    modules: frozenset[str] = field(default_factory=frozenset)
    block: tuple[int, int] = BLOCK

    def __post_init__(self) -> None:
        for arg in ("keep", "include"):
            pats = getattr(self, arg)
            if isinstance(pats, str) or not all(isinstance(p, str) for p in pats):
                raise ArgumentError(f"{arg}: expected a tuple of regular expressions (str), got {pats!r}")
            try:
                compiled = tuple(re.compile(p) for p in pats)
            except re.error as e:
                raise ArgumentError(f"{arg}: not a valid regular expression ({e})") from None
            object.__setattr__(self, arg, tuple(pats))
            object.__setattr__(self, f"_{arg}_re", compiled)
        if isinstance(self.modules, str) or not all(isinstance(m, str) for m in self.modules):
            raise ArgumentError(f"modules: expected module names (str), got {self.modules!r}")
        object.__setattr__(self, "modules", frozenset(self.modules))
        object.__setattr__(self, "block", _check_block(self.block))

    def quantizes(self, name: str, shape: Iterable[int], dtype: torch.dtype) -> bool:
        """Whether the tensor ``name`` of ``shape`` and ``dtype`` travels as FP8 under these rules."""
        if not dtype.is_floating_point or dtype == FP8_DTYPE or len(tuple(shape)) < 2:
            return False
        if name.rpartition(".")[0] in self.modules:
            return False
        if not any(p.search(name) for p in self._include_re):  # type: ignore[attr-defined]
            return False
        return not any(p.search(name) for p in self._keep_re)  # type: ignore[attr-defined]

    def hf_config(self, kept_modules: Iterable[str] = ()) -> dict[str, Any]:
        """The ``quantization_config`` of a ``config.json`` for weights quantised by these rules (what vLLM's
        ``Fp8Config.from_config`` and transformers' ``FineGrainedFP8Config`` read). ``kept_modules``: modules
        whose 2-D weights stayed in bf16 (written as ``modules_to_not_convert``, which vLLM matches exactly)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
            "modules_to_not_convert": sorted(set(kept_modules) | self.modules),
        }

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], **overrides: Any) -> FP8Rules:
        """Rules for a checkpoint's ``quantization_config`` (block-FP8 only): its ``weight_block_size`` and its
        ``modules_to_not_convert`` / ``ignored_layers`` on top of the default ``keep`` patterns."""
        if not isinstance(config, Mapping) or "fp8" not in str(config.get("quant_method", "")):
            raise ArgumentError(f"config: expected a quantization_config with quant_method 'fp8', got {config!r:.200}")
        block = config.get("weight_block_size")
        if block is None:
            raise ArgumentError("config: weight_block_size is missing (per-tensor FP8 is not the block format)")
        modules = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
        return cls(modules=frozenset(modules), block=tuple(block), **overrides)


def quantize_named(
    named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], *, rules: FP8Rules | None = None
) -> Iterator[tuple[str, Tensor]]:
    """The FP8 form of a stream of ``(name, tensor)``: each tensor that ``rules`` quantises becomes
    ``(name, q)`` then ``(name + SCALE_SUFFIX, scale_inv)``; every other tensor passes through unchanged (same
    object). Lazy: one tensor is quantised at a time, on its own device. A scale name that collides with an input
    name is refused."""
    rules = FP8Rules() if rules is None else rules
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: set[str] = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ArgumentError(f"named_tensors: expected (str, Tensor) pairs, got {type(item).__name__}")
        name, t = item
        if not isinstance(t, Tensor):
            raise ArgumentError(f"named_tensors[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if name in seen:
            raise ArgumentError(f"named_tensors: {name!r} appears twice (or is the scale name of another weight)")
        seen.add(name)
        if rules.quantizes(name, t.shape, t.dtype):
            if name + SCALE_SUFFIX in seen:
                raise ArgumentError(f"named_tensors: {name + SCALE_SUFFIX!r} is both a tensor and {name!r}'s scales")
            seen.add(name + SCALE_SUFFIX)
            q, s = quantize_fp8(t, block=rules.block, name=name)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def quantized_specs(specs: Iterable[TensorMeta], *, rules: FP8Rules | None = None) -> list[TensorMeta]:
    """The manifest of :func:`quantize_named`'s output from the manifest of its input (names, shapes, dtypes;
    offsets 0): what ``WeightSender.send(..., manifest=)`` needs to stream the FP8 form of a generator."""
    rules = FP8Rules() if rules is None else rules
    out = []
    for m in specs:
        if rules.quantizes(m.name, m.shape, m.dtype):
            out.append(TensorMeta(m.name, tuple(m.shape), FP8_DTYPE, 0))
            out.append(TensorMeta(m.name + SCALE_SUFFIX, scale_shape(m.shape, rules.block), torch.float32, 0))
        else:
            out.append(TensorMeta(m.name, tuple(m.shape), m.dtype, 0))
    return out


def dequantize_named(
    named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
    *,
    dtype: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
    block: tuple[int, int] = BLOCK,
    own: Mapping[str, torch.dtype] | Container[str] = (),
) -> list[tuple[str, Tensor]]:
    """Receiver side: fold every FP8 pair ``(name, q)`` + ``(name + SCALE_SUFFIX, scale_inv)`` into one
    ``(name, dequantize_fp8(q, scale_inv))`` (at the weight's place; other tensors unchanged, in order).

    ``dtype``: the output dtype, or ``{name: dtype}`` (the receiver's weight dtypes; float32 for names it lacks).
    ``own``: names the receiver holds as tensors of its own (e.g. its ``state_dict()``; a mapping also gives their
    dtypes); a ``*_scale_inv`` tensor whose name is one of them is a weight, not a scale, and passes through (an
    FP8 model receiving its own FP8 weights), as does a float8 tensor the receiver holds as float8.

    Refused (:class:`~rlblocks.errors.ArgumentError`, nothing returned): a float8 tensor without its scales, scales
    without their float8 weight, scales of the wrong dtype or shape for ``block`` (:func:`scale_shape`), a scale
    that is not finite and positive, a name given twice.
    """
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    by_name: dict[str, Tensor] = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ArgumentError(f"named_tensors: expected (str, Tensor) pairs, got {type(item).__name__}")
        if not isinstance(item[1], Tensor):
            raise ArgumentError(f"named_tensors[{item[0]!r}]: expected a torch.Tensor, got {type(item[1]).__name__}")
        if item[0] in by_name:
            raise ArgumentError(f"named_tensors: {item[0]!r} is given more than once")
        by_name[item[0]] = item[1]
    own_dtypes = own if isinstance(own, Mapping) else {}
    scales = {n for n in by_name if n.endswith(SCALE_SUFFIX) and n not in own}
    out: list[tuple[str, Tensor]] = []
    for name, t in items:
        if name in scales:
            weight = name[: -len(SCALE_SUFFIX)]
            w = by_name.get(weight)
            if w is None or w.dtype != FP8_DTYPE:
                got = "absent" if w is None else f"{w.dtype}"
                raise ArgumentError(f"named_tensors: {name!r} are FP8 scales, but their weight {weight!r} is {got} "
                                    f"(expected {FP8_DTYPE})")
            continue
        if t.dtype == FP8_DTYPE and name + SCALE_SUFFIX in scales:
            want = dtype.get(name, torch.float32) if isinstance(dtype, Mapping) else dtype
            out.append((name, dequantize_fp8(t, by_name[name + SCALE_SUFFIX], block=block, dtype=want, name=name)))
        elif t.dtype == FP8_DTYPE and own_dtypes.get(name) != FP8_DTYPE:
            raise ArgumentError(
                f"named_tensors: {name!r} is {FP8_DTYPE} but its scales {name + SCALE_SUFFIX!r} are not in the update "
                "(an FP8 weight needs its block scales)"
            )
        else:
            out.append((name, t))
    return out


def save_fp8_checkpoint(
    named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
    out_dir: str | Path,
    *,
    config_dir: str | Path,
    rules: FP8Rules | None = None,
    max_shard_bytes: int = 4 << 30,
) -> list[str]:
    """Write a block-FP8 Hugging Face checkpoint (``model*.safetensors`` + ``config.json`` with the
    ``quantization_config`` of :meth:`FP8Rules.hf_config`) that vLLM starts from with block-FP8 quantisation.

    ``named_tensors``: the model's checkpoint-format weights (``state_dict()`` names; tied aliases should be
    given once, as in a saved checkpoint). ``config_dir``: a checkpoint directory whose ``config.json`` is copied
    (plus tokenizer and generation files). Every 2-D weight that ``rules`` keeps is listed in
    ``modules_to_not_convert``, so that a reader applies the same split. Returns the names written, in order.
    """
    from safetensors.torch import save_file

    rules = FP8Rules() if rules is None else rules
    src, out = Path(config_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise ArgumentError(f"config_dir: expected a directory with a config.json, got {str(src)!r}")
    out.mkdir(parents=True, exist_ok=True)
    kept: set[str] = set()
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors

    def note_kept(stream: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for n, t in stream:
            if t.dim() >= 2 and n.endswith(".weight") and not rules.quantizes(n, t.shape, t.dtype):
                kept.add(n.rpartition(".")[0])
            yield n, t

    names = []
    for name, t in quantize_named(note_kept(items), rules=rules):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
        names.append(name)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    for fname, shard in zip(files, shards):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = rules.hf_config(kept)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja"
            )):
                shutil.copy2(f, out / f.name)
    return names


def fp8_nbytes(shape: Iterable[int], block: tuple[int, int] = BLOCK) -> int:
    """Bytes of a weight of ``shape`` in FP8 plus its scales (``prod(shape) + 4 * prod(scale_shape)``)."""
    shape = tuple(shape)
    return math.prod(shape) + 4 * math.prod(scale_shape(shape, block))
