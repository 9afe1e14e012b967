"""The LM head at a batch's scored positions only, the last step of ``causal_lm_logprobs`` (one row per sample and
prefix-shared): ``linear_token_logprobs`` on the ``M`` hidden states that a ``[B, T]`` response mask marks, its
outputs scattered back to ``[B, T]``. With a large vocabulary the head costs as much per token as several decoder
layers, and a batch's response padding is often half of ``B·T``: the masked slots are never computed."""

from __future__ import annotations

from typing import Any

from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels.linear_logprobs import linear_token_logprobs


def scored_head_logprobs(
    hidden: Float[Tensor, "N H"],
    index: Int[Tensor, "B T"],
    weight: Float[Tensor, "V H"],
    labels: Int[Tensor, "B T"],
    *,
    temperature: float = 1.0,
    top_k: int | Int[Tensor, "B T"] | None = None,
    top_p: float | Float[Tensor, "B T"] | None = None,
    return_entropy: bool = False,
    return_outside: bool = False,
    backend: str | None = None,
) -> Float[Tensor, "B T"] | tuple[Tensor, ...]:
    """``logp[b, t] = log softmax(hidden[index[b, t]] @ weightᵀ / temperature)[labels[b, t]]`` where
    ``index[b, t] >= 0`` (the scored positions), 0 elsewhere; also the entropy / outside flags as
    ``linear_token_logprobs`` returns them (0 / false elsewhere). ``top_k`` / ``top_p``: scalars, or ``[B, T]``
    tensors read at the scored positions.

    The head runs on the ``M`` gathered rows ``hidden[index[index >= 0]]`` (row-major order), so an unscored slot
    costs nothing and its hidden state (padding: anything, NaN included) is never read. Differentiable w.r.t.
    ``hidden`` and ``weight`` (the scatter back passes each position's gradient to its row). One host sync: the
    count ``M`` sizes the gathered rows.
    """
    scored = index >= 0
    h = hidden.index_select(0, index[scored])
    if weight.dtype != h.dtype:
        h = h.to(weight.dtype)
    outs = linear_token_logprobs(h, weight, labels[scored], temperature=temperature,
                                 top_k=_scored_only("top_k", top_k, scored),
                                 top_p=_scored_only("top_p", top_p, scored),
                                 return_entropy=return_entropy, return_outside=return_outside, backend=backend)
    if isinstance(outs, Tensor):
        return _scatter_scored(outs, scored)
    return tuple(_scatter_scored(o, scored) for o in outs)


def _scored_only(name: str, param: Any, scored: Bool[Tensor, "B T"]) -> Any:
    """A per-token sampling parameter (``top_k`` / ``top_p``) at the scored positions; scalars as they are."""
    if isinstance(param, Tensor) and param.dim() > 0:
        if param.shape != scored.shape:
            raise ArgumentError(f"{name}: expected a scalar or a tensor of shape {shape_str(scored)} (that of "
                                f"response_mask), got {shape_str(param)}")
        return param[scored.to(param.device)]
    return param


def _scatter_scored(x: Float[Tensor, " M"], scored: Bool[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """``[B, T]``: ``x`` at the scored positions (row-major order), 0 (false for bool) elsewhere; differentiable."""
    return x.new_zeros(scored.shape).masked_scatter(scored, x)

