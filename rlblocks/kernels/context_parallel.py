"""Context parallelism for an HF causal LM: one long sequence's log-probs computed across the ranks of a group.

``causal_lm_logprobs(model, ..., cp_group=group)`` lands here. Every rank of ``group`` is called with the same
full batch; each forwards only its zigzag shard of the positions (:func:`rlblocks.kernels.zigzag_positions`):

- position ids are the tokens' true positions (RoPE sees the real distance between any two tokens);
- attention runs across the group through :func:`rlblocks.kernels.ring_attention`, registered with transformers'
  ``AttentionInterface`` under ``rlblocks_cp_<inner>`` (``<inner>`` the model's own implementation, which keeps
  serving every call made without ``cp_group``), so HF Llama / Qwen2 / Qwen3 run unchanged; the model gets a
  prepared 4-D placeholder mask, so it builds no causal mask of its own (one built from zigzag positions
  would be wrong);
- the label of a hidden state is the token one position later, read from the full ``input_ids`` every rank holds,
  so the last position of a chunk takes its label from the next chunk (another rank's) without any exchange;
- the sequence is padded at the end to ``2·W·c`` positions; causal attention never lets a real position see the
  padding, so right-padded batches need no mask inside the attention (``attention_mask`` is checked to be
  right padding);
- each rank scores the response tokens predicted from its own positions; the ``[B, T]`` results are summed over
  the group (each token comes from exactly one rank), with an identity backward: every rank holds the same
  upstream gradient of the full ``[B, T]``, and its own tokens pass it on to the parameters. The gradient of
  every parameter is therefore split over the ranks of the group: their SUM is the unsharded gradient (FSDP over
  the DP × CP ranks, or an all-reduce over the group, adds them up).

The loss side: a loss computed identically on every rank of the group from the full ``[B, T]`` (any loss, any
aggregation; data-parallel normalisers) gives the exact gradient summed over the group, and so do per-token losses
on the local shard (:func:`cp_shard_mask`) with the counts of the whole batch, for the aggregations that add up over
tokens (``token-mean``, ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from jaxtyping import Bool, Int
from torch import Tensor, nn

from rlblocks.errors import ArgumentError
from rlblocks.kernels.linear_logprobs import linear_token_logprobs
from rlblocks.kernels.ring import ring_attention, zigzag_chunk, zigzag_positions

__all__ = ["cp_shard_mask", "enable_context_parallel"]

PREFIX = "rlblocks_cp_"
CP_KWARG = "rlblocks_cp"  # the keyword the decoder layers pass through to the attention function
_RESERVED = ("position_ids", "inputs_embeds", "past_key_values", "cache_position", CP_KWARG)


# ------------------------------------------------------------------------------------------------ group
def _group_rank(group: Any, name: str = "cp_group") -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ArgumentError(f"{name}: expected a torch.distributed process group (torch.distributed is not "
                            f"initialised in this process), got {type(group).__name__}")
    if not isinstance(group, dist.ProcessGroup):
        raise ArgumentError(f"{name}: expected a torch.distributed.ProcessGroup (e.g. from new_group), got "
                            f"{type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ArgumentError(f"{name}: this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def cp_shard_mask(
    response_mask: Bool[Tensor, "B T"],
    prompt_lens: Int[Tensor, " B"],
    seq_len: int,
    cp_group: Any,
) -> Bool[Tensor, "B T"]:
    """The response tokens whose log-prob this rank of ``cp_group`` computes: token ``t`` of row ``b`` (sequence
    position ``P_b + t``) is predicted from position ``P_b + t − 1``, and belongs to the rank whose zigzag shard
    holds that position. Over the group the masks are disjoint and their union is ``response_mask`` (restricted
    to positions ``< seq_len``).

    The loss side of context parallelism: ``aggregate(per_token, mask & cp_shard_mask(...), num_tokens=N, ...)``
    with the counts ``N`` (``num_seqs``, ``max_len``) of the whole batch gives per-rank losses that add up over the
    group to the whole-batch value, for ``token-mean``, ``token-sum``, ``seq-mean-token-sum`` and
    ``seq-mean-token-sum-norm`` (``seq-mean-token-mean`` divides by each row's own length: divide the per-token
    loss by the full row lengths first and use ``seq-mean-token-sum``).
    """
    rank, world = _group_rank(cp_group)
    if response_mask.dim() != 2 or prompt_lens.shape != (response_mask.shape[0],):
        raise ArgumentError(f"response_mask, prompt_lens: expected [B, T] and [B], got {list(response_mask.shape)} "
                            f"and {list(prompt_lens.shape)}")
    device = response_mask.device
    src = prompt_lens.to(device=device, dtype=torch.long)[:, None] - 1 + torch.arange(response_mask.shape[1],
                                                                                        device=device)
    c = zigzag_chunk(int(seq_len), world)
    chunk = src.clamp(min=0) // c
    mine = (chunk == rank) | (chunk == 2 * world - 1 - rank)
    return response_mask.bool() & mine & (src >= 0) & (src + 1 < seq_len)


# ------------------------------------------------------------------------------------------------ attention hook
@dataclass
class _CPContext:
    group: Any
    calls: int = field(default=0)


def _inner_attention(module: nn.Module, inner: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is not in the interface: each modelling file has its own; take the one of the module's own file
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if inner == "eager":
        if eager is None:
            raise ArgumentError(f"model: {type(module).__name__} has no eager_attention_forward to fall back on")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(inner, eager)


def _make_attention(inner: str):
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        cp = kwargs.pop(CP_KWARG, None)
        if cp is None:  # not a context-parallel call: the model's own implementation, unchanged
            return _inner_attention(module, inner)(module, query, key, value, attention_mask, **kwargs)
        name = type(module).__name__
        if kwargs.get("dropout", 0.0):
            raise ArgumentError(f"model: {name} runs attention dropout {kwargs['dropout']} (training mode with "
                                f"attention_dropout > 0); context parallelism supports attention_dropout = 0")
        for key_name in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(key_name) is not None:
                raise ArgumentError(f"model: {name} passes {key_name}={kwargs[key_name]!r}; context-parallel "
                                    f"attention supports plain causal attention (no sliding window, soft-cap "
                                    f"or attention sinks)")
        if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
            raise ArgumentError(f"model: {name} is not causal; context-parallel attention is causal")
        cp.calls += 1
        out = ring_attention(query, key, value, cp.group, scale=kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"{PREFIX}{inner}"
    return attention


def _register(inner: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"{PREFIX}{inner}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(inner))
        if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # calls without cp_group build the inner implementation's mask
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


def enable_context_parallel(model: nn.Module) -> nn.Module:
    """Route ``model``'s attention through the context-parallel function (``causal_lm_logprobs`` does it on its
    first call with ``cp_group``; call it yourself before ``torch.compile`` or to fail early).

    The model's attention implementation becomes ``rlblocks_cp_<inner>``: calls that carry a context-parallel
    shard run ring attention, every other call (generation, a forward without ``cp_group``) runs ``<inner>``
    exactly as before, mask included. Idempotent; returns ``model``. Raises ``ArgumentError`` for a model that
    does not dispatch attention through transformers' ``AttentionInterface`` or has non-attention sequence layers
    (``config.layer_types`` other than ``full_attention``)."""
    if callable(getattr(model, "get_base_model", None)):  # PEFT
        model = model.get_base_model()
    cfg = getattr(model, "config", None)
    current = getattr(cfg, "_attn_implementation", None)
    if not isinstance(current, str) or not callable(getattr(model, "set_attn_implementation", None)):
        raise ArgumentError(f"model: expected a transformers PreTrainedModel with an attention implementation, "
                            f"got {type(model).__name__}")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ArgumentError(f"model: context parallelism needs every layer to be full causal attention, got "
                            f"config.layer_types with {sorted(kinds)}")
    if current.startswith(PREFIX):
        return model
    name = _register(current)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ArgumentError(f"model: {type(model).__name__} does not dispatch attention through transformers' "
                            f"AttentionInterface (set_attn_implementation({name!r}) did not take)")
    return model


# ------------------------------------------------------------------------------------------------ log-probs
class _SumOverGroup(torch.autograd.Function):
    """Forward: the SUM over the group of disjoint per-rank contributions. Backward: identity, because every rank
    holds the same upstream gradient of the sum (the loss of the full tensor, or its own share of it)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _check_same_batch(group: Any, *tensors: Tensor) -> None:
    """Every rank of the group must pass the same batch: compare shape and content fingerprints (one all-reduce)."""
    device = tensors[0].device
    parts = []
    for t in tensors:  # (numel, a position-weighted sum); int64 products stay far below overflow
        x = t.long().flatten()
        w = torch.arange(1, x.numel() + 1, device=device, dtype=torch.long) % 65_521
        dims = torch.tensor([x.numel(), t.shape[0], t.shape[-1]], device=device)
        parts.append(torch.cat([dims, ((x % 1_000_003) * w).sum()[None]]))
    local = torch.cat(parts)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[: local.numel()], -both[local.numel() :]):
        raise ArgumentError("cp_group: every rank of the group must be called with the same full batch "
                            "(input_ids, prompt_lens, response_mask), got different batches on different ranks")


def cp_forward(model: nn.Module, body: nn.Module, input_ids: Tensor, group: Any,
               model_kwargs: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    """This rank's shard through the decoder body: ``(hidden [B, n, H], positions [n])`` for the zigzag positions
    of ``input_ids [B, L]`` (``>= L``: end padding), with ring attention across ``group``."""
    rank, world = _group_rank(group)
    b, seq_len = input_ids.shape
    device = input_ids.device
    enable_context_parallel(model)
    pos = zigzag_positions(seq_len, world, rank, device=device)  # [n] true positions (>= seq_len: end padding)
    n = pos.numel()
    local_ids = input_ids[:, pos.clamp(max=seq_len - 1)]  # padding slots repeat the last token (never attended)
    placeholder = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)  # 4-D: HF builds no mask of its own
    ctx = _CPContext(group)
    out = body(input_ids=local_ids, attention_mask=placeholder, position_ids=pos[None].expand(b, n),
               use_cache=False, **{CP_KWARG: ctx}, **dict(model_kwargs))
    expected = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if ctx.calls == 0 or (isinstance(expected, int) and ctx.calls != expected):
        raise ArgumentError(f"model: {ctx.calls} attention calls went through the context-parallel function in "
                            f"a forward of {expected} layers; every layer must dispatch attention through "
                            f"transformers' AttentionInterface")
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if hidden.dim() != 3 or hidden.shape[:2] != (b, n):
        raise ArgumentError(f"model: expected the decoder body to return hidden states [{b}, {n}, H], got "
                            f"{list(hidden.shape)}")
    return hidden, pos


def cp_causal_lm_logprobs(
    model: nn.Module,
    body: nn.Module,
    weight: Tensor,
    input_ids: Tensor,
    starts: Tensor,
    keep: Tensor,
    *,
    group: Any,
    attention_mask: Tensor | None,
    temperature: float,
    top_k: Any,
    top_p: Any,
    return_entropy: bool,
    return_outside: bool,
    backend: str | None,
    validate: bool,
    model_kwargs: Mapping[str, Any],
) -> Tensor | tuple[Tensor, ...]:
    """The ``cp_group`` path of ``causal_lm_logprobs`` (arguments already checked there; ``starts`` the prompt
    lengths, ``keep`` the bool response mask, ``temperature`` the effective head temperature)."""
    _group_rank(group)
    taken = sorted(set(model_kwargs) & set(_RESERVED))
    if taken:
        raise ArgumentError(f"model_kwargs: {taken[0]!r} is set by the context-parallel path (true positions of "
                            f"the local shard), got it in model_kwargs")
    b, seq_len = input_ids.shape
    t_len = keep.shape[1]
    if validate and not torch.compiler.is_compiling():
        if attention_mask is not None:
            am = attention_mask.bool()
            holes = am[:, 1:] & ~am[:, :-1]
            if bool(holes.any()):
                row = int(holes.nonzero()[0, 0])
                raise ArgumentError(f"attention_mask: with cp_group, expected right padding (each row 1s then 0s), "
                                    f"got a 0 before a 1 in row {row}")
        _check_same_batch(group, input_ids, starts, keep)

    hidden, pos = cp_forward(model, body, input_ids, group, model_kwargs)
    # hidden state at position q predicts the token at q + 1 = response index q + 1 − P_b of its row
    tgt = pos + 1
    t_idx = tgt[None, :] - starts[:, None]  # [B, n]
    inside = (t_idx >= 0) & (t_idx < t_len) & (tgt < seq_len)[None, :]
    t_safe = t_idx.clamp(0, t_len - 1)
    valid = inside & keep.gather(1, t_safe)
    labels = input_ids[:, tgt.clamp(max=seq_len - 1)]

    def local(x):  # a per-token [B, T] sampling parameter, read at this rank's tokens
        return x.gather(1, t_safe) if isinstance(x, Tensor) and x.dim() == 2 else x

    if weight.dtype != hidden.dtype:
        hidden = hidden.to(weight.dtype)
    res = linear_token_logprobs(hidden, weight, labels, mask=valid, temperature=temperature, top_k=local(top_k),
                                top_p=local(top_p), return_entropy=return_entropy, return_outside=return_outside,
                                backend=backend)  # fmt: skip
    res = res if isinstance(res, tuple) else (res,)
    lp = res[0]
    channels = [x if x.dtype == lp.dtype else x.to(lp.dtype) for x in res]  # outside (bool) as 0/1
    sink = torch.where(valid, t_idx, t_len)  # this rank's tokens go to their [B, T] slot, the rest to a sink
    stacked = torch.stack(channels)  # [k, B, n]
    full = stacked.new_zeros(len(channels), b, t_len + 1)
    full = full.scatter_add(2, sink[None].expand_as(stacked), torch.where(valid, stacked, 0.0))[:, :, :t_len]
    summed = _SumOverGroup.apply(full.contiguous(), group)
    outs = [x.clone() for x in summed.unbind(0)]  # not views of one buffer (an in-place op on a view of an
    # FSDP module's output would skip its backward hook)
    if return_outside:
        outs[-1] = outs[-1].detach() > 0.5
    return outs[0] if len(outs) == 1 else tuple(outs)
