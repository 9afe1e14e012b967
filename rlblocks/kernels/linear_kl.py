"""Fused LM heads + full-vocabulary student/teacher divergence, never materialising either logits tensor.

``linear_vocab_kl(student_hidden, student_weight, teacher_hidden, teacher_weight, ...)`` equals
``vocab_kl(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, ...)`` (formulas and gradients in
``kl.py``): per-token ``forward`` = KL(p_teacher ‖ q_student), ``reverse`` = KL(q ‖ p), or the β-weighted
``jsd``, with both logits divided by the temperature, in fp32.

Forward: tiles of both logits are reduced on the fly into per-row (max, Σexp) of each side plus the cross term
``Σ exp(z_t − m_t)(z_t − z_s)`` (forward) or ``Σ exp(z_s − m_s)(z_s − z_t)`` (reverse); jsd needs both
log-normalisers first, so it takes a second blockwise pass. Backward: both tiles are recomputed and
``∂/∂z_s`` is contracted into ``grad_student_hidden`` and ``grad_student_weight`` (teacher: constant).
The two hidden sizes may differ; the vocabularies must match.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import check_last_dim, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    check_float_input,
    check_same_device,
    check_temperature,
    contract_grad_chunks,
    device_guard,
    grad_scale,
    interpret_mode,
    num_splits,
    resolve_backend,
    rows_per_chunk,
    triton_available,
    triton_dot_precision,
    zero_ignored_rows,
)
from rlblocks.kernels.kl import _bwd_torch as _kl_bwd_rows
from rlblocks.kernels.kl import _fwd_torch as _kl_fwd_rows
from rlblocks.kernels.kl import check_kind_beta, valid_rows

if triton_available():
    import triton
    import triton.language as tl

    from rlblocks.kernels._tiles import dot_tile, keep_one_fp32_config, tile_configs
    from rlblocks.kernels.kl import jsd_terms, kl_grad, kl_online_update

    @triton.autotune(  # not N in the key (varies per step)
        configs=tile_configs("kl_fwd"), key=["V", "HS", "HT", "KIND", "PASS", "PREC_S"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("hs_ptr")},
    )  # fmt: skip
    @triton.jit
    def _linear_kl_fwd_kernel(
        hs_ptr, ws_ptr, ht_ptr, wt_ptr, ms_ptr, ss_ptr, mt_ptr, st_ptr, a_ptr, lse_s_ptr, lse_t_ptr,
        N, V, HS, HT, stride_hs, stride_ws, stride_ht, stride_wt, inv_temp, NUM_SPLITS, log_beta, log_1mb,
        KIND: tl.constexpr, PASS: tl.constexpr, UPCAST: tl.constexpr, PREC_S: tl.constexpr, PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # PASS 1: per (row block, vocab split) partial max / Σexp of both sides and the forward/reverse cross term.
        # PASS 2 (jsd): partial Σ q·(log q − log m) into ss_ptr and Σ p·(log p − log m) into st_ptr.
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        n_tiles = tl.cdiv(V, BLOCK_V)
        per = tl.cdiv(n_tiles, NUM_SPLITS)
        t_lo = pid_s * per
        t_hi = tl.minimum(t_lo + per, n_tiles)
        ms = tl.full([BLOCK_N], -float("inf"), tl.float32)
        mt = tl.full([BLOCK_N], -float("inf"), tl.float32)
        ss = tl.zeros([BLOCK_N], tl.float32)
        st = tl.zeros([BLOCK_N], tl.float32)
        a = tl.zeros([BLOCK_N], tl.float32)
        if PASS == 2:
            lse_s = tl.load(lse_s_ptr + rows64, mask=row_ok, other=0.0)
            lse_t = tl.load(lse_t_ptr + rows64, mask=row_ok, other=0.0)
        for t in range(t_lo, t_hi):
            cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            cols64 = cols.to(tl.int64)
            zs = dot_tile(hs_ptr, ws_ptr, rows64, row_ok, cols64, col_ok, HS, stride_hs, stride_ws,
                          UPCAST, PREC_S, BLOCK_N, BLOCK_V, BLOCK_K) * inv_temp
            zt = dot_tile(ht_ptr, wt_ptr, rows64, row_ok, cols64, col_ok, HT, stride_ht, stride_wt,
                          UPCAST, PREC_T, BLOCK_N, BLOCK_V, BLOCK_K) * inv_temp
            zs = tl.where(col_ok[None, :], zs, -float("inf"))
            zt = tl.where(col_ok[None, :], zt, -float("inf"))
            if PASS == 1:
                ms, ss, mt, st, a = kl_online_update(ms, ss, mt, st, a, zs, zt, KIND)
            else:
                tq, tp = jsd_terms(zs - lse_s[:, None], zt - lse_t[:, None], log_beta, log_1mb)
                ss += tl.sum(tq, axis=1)
                st += tl.sum(tp, axis=1)
        out = pid_s * N + rows64
        tl.store(ss_ptr + out, ss, mask=row_ok)
        tl.store(st_ptr + out, st, mask=row_ok)
        if PASS == 1:
            tl.store(ms_ptr + out, ms, mask=row_ok)
            tl.store(mt_ptr + out, mt, mask=row_ok)
            tl.store(a_ptr + out, a, mask=row_ok)

    @triton.autotune(
        configs=tile_configs("kl_bwd"), key=["HS", "HT", "KIND", "PREC_S"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("hs_ptr")},
    )  # fmt: skip
    @triton.jit
    def _linear_kl_bwd_kernel(
        hs_ptr, ws_ptr, ht_ptr, wt_ptr, lse_s_ptr, lse_t_ptr, aux_ptr, g_ptr, scale_ptr, gz_ptr,
        N, VC, HS, HT, v_start, stride_hs, stride_ws, stride_ht, stride_wt, stride_gz,
        inv_temp, beta, log_beta, log_1mb,
        KIND: tl.constexpr, UPCAST: tl.constexpr, PREC_S: tl.constexpr, PREC_T: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        lc = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = lc < VC
        cols64 = (v_start + lc).to(tl.int64)
        zs = dot_tile(hs_ptr, ws_ptr, rows64, row_ok, cols64, col_ok, HS, stride_hs, stride_ws,
                      UPCAST, PREC_S, BLOCK_N, BLOCK_V, BLOCK_K) * inv_temp
        zt = dot_tile(ht_ptr, wt_ptr, rows64, row_ok, cols64, col_ok, HT, stride_ht, stride_wt,
                      UPCAST, PREC_T, BLOCK_N, BLOCK_V, BLOCK_K) * inv_temp
        lse_s = tl.load(lse_s_ptr + rows64, mask=row_ok, other=0.0)
        lse_t = tl.load(lse_t_ptr + rows64, mask=row_ok, other=0.0)
        aux = tl.load(aux_ptr + rows64, mask=row_ok, other=0.0)
        g = tl.load(g_ptr + rows64, mask=row_ok, other=0.0) * (inv_temp * tl.load(scale_ptr))
        gz = kl_grad(zs - lse_s[:, None], zt - lse_t[:, None], aux[:, None], beta, log_beta, log_1mb, KIND)
        gz = gz * g[:, None]
        tl.store(gz_ptr + rows64[:, None] * stride_gz + lc[None, :], gz.to(gz_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _fwd_triton(hs, ws, ht, wt, kind, beta, inv_temp):
    n, v = hs.shape[0], ws.shape[0]
    splits = num_splits(n, v, hs.device)
    ms, ss, mt, st, a = (torch.empty(splits, n, dtype=torch.float32, device=hs.device) for _ in range(5))
    lb, l1b = (math.log(beta), math.log1p(-beta)) if kind == 2 else (0.0, 0.0)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)
    common = dict(UPCAST=interpret_mode(), PREC_S=triton_dot_precision(hs.dtype), PREC_T=triton_dot_precision(ht.dtype))
    with device_guard(hs):
        _linear_kl_fwd_kernel[grid](  # pass 1 reads no lse: ms stands in (Triton is never handed an empty tensor)
            hs, ws, ht, wt, ms, ss, mt, st, a, ms, ms, n, v, hs.shape[1], ht.shape[1],
            hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), inv_temp, splits, lb, l1b,
            KIND=kind, PASS=1, **common,
        )  # fmt: skip
    m_s = ms.amax(0)
    m_t = mt.amax(0)
    w_s = torch.exp(ms - m_s)
    w_t = torch.exp(mt - m_t)
    lse_s = m_s + torch.log((w_s * ss).sum(0))
    lse_t = m_t + torch.log((w_t * st).sum(0))
    aux = torch.zeros(n, dtype=torch.float32, device=hs.device)
    if kind == 0:
        kl = (w_t * a).sum(0) / (w_t * st).sum(0) + lse_s - lse_t
    elif kind == 1:
        kl = (w_s * a).sum(0) / (w_s * ss).sum(0) + lse_t - lse_s
        aux = kl
    else:
        with device_guard(hs):
            _linear_kl_fwd_kernel[grid](
                hs, ws, ht, wt, ms, ss, mt, st, a, lse_s, lse_t, n, v, hs.shape[1], ht.shape[1],
                hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), inv_temp, splits, lb, l1b,
                KIND=kind, PASS=2, **common,
            )  # fmt: skip
        kqm, kpm = ss.sum(0), st.sum(0)
        kl = beta * kpm + (1.0 - beta) * kqm
        aux = kqm
    return kl, lse_s, lse_t, aux


def _bwd_triton(hs, ws, ht, wt, lse_s, lse_t, aux, g, kind, beta, inv_temp, need_h, need_w):
    n = hs.shape[0]
    lb, l1b = (math.log(beta), math.log1p(-beta)) if kind == 2 else (0.0, 0.0)
    # |∂KL/∂z_s| is |q − p| ≤ 1 (forward) or q·|log q/p − KL| (reverse, jsd), a q-weighted log-ratio: 2^8 of
    # headroom keeps log-ratios up to ~250 inside fp16 after scaling.
    scale = grad_scale(g, hs.dtype, target=2.0**6)

    def fill(gz, c0, c):
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(c, meta["BLOCK_V"]))
        with device_guard(hs):
            _linear_kl_bwd_kernel[grid](
                hs, ws, ht, wt, lse_s, lse_t, aux, g, scale, gz, n, c, hs.shape[1], ht.shape[1], c0,
                hs.stride(0), ws.stride(0), ht.stride(0), wt.stride(0), gz.stride(0), inv_temp, beta, lb, l1b,
                KIND=kind, UPCAST=interpret_mode(), PREC_S=triton_dot_precision(hs.dtype),
                PREC_T=triton_dot_precision(ht.dtype),
            )  # fmt: skip

    return contract_grad_chunks(hs, ws, fill, need_h, need_w, scale=scale)


def _logits_chunk(h, w32, sl, inv_temp):
    return torch.mm(h[sl].float() * inv_temp, w32.t())


def _fwd_torch(hs, ws, ht, wt, valid, kind, beta, inv_temp):
    n, v = hs.shape[0], ws.shape[0]
    ws32, wt32 = ws.float(), wt.float()
    kl, lse_s, lse_t, aux = (torch.zeros(n, dtype=torch.float32, device=hs.device) for _ in range(4))
    step = max(8, rows_per_chunk(v) // 2)
    for r0 in range(0, n, step):
        sl = slice(r0, min(n, r0 + step))
        zs = _logits_chunk(hs, ws32, sl, inv_temp)
        zt = _logits_chunk(ht, wt32, sl, inv_temp)
        kl[sl], lse_s[sl], lse_t[sl], aux[sl] = _kl_fwd_rows(zs, zt, valid[sl], 1.0, kind, beta)
    return kl, lse_s, lse_t, aux


def _bwd_torch(hs, ws, ht, wt, valid, lse_s, lse_t, aux, g, kind, beta, inv_temp, need_h, need_w):
    n, v = hs.shape[0], ws.shape[0]
    ws32, wt32 = ws.float(), wt.float()
    gh = torch.empty(n, hs.shape[1], dtype=torch.float32, device=hs.device) if need_h else None
    gw = torch.zeros(v, hs.shape[1], dtype=torch.float32, device=hs.device) if need_w else None
    step = max(8, rows_per_chunk(v) // 2)
    for r0 in range(0, n, step):
        sl = slice(r0, min(n, r0 + step))
        hc = hs[sl].float() * inv_temp
        zs = torch.mm(hc, ws32.t())
        zt = _logits_chunk(ht, wt32, sl, inv_temp)
        gz = _kl_bwd_rows(zs, zt, valid[sl], lse_s[sl], lse_t[sl], aux[sl], g[sl], 1.0, kind, beta)
        if need_h:
            torch.mm(gz, ws32, out=gh[sl]).mul_(inv_temp)
        if need_w:
            gw.addmm_(gz.t(), hc)
    return gh, gw


def _forward(hs, ws, ht, wt, valid, kind, beta, inv_temp, backend):
    hs0 = zero_ignored_rows(hs, valid)
    ht0 = zero_ignored_rows(ht, valid)
    if backend == "triton" and hs.shape[0] > 0:
        kl, lse_s, lse_t, aux = _fwd_triton(hs0, ws, ht0, wt, kind, beta, inv_temp)
    else:
        kl, lse_s, lse_t, aux = _fwd_torch(hs0, ws, ht0, wt, valid, kind, beta, inv_temp)
    return torch.where(valid, kl, 0.0), (hs0, ht0, lse_s, lse_t, aux)


class LinearVocabKLFunction(torch.autograd.Function):
    """autograd.Function over 2-D student/teacher hidden states, both LM heads and a flat bool ``valid [N]``."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, valid, kind, beta, temperature, backend):
        inv_temp = 1.0 / temperature
        kl, (hs0, ht0, lse_s, lse_t, aux) = _forward(hs, ws, ht, wt, valid, kind, beta, inv_temp, backend)
        ctx.save_for_backward(hs0, ws, ht0, wt, valid, lse_s, lse_t, aux)
        ctx.cfg = (inv_temp, kind, beta, backend)
        return kl

    @staticmethod
    def backward(ctx, g):
        hs0, ws, ht0, wt, valid, lse_s, lse_t, aux = ctx.saved_tensors
        inv_temp, kind, beta, backend = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 9
        g = torch.where(valid, g.float(), 0.0)
        if backend == "triton" and hs0.shape[0] > 0:
            gh, gw = _bwd_triton(hs0, ws, ht0, wt, lse_s, lse_t, aux, g, kind, beta, inv_temp, need_h, need_w)
        else:
            gh, gw = _bwd_torch(hs0, ws, ht0, wt, valid, lse_s, lse_t, aux, g, kind, beta, inv_temp, need_h, need_w)
        gh = gh.to(hs0.dtype) if need_h else None
        gw = gw.to(ws.dtype) if need_w else None
        return gh, gw, None, None, None, None, None, None, None


def linear_vocab_kl(
    student_hidden: Float[Tensor, "*batch Hs"],
    student_weight: Float[Tensor, "V Hs"],
    teacher_hidden: Float[Tensor, "*batch Ht"],
    teacher_weight: Float[Tensor, "V Ht"],
    *,
    kind: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: Int[Tensor, "*batch"] | None = None,
    ignore_index: int = -100,
    mask: Bool[Tensor, "*batch"] | None = None,
    backend: str | None = None,
) -> Float[Tensor, "*batch"]:
    """Per-token student/teacher divergence from hidden states and LM heads, never materialising ``[N, V]``.

    Same result as ``vocab_kl(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, ...)``: see
    ``vocab_kl`` for ``kind`` (``forward`` = KL(teacher ‖ student), ``reverse`` = KL(student ‖ teacher), ``jsd``),
    ``beta``, ``temperature``, masking (``labels == ignore_index`` / ``mask`` false → 0, no gradient; hidden rows
    there are zeroed before any product). fp32 accumulation for every input dtype.

    Differentiable w.r.t. ``student_hidden`` and ``student_weight``; the teacher is a constant (teacher tensors
    that require grad are rejected). Extra memory: one chunk of both logits (torch path, plus fp32 copies of bf16
    weights) or a ``[N, vocab-chunk]`` gradient block (Triton), never ``[N, V]``. A hidden size of 0 (``Hs`` or
    ``Ht``) raises :class:`~rlblocks.errors.ArgumentError`; an empty batch gives an empty result.
    """
    for name, x in (("student_hidden", student_hidden), ("student_weight", student_weight),
                    ("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):  # fmt: skip
        check_float_input(name, x)
    check_last_dim("student_hidden", student_hidden, "Hs")
    hs_dim = student_hidden.shape[-1]
    if student_weight.dim() != 2 or student_weight.shape[1] != hs_dim or student_weight.shape[0] == 0:
        raise ArgumentError(f"student_weight: expected shape [V, {hs_dim}] (H = student_hidden.shape[-1]), "
                         f"got {shape_str(student_weight)}")
    lead = student_hidden.shape[:-1]
    if teacher_hidden.dim() < 1 or teacher_hidden.shape[:-1] != lead:
        raise ArgumentError(f"teacher_hidden: expected shape [{', '.join(map(str, lead))}, Ht] (the leading shape of "
                         f"student_hidden), got {shape_str(teacher_hidden)}")
    check_last_dim("teacher_hidden", teacher_hidden, "Ht")
    v = student_weight.shape[0]
    ht_dim = teacher_hidden.shape[-1]
    if teacher_weight.dim() != 2 or teacher_weight.shape != (v, ht_dim):
        raise ArgumentError(f"teacher_weight: expected shape [{v}, {ht_dim}] (V of student_weight, "
                         f"H = teacher_hidden.shape[-1]), got {shape_str(teacher_weight)}")
    if student_weight.dtype != student_hidden.dtype:
        raise ArgumentError(f"student_weight: expected the dtype of student_hidden ({student_hidden.dtype}), "
                         f"got {student_weight.dtype}")
    if teacher_weight.dtype != teacher_hidden.dtype:
        raise ArgumentError(f"teacher_weight: expected the dtype of teacher_hidden ({teacher_hidden.dtype}), "
                         f"got {teacher_weight.dtype}")
    for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if x.requires_grad:
            raise ArgumentError(f"{name}: requires grad, but linear_vocab_kl is differentiable only w.r.t. the "
                             f"student; pass {name}.detach()")
    check_same_device(student_hidden=student_hidden, student_weight=student_weight, teacher_hidden=teacher_hidden,
                      teacher_weight=teacher_weight, labels=labels, mask=mask)
    k = check_kind_beta(kind, beta)
    temperature = check_temperature(temperature)
    valid = valid_rows(lead, v, labels, ignore_index, mask, "student_hidden", student_hidden.device)
    backend = resolve_backend(backend, student_hidden, student_weight, teacher_hidden, teacher_weight)
    hs = student_hidden.reshape(-1, hs_dim)
    ht = teacher_hidden.reshape(-1, ht_dim)
    hs, ht, ws, wt = (x if x.stride(-1) == 1 else x.contiguous() for x in (hs, ht, student_weight, teacher_weight))
    if torch.is_grad_enabled() and (hs.requires_grad or ws.requires_grad):
        kl = LinearVocabKLFunction.apply(hs, ws, ht, wt, valid, k, float(beta), temperature, backend)
    else:
        kl = _forward(hs, ws, ht, wt, valid, k, float(beta), 1.0 / temperature, backend)[0]
    return kl.reshape(lead)
