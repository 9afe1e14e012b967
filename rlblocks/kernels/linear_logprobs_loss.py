"""Fused LM head + per-token log-prob loss with the logits gradient formed in the forward (one GEMM pass).

``linear_token_logprobs_loss`` takes per-token coefficients known before the forward and returns the scalar loss;
its ``logp`` / ``entropy`` are those of ``linear_token_logprobs`` (``linear_logprobs.py``: formulas, arguments
and checks), the shared kernels and stats passes are in ``_linear.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels import _common
from rlblocks.kernels._common import (
    allreduce_stats,
    check_flags,
    check_float_input,
    cols_per_block,
    device_guard,
    grad_scale,
    mm_fp32,
    shard_offset,
    triton_available,
    zero_ignored_rows,
)
from rlblocks.kernels._linear import (
    _LOWEST,
    _forward,
    _fwd_stats_triton,
    _grad_chunk_torch,
    _torch_rows,
    _triton_group_thresholds,
    _triton_select,
)
from rlblocks.kernels._sampling import check_sampling, group_thresholds, mask_below, num_candidates, select
from rlblocks.kernels.linear_logprobs import _prepare

if triton_available():
    import triton
    import triton.language as tl


    @triton.jit
    def _fused_grad_kernel(
        e_ptr, gz_ptr, mt_ptr, lse_ptr, ent_ptr, g_ptr, k_ptr, yl_ptr, scale_ptr,
        N, V, stride_e, stride_gz, inv_temp,
        HAS_ENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One [BLOCK_N, BLOCK_V] tile (BLOCK_V = the forward's vocab tile, so one tile max per row): from the stored
        # e = exp(z − m_tile), p = e·exp(m_tile − lse) and log p = log e + m_tile − lse; write
        # scale·(g·(δ_y − p) − k·p·(log p + H))/T (in place when gz_ptr is e_ptr). Memory bound: one read, one write.
        rb = tl.program_id(0)
        vt = tl.program_id(1)
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = vt * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = rows < N
        col_ok = cols < V
        rows64 = rows.to(tl.int64)
        msk = row_ok[:, None] & col_ok[None, :]
        e = tl.load(e_ptr + rows64[:, None] * stride_e + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        mt = tl.load(mt_ptr + vt.to(tl.int64) * N + rows64, mask=row_ok, other=0.0)
        lse = tl.load(lse_ptr + rows64, mask=row_ok, other=0.0)
        g = tl.load(g_ptr + rows64, mask=row_ok, other=0.0)
        yl = tl.load(yl_ptr + rows64, mask=row_ok, other=-1)
        shift = mt - lse
        p = e * tl.exp(shift)[:, None]
        if HAS_ENT:
            k = tl.load(k_ptr + rows64, mask=row_ok, other=0.0)
            ent = tl.load(ent_ptr + rows64, mask=row_ok, other=0.0)
            logp = tl.log(tl.where(e == 0, 1.0, e)) + shift[:, None]
            gzt = tl.where(e == 0, 0.0, p * (-g[:, None] - k[:, None] * (logp + ent[:, None])))
        else:
            gzt = -g[:, None] * p
        gzt += tl.where(cols[None, :] == yl[:, None], g[:, None], 0.0)
        gzt = gzt * (tl.load(scale_ptr) * inv_temp)
        tl.store(gz_ptr + rows64[:, None] * stride_gz + cols[None, :], gzt.to(gz_ptr.dtype.element_ty), mask=msk)


# ------------------------------------------------------------------------------------------- the fused-loss path
# Rows and warps of the elementwise kernel that turns the stored exp(z − m_tile) into the logits gradient.
FUSED_GRAD_BLOCK_N = 16
FUSED_GRAD_WARPS = 4


class LogprobsLoss(NamedTuple):
    """``linear_token_logprobs_loss`` result: the scalar ``loss`` (differentiable), and the per-token ``logp`` and
    ``entropy`` (``None`` unless asked for) without grad, for metrics such as ``approx_kl``."""

    loss: Float[Tensor, ""]
    logp: Float[Tensor, "*batch"]
    entropy: Float[Tensor, "*batch"] | None


def _fused_rows(n: int, v: int, elt: int) -> int:
    """Rows per chunk of the fused-loss path: the budget, in whole 128-row tiles (16 when the budget is smaller)."""
    rows = _common.FUSED_CHUNK_BYTES // max(1, v * elt)
    rows = rows // 128 * 128 if rows >= 128 else max(16, rows // 16 * 16)
    return max(1, min(n, rows))


def _coef_terms(valid, coef, ent_coef, rows):
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    g = torch.where(valid[rows], coef[rows].float(), zero)
    k = torch.where(valid[rows], ent_coef[rows].float(), zero) if ent_coef is not None else None
    return g, k


def _fused_torch(h0, w, idx, owns, valid, coef, ent_coef, inv_temp, has_ent, group, need_h, need_w, sm=None):
    """Per row chunk: logits (one fp32 GEMM), their stats, and at once the gradient ``∂L/∂z`` with the known
    coefficients, contracted into both gradients — the logits are never recomputed."""
    n, hdim = h0.shape
    v = w.shape[0]
    w32 = w.float()
    lp, ent = torch.zeros(n, device=h0.device), torch.zeros(n if has_ent else 0, device=h0.device)
    gh = torch.empty(n, hdim, dtype=torch.float32, device=h0.device) if need_h else None
    gw = torch.zeros(v, hdim, dtype=torch.float32, device=h0.device) if need_w else None
    step = _torch_rows(n, v)
    zbuf = torch.empty(min(step, n), v, dtype=torch.float32, device=h0.device)
    pbuf = torch.empty_like(zbuf) if ent_coef is not None else None
    col = cols_per_block(min(step, n))
    n_cand = num_candidates(sm, v if group is None else shard_offset(v, group)[1]) if sm is not None else 0
    for r0 in range(0, n, step):
        sl = slice(r0, min(r0 + step, n))
        c = sl.stop - sl.start
        hc = h0[sl].float() * inv_temp
        z = torch.mm(hc, w32.t(), out=zbuf[:c])
        zy = torch.where(owns[sl], z.gather(1, idx[sl].unsqueeze(1)).squeeze(1), 0.0)
        if sm is not None:  # sampling-mask replay: −inf outside the kept sets (the dense path)
            if group is not None:
                tau = group_thresholds(z, sm.rows(sl), group, n_cand)
            else:
                tau = select(z, sm.rows(sl), owns[sl], n_cand).tau
            mask_below(z, tau)
            zy = torch.where(owns[sl] & (zy < tau), float("-inf"), zy)
        m = z.amax(dim=1)
        m_loc = torch.where(torch.isfinite(m), m, 0.0)  # a shard may hold none of a row's kept set
        z.sub_(m_loc.unsqueeze(1))
        s = torch.zeros(c, device=h0.device)
        a = torch.zeros(c, device=h0.device) if has_ent else None
        for j in range(0, v, col):
            e = torch.exp(z[:, j : j + col])
            s += e.sum(dim=1)
            if has_ent:  # a −inf entry has e = 0: a finite stand-in keeps e·z at 0
                zb = z[:, j : j + col] if sm is None else z[:, j : j + col].clamp(min=_LOWEST)
                a += torch.linalg.vecdot(e, zb)
        if group is not None:
            m, s, a, extra = allreduce_stats(m, s, a, zy.unsqueeze(0), group)
            zy = extra[0]
        log_s = torch.log(s)
        lse = m + log_s
        lp[sl] = torch.where(valid[sl], zy - lse, 0.0)
        if has_ent:
            ent[sl] = torch.where(valid[sl], log_s - a / s, 0.0)
        g, k = _coef_terms(valid & ~torch.isneginf(lp), coef, ent_coef, sl)
        if k is not None:
            k = torch.where(valid[sl], ent_coef[sl].float(), 0.0)
        z.sub_((lse - m_loc).unsqueeze(1))  # z − m_local − (lse − m_local) = log p
        _grad_chunk_torch(z, pbuf[:c] if pbuf is not None else None, hc, w32, idx[sl], owns[sl], g, k,
                          ent[sl] if k is not None else None, inv_temp, gh[sl] if need_h else None, gw, need_h,
                          need_w, masked=sm is not None)  # fmt: skip
    return lp, ent, gh, gw


def _fused_triton(h0, w, yl, owns, valid, coef, ent_coef, inv_temp, has_ent, group, need_h, need_w, sm=None):
    """Per row chunk: the forward kernel stores ``e = exp(z − m_tile)`` (one GEMM), the per-row lse is merged from
    the tile stats, ``_fused_grad_kernel`` turns ``e`` into ``∂L/∂z`` in place, and cuBLAS contracts it into
    ``grad_hidden`` (fp32) and ``grad_weight`` (fp32 across chunks)."""
    n, hdim = h0.shape
    v = w.shape[0]
    dev = h0.device
    # fp16 probabilities below 6e-5 would lose precision, so fp16 inputs keep e in fp32 and write the (scaled)
    # gradient into a separate fp16 block; bf16/fp32 overwrite e in place.
    e_dtype = torch.float32 if h0.dtype == torch.float16 else h0.dtype
    rows = _fused_rows(n, v, torch.empty((), dtype=e_dtype).element_size())
    ebuf = torch.empty(rows, v, dtype=e_dtype, device=dev)
    gbuf = ebuf if e_dtype == h0.dtype else torch.empty(rows, v, dtype=h0.dtype, device=dev)
    lp, ent = torch.zeros(n, device=dev), torch.zeros(n if has_ent else 0, device=dev)
    gh = torch.empty(n, hdim, dtype=torch.float32, device=dev) if need_h else None
    single = rows >= n
    gw = None
    if need_w:
        gw = torch.empty_like(w) if single and h0.dtype != torch.float16 else torch.zeros(v, hdim, device=dev)
    tau = None
    if sm is not None:  # sampling-mask replay: per-row thresholds first (fp32 logits chunks, cuBLAS)
        if group is not None:
            tau = _triton_group_thresholds(h0, w, inv_temp, sm, group)
        else:
            tau = _triton_select(h0, w, inv_temp, sm, owns, torch.where(owns, yl, 0)).tau
    for r0 in range(0, n, rows):
        sl = slice(r0, min(r0 + rows, n))
        c = sl.stop - sl.start
        hc = h0[sl]
        m, s, a, zy, (mt, block_v) = _fwd_stats_triton(hc, w, yl[sl], inv_temp, has_ent, e_out=ebuf[:c],
                                                       tau=tau[sl].contiguous() if tau is not None else None)
        if group is not None:
            m, s, a, extra = allreduce_stats(m, s, a, zy.unsqueeze(0), group)
            zy = extra[0]
        log_s = torch.log(s)
        lse = m + log_s
        lp[sl] = torch.where(valid[sl], zy - lse, 0.0)
        ent_c = log_s - a / s if has_ent else lse
        if has_ent:
            ent[sl] = torch.where(valid[sl], ent_c, 0.0)
        g, k = _coef_terms(valid & ~torch.isneginf(lp), coef, ent_coef, sl)  # a label outside: no logp term
        if k is not None:
            k = torch.where(valid[sl], ent_coef[sl].float(), 0.0)
        bound = g.abs() if k is None else g.abs() + k.abs() * (0.5 + ent_c.clamp_min(0))
        scale = grad_scale(bound, h0.dtype)
        gz = gbuf[:c]
        with device_guard(h0):
            _fused_grad_kernel[(triton.cdiv(c, FUSED_GRAD_BLOCK_N), triton.cdiv(v, block_v))](
                ebuf[:c], gz, mt, lse, ent_c, g, k if k is not None else g, yl[sl], scale, c, v, ebuf.stride(0),
                gz.stride(0), inv_temp, HAS_ENT=k is not None, BLOCK_N=FUSED_GRAD_BLOCK_N, BLOCK_V=block_v,
                num_warps=FUSED_GRAD_WARPS,
            )  # fmt: skip
        unscale = None if h0.dtype != torch.float16 else 1.0 / scale
        if need_h:
            gh[sl] = mm_fp32(gz, w) if unscale is None else mm_fp32(gz, w).mul_(unscale)
        if need_w:
            if single and unscale is None:
                torch.mm(gz.t(), hc, out=gw)
            elif unscale is None:
                gw += mm_fp32(gz.t(), hc)
            else:
                gw += mm_fp32(gz.t(), hc).mul_(unscale)
    return lp, ent, gh, gw


class LinearTokenLogprobsLossFunction(torch.autograd.Function):
    """autograd.Function of the fused-loss path: the forward returns ``(loss, logp, entropy)`` and keeps the two
    input gradients it already computed; the backward only scales them by the loss's upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, coef, ent_coef, temperature, ignore_index, has_ent, backend, group,
                reduce_gh, sm):  # fmt: skip
        inv_temp = 1.0 / temperature
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v_local = weight.shape[0]
        v_off, _ = shard_offset(v_local, group)
        valid = labels != ignore_index
        y_loc = labels - v_off
        owns = valid & (y_loc >= 0) & (y_loc < v_local)
        h0 = zero_ignored_rows(hidden, valid)
        if backend == "triton" and hidden.shape[0] > 0:
            yl = torch.where(owns, y_loc, -1)
            lp, ent, gh, gw = _fused_triton(h0, weight, yl, owns, valid, coef, ent_coef, inv_temp, has_ent, group,
                                            need_h, need_w, sm)  # fmt: skip
        else:
            idx = torch.where(owns, y_loc, 0)
            lp, ent, gh, gw = _fused_torch(h0, weight, idx, owns, valid, coef, ent_coef, inv_temp, has_ent, group,
                                           need_h, need_w, sm)  # fmt: skip
        if need_h and group is not None and reduce_gh:
            import torch.distributed as dist

            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
        loss = _loss_value(lp, ent, valid, coef, ent_coef)
        ctx.save_for_backward(gh.to(hidden.dtype) if need_h else None, gw.to(weight.dtype) if need_w else None)
        ctx.mark_non_differentiable(lp, ent)
        return loss, lp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        gh, gw = ctx.saved_tensors
        go = g_loss.float() if g_loss is not None else None
        gh = None if gh is None or go is None else (gh.float() * go).to(gh.dtype)
        gw = None if gw is None or go is None else (gw.float() * go).to(gw.dtype)
        return gh, gw, None, None, None, None, None, None, None, None, None, None


def _loss_value(lp, ent, valid, coef, ent_coef):
    """The loss over valid tokens; a label outside the sampling mask (``logp = −inf``) adds no ``coef·logp`` term
    (it is reported by its ``−inf`` in the returned ``logp``)."""
    zero = torch.zeros((), dtype=torch.float32, device=lp.device)
    loss = torch.where(valid & ~torch.isneginf(lp), coef.float() * lp, zero).sum()
    if ent_coef is not None:
        loss = loss + (torch.where(valid, ent_coef.float(), zero) * ent).sum()
    return loss


def _check_coef(name: str, x: Tensor, lead: torch.Size, device: torch.device) -> Float[Tensor, " N"]:
    check_float_input(name, x)
    if x.shape != lead:
        raise ArgumentError(f"{name}: expected the shape of labels [{', '.join(map(str, lead))}], got {shape_str(x)}")
    if x.device != device:
        raise ArgumentError(f"{name}: expected the device of hidden ({device}), got {x.device}")
    if x.requires_grad:
        raise ArgumentError(f"{name}: requires grad, but the fused-loss path treats the coefficients as constants "
                            f"(known before the forward); pass {name}.detach(), or use linear_token_logprobs")
    return x.reshape(-1).float().contiguous()


def linear_token_logprobs_loss(
    hidden: Float[Tensor, "*batch H"],
    weight: Float[Tensor, "V H"],
    labels: Int[Tensor, "*batch"],
    coef: Float[Tensor, "*batch"],
    *,
    entropy_coef: Float[Tensor, "*batch"] | None = None,
    return_entropy: bool = False,
    mask: Bool[Tensor, "*batch"] | None = None,
    temperature: float = 1.0,
    top_k: int | Int[Tensor, "*batch"] | None = None,
    top_p: float | Float[Tensor, "*batch"] | None = None,
    ignore_index: int = -100,
    process_group: Any = None,
    allreduce_grad_hidden: bool = True,
    backend: str | None = None,
) -> LogprobsLoss:
    """``loss = Σ_t coef_t·logp_t + Σ_t entropy_coef_t·entropy_t`` with the logits gradient formed in the forward.

    ``logp`` and ``entropy`` are those of ``linear_token_logprobs`` (same formulas, masks, temperature, vocab
    parallelism and flags). When the per-token coefficients of the loss are known before the forward — on-policy
    GRPO/PPO (ratio 1: ``coef = −advantages·loss_mask / num_tokens``), REINFORCE, SFT (``coef = −1/num_tokens``),
    an entropy bonus — ``∂L/∂z = coef·(δ_y − p) + entropy_coef·(−p·(log p + H))`` is known as soon as a row's
    log-normaliser is, so the forward computes both input gradients directly: the logits GEMM runs once
    (6·N·H·V FLOPs for forward+backward instead of 8·N·H·V), as Liger does for its mean/sum cross-entropy. The
    backward only multiplies the stored gradients by the upstream gradient of ``loss``. A loss whose per-token
    gradient depends on ``logp`` itself (PPO clipping after the first epoch, GSPO's sequence ratio) needs the general
    ``linear_token_logprobs``.

    Memory: per row chunk, one ``[rows, V]`` block of ``exp(z − max)`` in the input dtype (≤ 512 MiB, turned into
    the gradient in place; torch path: ~64 MiB of fp32), the fp32 ``[N, H]`` grad-hidden, and — when more than one
    chunk is needed — an fp32 ``[V, H]`` grad-weight accumulator (fp32 across chunks, one rounding at the end).
    Under ``torch.no_grad`` (or inputs that need no grad) it is the plain forward.

    Args:
        coef: ``[...]`` per-token coefficient of ``logp`` in the loss (a constant: it must not require grad).
        entropy_coef: optional ``[...]`` coefficient of the entropy (e.g. ``−β/num_tokens`` for a bonus).
        return_entropy: return the entropy even without ``entropy_coef``.

    The other arguments are those of ``linear_token_logprobs``.

    Sampling-mask replay (``top_k`` / ``top_p``, as in ``linear_token_logprobs``): ``logp`` and ``entropy`` are
    those of the engine's processed distribution. A label outside the kept set has ``logp = −inf`` in the result
    (count them with ``torch.isneginf(res.logp)``) and adds no ``coef·logp`` term to ``loss`` or its gradient (its
    entropy term stays); the kept sets take the masked dense path here (one extra GEMM on Triton for the
    thresholds).

    Returns ``LogprobsLoss(loss, logp, entropy)``; ``loss`` is fp32 and differentiable w.r.t. ``hidden`` and
    ``weight``; masked positions contribute nothing (their coefficients are ignored, NaN there cannot leak).
    """
    h, w, y, temperature, backend = _prepare(
        hidden, weight, labels, mask, temperature, ignore_index, backend, process_group
    )
    lead = hidden.shape[:-1]
    c = _check_coef("coef", coef, lead, hidden.device)
    ec = _check_coef("entropy_coef", entropy_coef, lead, hidden.device) if entropy_coef is not None else None
    check_flags(return_entropy=return_entropy, allreduce_grad_hidden=allreduce_grad_hidden)
    has_ent = return_entropy or ec is not None
    sm = check_sampling(top_k, top_p, lead, shard_offset(weight.shape[0], process_group)[1], y != ignore_index)
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        loss, lp, ent = LinearTokenLogprobsLossFunction.apply(
            h, w, y, c, ec, temperature, int(ignore_index), has_ent, backend, process_group,
            bool(allreduce_grad_hidden), sm,
        )  # fmt: skip
    else:
        lp, ent, _ = _forward(h, w, y, 1.0 / temperature, int(ignore_index), has_ent, backend, process_group,
                              sm)  # fmt: skip
        loss = _loss_value(lp, ent, y != ignore_index, c, ec)
    return LogprobsLoss(loss, lp.reshape(lead), ent.reshape(lead) if has_ent else None)
