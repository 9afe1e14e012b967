"""Name and layout conversion between megatron-core ``GPTModel`` and HF Llama / Qwen2 state dicts.

Layouts (megatron-core 0.16.1, checked against ``GPTModel`` logits; ``nq`` query heads, ``ng`` query groups = KV
heads, ``q = nq // ng`` query heads per group, ``d`` head dim, ``h`` hidden, ``f`` FFN size, ``t`` TP size):

* ``linear_qkv.weight [ng*(q+2)*d, h]``: for each group ``g`` the rows ``[q_heads(g) ; k_g ; v_g]``, groups in order.
  TP rank ``r`` holds the contiguous groups ``r*ng/t .. (r+1)*ng/t`` (so ``ng % t == 0``). ``linear_qkv.bias``
  (Qwen2, or Llama with ``attention_bias``) is interleaved the same way.
* ``linear_fc1.weight [2f, h]`` is ``[gate ; up]``; at TP>1 rank ``r`` holds ``[gate_r ; up_r]`` where ``gate_r`` is
  the r-th of ``t`` row blocks of gate. A contiguous split of the full fc1 would be wrong.
* Column-parallel (qkv, fc1) split dim 0; row-parallel (``linear_proj`` = o_proj, ``linear_fc2`` = down_proj) split
  dim 1; their biases are not split. Embedding and ``output_layer`` are vocab-parallel (dim 0). megatron-core does
  not pad the vocabulary itself (Megatron-LM's ``--make-vocab-size-divisible-by`` does): pass ``padded_vocab_size``
  to append zero rows; ``megatron_to_hf`` trims rows beyond ``vocab_size``.
* Norm weights are replicated. The local spec names them ``input_layernorm`` / ``pre_mlp_layernorm``; the
  Transformer Engine spec fuses them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``
  (``spec="te"``). ``megatron_to_hf`` accepts both.
* Tied embeddings (``tie_word_embeddings``): megatron keeps no ``output_layer.weight`` when the first and last
  pipeline stage coincide; a last stage that is not the first holds a copy, which comes back as ``lm_head.weight``.
* Pipeline stages hold ``decoder.layers.{local}`` where HF layer = local + stage offset. The first stage holds the
  embedding; the last holds ``decoder.final_layernorm`` and ``output_layer``. Stages split the layers evenly unless
  ``pp_layers`` gives the count per stage. For interleaved (virtual) pipelines pass ``pp_size = pp * vpp`` and
  ``pp_rank = chunk * pp + rank``: virtual stages are ordered that way.
* ``*._extra_state`` entries of megatron state dicts are skipped; every other name must be known or an
  :class:`~rlblocks.errors.ArgumentError` (a ``ValueError``) is raised; nothing is dropped silently (HF tensors
  belonging to other pipeline stages are read and skipped, which is the point of a stage).

Rotary embeddings need no permutation (both rotate halves). ``hf_config``: what :func:`gpt_dims` reads. Values are
never cast; outputs are contiguous and may share storage with the inputs (clone before editing in place).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Shaped
from torch import Tensor

from rlblocks.errors import ArgumentError, SyncMismatchError

__all__ = ["GPTDims", "gpt_dims", "hf_to_megatron", "megatron_to_hf", "megatron_to_hf_streaming"]

AnyTensor = Shaped[Tensor, "..."]

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXTRA = "._extra_state"

_HF_EMBED, _HF_NORM, _HF_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_MG_EMBED, _MG_NORM = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"
_MG_OUT = "output_layer.weight"

# Megatron layer suffix -> (layout kind, HF layer suffixes it holds). Kinds: qkv, fc1, row (split dim 1), rep.
_MG_LAYER_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "self_attention.linear_proj.bias": ("rep", ("self_attn.o_proj.bias",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc1.bias": ("fc1", ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": ("rep", ("mlp.down_proj.bias",)),
    "input_layernorm.weight": ("rep", ("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("rep", ("post_attention_layernorm.weight",)),
    # Transformer Engine spec: norms fused into the following linear.
    "self_attention.linear_qkv.layer_norm_weight": ("rep", ("input_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("rep", ("post_attention_layernorm.weight",)),
}
_NORM_NAMES = {
    "local": {"input_layernorm.weight": "input_layernorm.weight",
              "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"},
    "te": {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
           "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"},
}
# HF layer suffix -> megatron layer suffix (norms depend on the spec and are filled in per call).
_HF_TO_MG_LAYER = {hf: mg for mg, (_, hfs) in _MG_LAYER_KINDS.items() for hf in hfs if "layernorm" not in hf}


@dataclass(frozen=True)
class GPTDims:
    """The sizes of a Llama/Qwen2-style model that fix every tensor's shape (read from an HF config)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    qkv_bias: bool
    proj_bias: bool
    mlp_bias: bool


def _field(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    return default if value is None else value


def gpt_dims(hf_config: Any) -> GPTDims:
    """Read the sizes from an HF Llama/Qwen2 config object or dict: ``model_type`` (``llama`` / ``qwen2``),
    ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    optionally ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``."""
    model_type = _field(hf_config, "model_type")
    if model_type not in ("llama", "qwen2"):
        raise ArgumentError(f"hf_config: expected model_type 'llama' or 'qwen2', got {model_type!r}")
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if _field(hf_config, k) is None]
    if missing:
        raise ArgumentError(f"hf_config: missing required field(s) {missing}")
    heads = int(_field(hf_config, "num_attention_heads"))
    kv = int(_field(hf_config, "num_key_value_heads", heads))
    hidden = int(_field(hf_config, "hidden_size"))
    if heads % kv:
        raise ArgumentError(
            f"hf_config: num_attention_heads ({heads}) must be a "
            f"multiple of num_key_value_heads ({kv})"
        )
    attn_bias = bool(_field(hf_config, "attention_bias", False))
    return GPTDims(
        model_type=model_type,
        vocab_size=int(_field(hf_config, "vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=int(_field(hf_config, "intermediate_size")),
        num_layers=int(_field(hf_config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(_field(hf_config, "head_dim", hidden // heads)),
        tie_embeddings=bool(_field(hf_config, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers q, k, v and o.
        qkv_bias=model_type == "qwen2" or attn_bias,
        proj_bias=model_type == "llama" and attn_bias,
        mlp_bias=bool(_field(hf_config, "mlp_bias", False)),
    )


def _stage(dims: GPTDims, pp_size: int, pp_rank: int, pp_layers: Sequence[int] | None) -> tuple[int, int, bool, bool]:
    """Return (first HF layer, number of layers, holds embedding, holds final norm / output) of a pipeline stage."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ArgumentError(f"pp_rank: expected 0 <= pp_rank < pp_size with pp_size >= 1, got {pp_rank=} {pp_size=}")
    if pp_layers is None:
        if dims.num_layers % pp_size:
            raise ArgumentError(
                f"pp_size: {dims.num_layers} layers do not split evenly over {pp_size} stages; pass pp_layers"
            )
        pp_layers = [dims.num_layers // pp_size] * pp_size
    pp_layers = [int(n) for n in pp_layers]
    if len(pp_layers) != pp_size or sum(pp_layers) != dims.num_layers or min(pp_layers) < 0:
        raise ArgumentError(
            f"pp_layers: expected {pp_size} non-negative counts summing to {dims.num_layers}, got {pp_layers}"
        )
    return sum(pp_layers[:pp_rank]), pp_layers[pp_rank], pp_rank == 0, pp_rank == pp_size - 1


def _hf_layer_shapes(dims: GPTDims) -> dict[str, tuple[int, ...]]:
    d, h, f = dims.head_dim, dims.hidden_size, dims.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (dims.num_heads * d, h),
        "self_attn.k_proj.weight": (dims.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (dims.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, dims.num_heads * d),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if dims.qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (dims.num_heads * d,), "self_attn.k_proj.bias": (dims.num_kv_heads * d,),
                   "self_attn.v_proj.bias": (dims.num_kv_heads * d,)}
    if dims.proj_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if dims.mlp_bias:
        shapes |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)}
    return shapes


def _check_tp(dims: GPTDims, tp_size: int) -> None:
    for what, n in (("num_key_value_heads", dims.num_kv_heads), ("num_attention_heads", dims.num_heads),
                    ("intermediate_size", dims.ffn_hidden_size)):
        if n % tp_size:
            raise ArgumentError(f"tp_size: {what} ({n}) must be divisible by tp_size ({tp_size})")


def _check_shape(name: str, t: Any, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(t, Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ArgumentError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    return t


# ----------------------------------------------------------------------------------------------------------------
# HF -> megatron
# ----------------------------------------------------------------------------------------------------------------


def _vocab_shard(t: Tensor, padded: int, tp_size: int, tp_rank: int) -> Tensor:
    per = padded // tp_size
    lo, hi = tp_rank * per, (tp_rank + 1) * per
    if hi <= t.shape[0]:
        return t[lo:hi].contiguous()
    out = t.new_zeros((per, *t.shape[1:]))
    if lo < t.shape[0]:
        out[: t.shape[0] - lo] = t[lo:]
    return out


def _qkv_shard(q: Tensor, k: Tensor, v: Tensor, dims: GPTDims, tp_size: int, tp_rank: int) -> Tensor:
    ng, d = dims.num_kv_heads, dims.head_dim
    per_group = dims.num_heads // ng
    g0, g1 = tp_rank * ng // tp_size, (tp_rank + 1) * ng // tp_size
    rest = q.shape[1:]
    parts = (q.reshape(ng, per_group * d, *rest)[g0:g1], k.reshape(ng, d, *rest)[g0:g1],
             v.reshape(ng, d, *rest)[g0:g1])
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _fc1_shard(gate: Tensor, up: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    return torch.cat((gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]), dim=0)


def hf_to_megatron(
    named_tensors: Iterable[tuple[str, AnyTensor]],
    hf_config: Any,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    pp_layers: Sequence[int] | None = None,
    padded_vocab_size: int | None = None,
    spec: Literal["local", "te"] = "local",
) -> Iterator[tuple[str, AnyTensor]]:
    """Yield the megatron-core ``GPTModel`` state of one (TP rank, PP stage) from full HF Llama/Qwen2 tensors.

    ``named_tensors`` streams full HF tensors (``model.embed_tokens.weight``, ``model.layers.{i}...``,
    ``model.norm.weight``, ``lm_head.weight``) in any order. Tensors are converted as soon as they are complete:
    q/k/v of a layer (and gate/up) are held until all parts have arrived, then merged into this rank's
    ``linear_qkv`` (``linear_fc1``) shard, so memory stays near one layer when the input is ordered by layer.
    Names are megatron-core's local names (``decoder.layers.{i - stage offset}``) without ``_extra_state`` entries,
    ready for ``GPTModel.load_state_dict(..., strict=False)`` (strict fails only on the ``_extra_state`` keys).

    Conventions: see the module docstring. ``padded_vocab_size`` (default ``vocab_size``) must be a multiple of
    ``tp_size``; the embedding / output rows ``vocab_size..padded_vocab_size`` are zeros. With tied embeddings,
    ``lm_head.weight`` is optional; if given it must equal ``model.embed_tokens.weight`` bit for bit.
    HF tensors of layers outside this stage are validated and skipped. Raises ``ArgumentError`` for an unknown or
    duplicated name, a wrong shape, or (at the end) a missing tensor that this stage needs.
    """
    dims = gpt_dims(hf_config)
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ArgumentError(f"tp_rank: expected 0 <= tp_rank < tp_size with tp_size >= 1, got {tp_rank=} {tp_size=}")
    _check_tp(dims, tp_size)
    if spec not in _NORM_NAMES:
        raise ArgumentError(f"spec: expected 'local' or 'te', got {spec!r}")
    padded = dims.vocab_size if padded_vocab_size is None else int(padded_vocab_size)
    if padded < dims.vocab_size or padded % tp_size:
        raise ArgumentError(
            f"padded_vocab_size: expected a multiple of tp_size ({tp_size}) that is >= vocab_size "
            f"({dims.vocab_size}), got {padded}"
        )
    offset, count, first, last = _stage(dims, pp_size, pp_rank, pp_layers)
    layer_shapes = _hf_layer_shapes(dims)
    hf_to_mg_layer = _HF_TO_MG_LAYER | {hf: mg for hf, mg in _NORM_NAMES[spec].items()}
    vocab_shape = (dims.vocab_size, dims.hidden_size)
    out_needed = last and (not dims.tie_embeddings or not first)

    needed: set[str] = {f"model.layers.{i}.{s}" for i in range(offset, offset + count) for s in layer_shapes}
    if first or (out_needed and dims.tie_embeddings):
        needed.add(_HF_EMBED)
    if last:
        needed.add(_HF_NORM)
    if out_needed and not dims.tie_embeddings:
        needed.add(_HF_HEAD)

    seen: set[str] = set()
    pending: dict[tuple[int, str], dict[str, Tensor]] = {}
    tied_ref: dict[str, Tensor] = {}

    for name, t in named_tensors:
        if name in seen:
            raise ArgumentError(f"named_tensors: duplicate tensor name {name!r}")
        m = _HF_LAYER.match(name)
        if m:
            layer, suffix = int(m.group(1)), m.group(2)
            if suffix not in layer_shapes or layer >= dims.num_layers:
                raise ArgumentError(f"named_tensors: unknown HF tensor {name!r} for {dims.model_type} ({dims})")
            _check_shape(name, t, layer_shapes[suffix])
            seen.add(name)
            if not offset <= layer < offset + count:
                continue  # belongs to another pipeline stage
            mg_suffix = hf_to_mg_layer[suffix]
            kind, parts = _MG_LAYER_KINDS[mg_suffix]
            mg_name = f"decoder.layers.{layer - offset}.{mg_suffix}"
            if kind in ("qkv", "fc1"):
                group = pending.setdefault((layer, mg_suffix), {})
                group[suffix] = t
                if len(group) < len(parts):
                    continue
                del pending[(layer, mg_suffix)]
                tensors = [group[p] for p in parts]
                if kind == "qkv":
                    yield mg_name, _qkv_shard(*tensors, dims, tp_size, tp_rank)
                else:
                    yield mg_name, _fc1_shard(*tensors, tp_size, tp_rank)
            elif kind == "row":
                yield mg_name, t.chunk(tp_size, dim=1)[tp_rank].contiguous()
            else:
                yield mg_name, t.contiguous()
            continue
        if name in (_HF_EMBED, _HF_HEAD):
            _check_shape(name, t, vocab_shape)
            seen.add(name)
            if dims.tie_embeddings:
                other = _HF_HEAD if name == _HF_EMBED else _HF_EMBED
                if other in tied_ref and not torch.equal(tied_ref.pop(other), t):
                    raise ArgumentError(f"{name}: tie_word_embeddings is set but {name} differs from {other}")
                if other not in seen:
                    tied_ref[name] = t
                if name == _HF_HEAD:
                    continue  # an alias of the embedding, checked for equality above
                if first:
                    yield _MG_EMBED, _vocab_shard(t, padded, tp_size, tp_rank)
                if out_needed:
                    yield _MG_OUT, _vocab_shard(t, padded, tp_size, tp_rank)
            elif name == _HF_EMBED and first:
                yield _MG_EMBED, _vocab_shard(t, padded, tp_size, tp_rank)
            elif name == _HF_HEAD and last:
                yield _MG_OUT, _vocab_shard(t, padded, tp_size, tp_rank)
            continue
        if name == _HF_NORM:
            _check_shape(name, t, (dims.hidden_size,))
            seen.add(name)
            if last:
                yield _MG_NORM, t.contiguous()
            continue
        raise ArgumentError(f"named_tensors: unknown HF tensor name {name!r} for model_type {dims.model_type!r}")

    missing = sorted(needed - seen)
    if missing:
        raise ArgumentError(
            f"named_tensors: missing {len(missing)} tensor(s) needed by pp_rank {pp_rank}: {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )


# ----------------------------------------------------------------------------------------------------------------
# megatron -> HF
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MgTensor:
    """How one megatron name maps back to HF: layout kind, HF names, expected per-rank shard shape."""

    kind: str  # qkv, fc1, row, col (plain dim-0 split), vocab, rep
    hf_names: tuple[str, ...]
    shard_shape: tuple[int, ...]


def _mg_info(name: str, dims: GPTDims, tp: int, offset: int, count: int, first: bool, last: bool) -> _MgTensor:
    h, d = dims.hidden_size, dims.head_dim
    if name in (_MG_EMBED, _MG_OUT):
        if (name == _MG_EMBED and not first) or (name == _MG_OUT and not last):
            raise ArgumentError(f"per_rank: {name!r} does not belong on this pipeline stage")
        hf = _HF_EMBED if name == _MG_EMBED else _HF_HEAD
        return _MgTensor("vocab", (hf,), (-1, h))
    if name == _MG_NORM:
        if not last:
            raise ArgumentError(f"per_rank: {name!r} does not belong on this pipeline stage")
        return _MgTensor("rep", (_HF_NORM,), (h,))
    m = _MG_LAYER.match(name)
    if not m or m.group(2) not in _MG_LAYER_KINDS:
        raise ArgumentError(f"per_rank: unknown megatron-core tensor name {name!r}")
    local, suffix = int(m.group(1)), m.group(2)
    if local >= count:
        raise ArgumentError(f"per_rank: {name!r} has layer index {local} but this pipeline stage holds {count} layers")
    kind, hf_suffixes = _MG_LAYER_KINDS[suffix]
    hf_names = tuple(f"model.layers.{local + offset}.{s}" for s in hf_suffixes)
    rows = {
        "qkv": dims.num_kv_heads * (dims.num_heads // dims.num_kv_heads + 2) * d // tp,
        "fc1": 2 * dims.ffn_hidden_size // tp,
    }
    if kind in rows:
        shape: tuple[int, ...] = (rows[kind], h) if suffix.endswith("weight") else (rows[kind],)
    elif kind == "row":
        cols = dims.num_heads * d if "linear_proj" in suffix else dims.ffn_hidden_size
        shape = (h, cols // tp)
    else:
        shape = (h,)
    return _MgTensor(kind, hf_names, shape)


def _mg_required(dims: GPTDims, count: int, first: bool, last: bool) -> list[tuple[str, ...]]:
    """Megatron names a stage must hold; each entry lists alternatives (local or TE norm names)."""
    req: list[tuple[str, ...]] = []
    per_layer: list[tuple[str, ...]] = [
        ("self_attention.linear_qkv.weight",), ("self_attention.linear_proj.weight",), ("mlp.linear_fc1.weight",),
        ("mlp.linear_fc2.weight",), ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
        ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ]
    if dims.qkv_bias:
        per_layer.append(("self_attention.linear_qkv.bias",))
    if dims.proj_bias:
        per_layer.append(("self_attention.linear_proj.bias",))
    if dims.mlp_bias:
        per_layer += [("mlp.linear_fc1.bias",), ("mlp.linear_fc2.bias",)]
    for i in range(count):
        req += [tuple(f"decoder.layers.{i}.{s}" for s in alts) for alts in per_layer]
    if first:
        req.append((_MG_EMBED,))
    if last:
        req.append((_MG_NORM,))
        if not dims.tie_embeddings:
            req.append((_MG_OUT,))
    return req


def _merge(name: str, info: _MgTensor, shards: Sequence[Tensor], dims: GPTDims) -> list[tuple[str, Tensor]]:
    """Merge the TP shards of one megatron tensor into full HF tensors."""
    for r, s in enumerate(shards):
        want = info.shard_shape
        if len(s.shape) != len(want) or any(w not in (-1, g) for w, g in zip(want, s.shape)):
            raise ArgumentError(f"per_rank[{r}][{name!r}]: expected shape {list(want)} (-1: any), got {list(s.shape)}")
    if info.kind == "rep":
        for r, s in enumerate(shards[1:], start=1):
            if not torch.equal(s, shards[0]):
                raise ArgumentError(f"per_rank[{r}][{name!r}]: replicated tensor differs from TP rank 0")
        return [(info.hf_names[0], shards[0].contiguous())]
    if info.kind == "row":
        return [(info.hf_names[0], torch.cat(list(shards), dim=1))]
    if info.kind == "vocab":
        full = torch.cat(list(shards), dim=0)
        if full.shape[0] < dims.vocab_size:
            raise ArgumentError(f"per_rank[*][{name!r}]: {full.shape[0]} vocab rows in all, fewer than vocab_size "
                             f"{dims.vocab_size}")
        return [(info.hf_names[0], full[: dims.vocab_size].contiguous() if full.shape[0] > dims.vocab_size else full)]
    if info.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([a for a, _ in halves], dim=0)
        up = torch.cat([b for _, b in halves], dim=0)
        return [(info.hf_names[0], gate), (info.hf_names[1], up)]
    # qkv: rows are [q heads ; k ; v] per query group, groups in rank order.
    ng, d = dims.num_kv_heads, dims.head_dim
    per_group = dims.num_heads // ng
    full = torch.cat(list(shards), dim=0)
    rest = full.shape[1:]
    grouped = full.reshape(ng, (per_group + 2) * d, *rest)
    q = grouped[:, : per_group * d].reshape(-1, *rest).contiguous()
    k = grouped[:, per_group * d : (per_group + 1) * d].reshape(-1, *rest).contiguous()
    v = grouped[:, (per_group + 1) * d :].reshape(-1, *rest).contiguous()
    return [(info.hf_names[0], q), (info.hf_names[1], k), (info.hf_names[2], v)]


class _Consumed:
    """Tracks the names of a stage seen so far and checks completeness at the end."""

    def __init__(self, dims: GPTDims, count: int, first: bool, last: bool) -> None:
        self.required = _mg_required(dims, count, first, last)
        self.seen: set[str] = set()

    def add(self, name: str) -> None:
        if name in self.seen:
            raise ArgumentError(f"per_rank: duplicate tensor name {name!r}")
        self.seen.add(name)

    def finish(self, where: str) -> None:
        missing = [alts[0] for alts in self.required if not any(a in self.seen for a in alts)]
        if missing:
            raise ArgumentError(f"{where}: missing {len(missing)} megatron tensor(s): {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))


def megatron_to_hf(
    per_rank: Sequence[Mapping[str, AnyTensor]],
    hf_config: Any,
    *,
    pp_size: int = 1,
    pp_rank: int = 0,
    pp_layers: Sequence[int] | None = None,
) -> Iterator[tuple[str, AnyTensor]]:
    """Yield full HF Llama/Qwen2 tensors from the megatron-core state dicts of all TP ranks of one PP stage.

    ``per_rank[r]`` is TP rank ``r``'s ``GPTModel.state_dict()`` (or any mapping with the same names); entries
    ending in ``._extra_state`` are skipped. Tensors are merged one megatron name at a time (order of
    ``per_rank[0]``), so the extra memory is one full parameter. HF layer = local layer + stage offset (see
    ``pp_layers`` in :func:`hf_to_megatron`); call once per stage and chain the iterators for a whole model.
    Vocabulary rows beyond ``vocab_size`` (megatron padding) are trimmed. With tied embeddings, a last stage
    that is not the first yields its ``output_layer.weight`` copy as ``lm_head.weight``.

    Raises ``ArgumentError`` (a ``ValueError``) when ranks hold different names, a name is unknown or on the wrong
    stage, a shard shape is wrong, replicated tensors (norms, row-parallel biases) differ between ranks, or a
    needed tensor is missing.
    """
    dims = gpt_dims(hf_config)
    if not isinstance(per_rank, Sequence) or isinstance(per_rank, Mapping) or not per_rank:
        raise ArgumentError(
            f"per_rank: expected a non-empty sequence of mappings "
            f"(one per TP rank), got {per_rank!r:.80}"
        )
    tp = len(per_rank)
    _check_tp(dims, tp)
    offset, count, first, last = _stage(dims, pp_size, pp_rank, pp_layers)
    names = [n for n in per_rank[0] if not n.endswith(_EXTRA)]
    name_set = set(names)
    for r, sd in enumerate(per_rank):
        other = {n for n in sd if not n.endswith(_EXTRA)}
        if other != name_set:
            diff = sorted(other ^ name_set)
            raise ArgumentError(f"per_rank[{r}]: names differ from per_rank[0]: {diff[:8]}")
    consumed = _Consumed(dims, count, first, last)
    infos = {}
    for name in names:  # validate every name before yielding anything
        infos[name] = _mg_info(name, dims, tp, offset, count, first, last)
        consumed.add(name)
    consumed.finish("per_rank")
    for name in names:
        shards = [_check_shape_any(f"per_rank[{r}][{name!r}]", sd[name]) for r, sd in enumerate(per_rank)]
        yield from _merge(name, infos[name], shards, dims)


def _check_shape_any(name: str, t: Any) -> Tensor:
    if not isinstance(t, Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def megatron_to_hf_streaming(
    named_local_tensors: Iterable[tuple[str, AnyTensor]],
    hf_config: Any,
    *,
    tp_group: Any = None,
    pp_size: int = 1,
    pp_rank: int = 0,
    pp_layers: Sequence[int] | None = None,
) -> Iterator[tuple[str, AnyTensor]]:
    """Inside a live TP group, yield full HF tensors by all-gathering one megatron parameter at a time.

    Every rank of ``tp_group`` (a ``torch.distributed`` group; ``None`` = the default group) iterates its own local
    tensors (e.g. ``model.state_dict().items()``; ``._extra_state`` entries skipped) in the same order and gets the
    same full HF tensors as :func:`megatron_to_hf` over all ranks' state dicts. Per tensor, a small int64
    header (crc32 of the name, shard shape) is all-gathered first, and one more marks the end of the stream, so
    ranks that disagree on names, shapes or the number of tensors all get a
    :class:`~rlblocks.errors.SyncMismatchError` (a ``ValueError`` through ``WeightUpdateError``) instead of a hang
    or garbage; then the shard is all-gathered (replicated tensors need no gather and are taken from the local rank).
    Extra memory: one full parameter. Tensors must be on the device the group's backend uses
    (CPU for gloo, CUDA for NCCL).
    """
    import torch.distributed as dist

    dims = gpt_dims(hf_config)
    tp = dist.get_world_size(tp_group)
    _check_tp(dims, tp)
    offset, count, first, last = _stage(dims, pp_size, pp_rank, pp_layers)
    consumed = _Consumed(dims, count, first, last)
    device = torch.device("cpu") if dist.get_backend(tp_group) == "gloo" else None

    def agree(header: Tensor, what: str) -> None:
        headers = [torch.empty_like(header) for _ in range(tp)]
        dist.all_gather(headers, header, group=tp_group)
        for r, hr in enumerate(headers):
            if not torch.equal(hr, header):
                other = "reached the end of its tensors" if hr[0] == 0 else "sent a different name or shape"
                raise SyncMismatchError(f"named_local_tensors: TP rank {r} {other} than this rank's {what} "
                                        f"(header {hr.tolist()} vs {header.tolist()})")

    for name, t in named_local_tensors:
        if name.endswith(_EXTRA):
            continue
        t = _check_shape_any(f"named_local_tensors[{name!r}]", t)
        if t.dim() > 4:
            raise ArgumentError(f"named_local_tensors[{name!r}]: expected at most 4 dims, got shape {list(t.shape)}")
        device = t.device
        # Agree on (name, shape) before validating, so that every rank raises the same error instead of one rank
        # raising while the others wait in a collective. Field 0 is 1 for a tensor, 0 for the end of the stream.
        agree(torch.tensor([1, zlib.crc32(name.encode()), t.dim(), *t.shape, *([0] * (4 - t.dim()))],
                           dtype=torch.int64, device=device), f"{name!r} {list(t.shape)}")
        info = _mg_info(name, dims, tp, offset, count, first, last)
        consumed.add(name)
        if info.kind == "rep":
            shards = [t] * tp
        else:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=tp_group)
        yield from _merge(name, info, shards, dims)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    agree(torch.zeros(7, dtype=torch.int64, device=device), "end of stream")
    consumed.finish("named_local_tensors")
