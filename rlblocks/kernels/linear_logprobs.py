"""Fused LM head + per-token log-prob (+ entropy), forward and backward, never materialising ``[N, V]``.

``linear_token_logprobs(hidden[..., H], weight[V, H], labels[...])`` equals
``token_logprobs(hidden @ weight.T, labels)`` (see ``logprobs.py`` for the formulas) but the logits exist only
one block at a time:

- forward: tiles of ``z = (hidden @ weightᵀ) / T`` are reduced on the fly into the per-row stats ``m`` (max),
  ``s = Σ exp(z − m)``, ``a = Σ exp(z − m)·(z − m)`` and the label logit ``z_y`` (see ``_common.py``);
  ``logp = z_y − (m + log s)``, ``H = log s − a/s``. Saved for backward: the hidden states, the weight and two
  fp32 numbers per row.
- backward: the logits are recomputed blockwise, ``∂/∂z = g·(δ_y − p) − k·p·(log p + H)`` is formed for that block
  and immediately contracted: ``grad_hidden += (∂/∂z)·W / T`` and ``grad_weight += (∂/∂z)ᵀ·hidden / T``.

Vocab parallel (``process_group``): ``weight`` is this rank's contiguous vocabulary shard (megatron-core's
vocab-parallel output layer: equal shards, rank r holds rows ``[r·V_local, (r+1)·V_local)``), ``labels`` are global
ids and ``hidden`` is replicated. Each rank reduces its shard; ``m`` is combined by an all-reduce MAX, then the
rescaled ``s``, ``a`` and the label logit by one all-reduce SUM, so every rank gets the unsharded result. In the
backward, each rank's ``grad_hidden`` contribution is all-reduced (SUM); ``grad_weight`` stays local to the shard.

Backends: Triton on CUDA (GPU design: ``tl.dot`` tiles of hidden @ Wᵀ with fp32 accumulators, the vocabulary split
across programs and merged exactly; the backward kernel recomputes a ``[N, vocab-chunk]`` block of ``∂/∂z`` that
cuBLAS contracts into both gradients, so bf16 GEMMs run on tensor cores and ``grad_weight`` rows are written once),
and a chunked torch path (forward: row chunks of fp32 logits; backward: vocabulary blocks over all rows,
each block's ``grad_weight`` rows written once; fp32 matmuls).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import check_last_dim, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    apply_mask,
    check_flags,
    check_float_input,
    check_labels,
    check_same_device,
    check_temperature,
    resolve_backend,
    shard_offset,
)
from rlblocks.kernels._linear import _bwd_torch, _bwd_triton, _forward
from rlblocks.kernels._sampling import Replay, check_sampling


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """autograd.Function over ``hidden [N, H]``, ``weight [V_local, H]`` and flat ``labels [N]``; returns
    ``(logp, entropy)`` (entropy empty when not requested)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, ignore_index, return_entropy, backend, group, reduce_gh,
                sm):  # fmt: skip
        inv_temp = 1.0 / temperature
        lp, ent, (h0, valid, idx, owns, lse, yl, rep) = _forward(
            hidden, weight, labels, inv_temp, ignore_index, return_entropy, backend, group, sm
        )
        live = valid & ~torch.isneginf(lp)  # a label outside the kept set has probability 0: no grad through logp
        ctx.save_for_backward(h0, weight, valid, idx, owns, lse, ent, yl, live,
                              *(rep if rep is not None else (None,) * 4))  # fmt: skip
        ctx.cfg = (inv_temp, return_entropy, backend, group, reduce_gh)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h0, weight, valid, idx, owns, lse, ent, yl, live, *rep = ctx.saved_tensors
        rep = Replay(*rep) if rep[0] is not None else None
        inv_temp, has_ent, backend, group, reduce_gh = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w) or (g_lp is None and g_ent is None):
            return (None,) * 10
        n = h0.shape[0]
        zero = torch.zeros((), dtype=torch.float32, device=h0.device)
        g = torch.where(live, g_lp.float(), zero) if g_lp is not None else zero.expand(n).clone()
        k = torch.where(valid, g_ent.float(), zero) if (has_ent and g_ent is not None) else None
        ent_used = ent if k is not None else lse
        if backend == "triton" and n > 0 and rep is not None and rep.sparse is not None:  # every row sparse
            gh, gw = _bwd_torch(h0, weight, idx, owns, lse, ent_used, g, k, inv_temp, need_h, need_w, rep, True)
        elif backend == "triton" and n > 0:
            gh, gw = _bwd_triton(h0, weight, yl, lse, ent_used, g, k, inv_temp, need_h, need_w,
                                 rep.tau if rep is not None else None)  # fmt: skip
        else:
            gh, gw = _bwd_torch(h0, weight, idx, owns, lse, ent_used, g, k, inv_temp, need_h, need_w, rep)
        if need_h and group is not None and reduce_gh:
            import torch.distributed as dist

            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
        gh = gh.to(h0.dtype) if need_h else None
        gw = gw.to(weight.dtype) if need_w else None
        return gh, gw, None, None, None, None, None, None, None, None


def _prepare(hidden, weight, labels, mask, temperature, ignore_index, backend, process_group):
    """Checks shared by the public wrappers; returns flat ``(h, w, y)``, the temperature and the backend."""
    check_float_input("hidden", hidden)
    check_float_input("weight", weight)
    check_last_dim("hidden", hidden)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ArgumentError(f"weight: expected shape [V, {hidden.shape[-1]}] (V > 0, H = hidden.shape[-1]), "
                         f"got {shape_str(weight)}")
    if weight.dtype != hidden.dtype:
        raise ArgumentError(f"weight: expected the dtype of hidden ({hidden.dtype}), got {weight.dtype}")
    check_same_device(hidden=hidden, weight=weight, labels=labels, mask=mask)
    temperature = check_temperature(temperature)
    _, v_full = shard_offset(weight.shape[0], process_group)
    lead = hidden.shape[:-1]
    y = check_labels(labels, lead, v_full, ignore_index, like="hidden")
    y = apply_mask(y, mask, lead, ignore_index, like="labels")
    backend = resolve_backend(backend, hidden, weight)
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return h, w, y, temperature, backend


def linear_token_logprobs(
    hidden: Float[Tensor, "*batch H"],
    weight: Float[Tensor, "V H"],
    labels: Int[Tensor, "*batch"],
    *,
    mask: Bool[Tensor, "*batch"] | None = None,
    temperature: float = 1.0,
    top_k: int | Int[Tensor, "*batch"] | None = None,
    top_p: float | Float[Tensor, "*batch"] | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_outside: bool = False,
    process_group: Any = None,
    allreduce_grad_hidden: bool = True,
    backend: str | None = None,
) -> Float[Tensor, "*batch"] | tuple[Tensor, ...]:
    """Per-token label log-prob (and entropy) of ``hidden @ weight.T`` without materialising the logits, in fp32.

    Formula: ``z = (hidden @ weightᵀ) / temperature`` (fp32 accumulation); ``logp = z[label] − logsumexp(z)``;
    ``entropy = logsumexp(z) − Σ softmax(z)·z`` (natural log). Same outputs as
    ``token_logprobs(hidden @ weight.T, labels, ...)``, including sampling-mask replay.

    Sampling-mask replay (``top_k`` / ``top_p``, scalars or per-token tensors): ``logp`` and ``entropy`` are those of
    the distribution the engine sampled from — temperature, then top-k, then top-p, renormalised over the kept set
    ``S`` (vLLM's sampler order; the convention of ``rlblocks.rollout.types``); see ``token_logprobs`` for the exact
    rules. Gradients flow through kept entries only. A label outside ``S`` gets ``logp = −inf`` and no gradient
    through ``logp``; ``return_outside=True`` also returns the bool ``outside`` (last in the tuple; count them with
    ``outside.sum()``, drop them with ``mask & ~outside``). The kept set needs each row's largest logits: the
    torch path finds them (``torch.topk``) in the logits chunk it already holds; the Triton path forms fp32 row
    chunks of logits (≤ 64 MiB, cuBLAS) for them. When every row's kept set lies among its ``C`` largest logits
    (always with a top-k: ``C = k + 1``; else 64), the outputs follow from those candidates, which are saved
    (12 B each: ``[N, C]`` values and ids) so the backward is a gather / index-add of ``C`` weight rows per token,
    with no logits recomputation; other rows (top-p alone over a wide nucleus, unfiltered rows next to filtered
    ones) take the dense path with entries below a per-row threshold masked (on Triton: one extra GEMM in the
    forward). With ``process_group`` every row takes the dense path: each rank's largest logits are
    all-gathered for the global thresholds (top-p alone also all-reduces the row normaliser, and a row those do
    not settle all-gathers its whole row), then each rank masks its shard.
    The kept sets cost a few host syncs per row chunk (the candidate count, the rows the candidates do not
    settle), so the replay path is not meant for ``torch.compile(fullgraph=True)``; without ``top_k`` / ``top_p``
    nothing changes.

    Masked positions (``mask`` false, or ``labels == ignore_index``) give 0 for both outputs and no gradient; their
    hidden rows are replaced by 0 before any product (NaN/inf there cannot leak). Differentiable w.r.t. ``hidden`` and
    ``weight`` (also through the entropy); the backward recomputes the logits blockwise. Extra memory is one chunk of
    logits (torch path: forward row chunks of ≤ ~64 MiB of fp32 logits, at most half the rows and from 1024 rows on at
    most 1/16 of them; backward blocks of ≤ ~64 MiB over all rows and at most 1/32 of the vocabulary, with two fp32
    ``[N, H]`` operands and the ``[N, H]`` grad-hidden accumulator; plus an fp32 copy of ``weight`` when it is
    bf16/fp16; Triton: a ``[N, vocab-chunk]`` gradient block of ≤ 256 MiB, and an fp32 ``[N, H]`` grad-hidden
    accumulator) and O(N) fp32 stats, never ``[N, V]``. Without grad (``torch.no_grad`` or inputs that do not require
    grad) nothing is kept for a backward.

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16).
        weight: ``[V, H]`` LM head (same dtype as ``hidden``); with ``process_group``, this rank's ``[V/world, H]``
            contiguous vocabulary shard.
        labels: ``[...]`` global token ids in ``[0, V)`` (``V`` = full vocabulary) or ``ignore_index``.
        mask: optional ``[...]`` bool (or 0/1) mask of the positions to compute; false acts as ``ignore_index``.
        temperature: > 0; logits are divided by it.
        top_k: the engine's top-k (``None`` / ``<= 0``: off), an int or a per-token integer tensor.
        top_p: the engine's top-p in ``(0, 1]`` (``None`` / 1: off), a float or a per-token floating tensor.
        return_entropy: also return the per-token entropy.
        return_outside: also return ``outside`` (bool ``[...]``): the label has probability 0 under the processed
            distribution (always false at masked positions).
        process_group: a ``torch.distributed`` group over which ``weight`` is vocab-sharded (megatron-core's
            vocab-parallel output layer: equal contiguous shards, rank r holds rows ``[r·V_local, (r+1)·V_local)``);
            ``hidden`` is replicated and the outputs are the unsharded values on every rank.
        allreduce_grad_hidden: with ``process_group``, each rank's ``grad_hidden`` covers only its vocabulary
            shard, and by default the op all-reduces (SUM) it over the group, so ``hidden.grad`` is complete.
            Pass ``False`` when ``hidden`` already went through megatron's ``copy_to_tensor_model_parallel_region``
            (the input of a ``ColumnParallelLinear``): that region's backward performs the same all-reduce, and doing
            it here too would count every shard ``world`` times. ``grad_weight`` always stays local to the shard.
        backend: ``None``/``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Raises ``ValueError`` (``ArgumentError``) naming the argument for non-floating inputs, mismatched dtypes or
    devices, a hidden size of 0 (an empty batch is fine: empty outputs), a ``weight`` whose second dimension is
    not ``hidden.shape[-1]``, a labels/mask shape other than
    ``hidden.shape[:-1]``, a label out of range (one host sync; skipped under ``torch.compile``), a ``top_k`` /
    ``top_p`` of the wrong type, shape or range.

    Returns ``logp``, or a tuple ``(logp, entropy)``, ``(logp, outside)`` or ``(logp, entropy, outside)``.
    """
    check_flags(return_entropy=return_entropy, return_outside=return_outside,
                allreduce_grad_hidden=allreduce_grad_hidden)
    h, w, y, temperature, backend = _prepare(
        hidden, weight, labels, mask, temperature, ignore_index, backend, process_group
    )
    lead = hidden.shape[:-1]
    sm = check_sampling(top_k, top_p, lead, shard_offset(weight.shape[0], process_group)[1], y != ignore_index)
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        lp, ent = LinearTokenLogprobsFunction.apply(
            h, w, y, temperature, int(ignore_index), bool(return_entropy), backend, process_group,
            bool(allreduce_grad_hidden), sm,
        )  # fmt: skip
    else:
        lp, ent, _ = _forward(h, w, y, 1.0 / temperature, int(ignore_index), bool(return_entropy), backend,
                              process_group, sm)  # fmt: skip
    out = [lp.reshape(lead)]
    if return_entropy:
        out.append(ent.reshape(lead))
    if return_outside:
        out.append(torch.isneginf(lp).reshape(lead))
    return out[0] if len(out) == 1 else tuple(out)
