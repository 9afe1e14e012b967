"""Per-token full-vocabulary divergence between a student and a teacher distribution (on-policy distillation).

With ``z_s = student_logits / T``, ``z_t = teacher_logits / T`` (fp32), ``q = softmax(z_s)`` (student) and
``p = softmax(z_t)`` (teacher):

- ``kind="forward"``: ``KL(p ‖ q) = Σ_j p_j (log p_j − log q_j)`` (mode covering; classic distillation).
- ``kind="reverse"``: ``KL(q ‖ p) = Σ_j q_j (log q_j − log p_j)`` (mode seeking; on-policy distillation).
- ``kind="jsd"``: ``β·KL(p ‖ m) + (1−β)·KL(q ‖ m)`` with ``m = β·p + (1−β)·q`` (β-weighted Jensen–Shannon; β = 0.5
  is the symmetric JSD, bounded by log 2). ``0 < β < 1``.

Gradient w.r.t. ``z_s`` (the teacher is a constant): forward ``q − p``; reverse ``q·(log q − log p − KL)``;
jsd ``(1−β)·q·(log(q/m) − KL(q ‖ m))``; then ``∂/∂student_logits = (∂/∂z_s) / T``.
The backward keeps only the two logits tensors (inputs) and three fp32 numbers per row; it recomputes the softmaxes
blockwise.
"""

from __future__ import annotations

import math
import numbers

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import as_bool_mask, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    check_float_input,
    check_labels,
    check_same_device,
    check_temperature,
    device_guard,
    resolve_backend,
    rows_per_chunk,
    triton_available,
)

KINDS = {"forward": 0, "reverse": 1, "jsd": 2}

if triton_available():
    import triton
    import triton.language as tl

    from rlblocks.kernels._tiles import log_mix, max_shift, row_configs

    @triton.jit
    def kl_online_update(ms, ss, mt, st, a, zs, zt, KIND: tl.constexpr):
        """Running per-row (max, Σexp) of the student ``zs`` and teacher ``zt`` tiles [rows, cols] (``−inf`` =
        masked entry), and for forward/reverse the cross term ``Σ exp(z_t − m_t)(z_t − z_s)`` /
        ``Σ exp(z_s − m_s)(z_s − z_t)``; a term whose weight is 0 is 0 (no 0·(−inf) or 0·NaN from −inf − −inf).
        The test is ``weight == 0``, never ``weight > 0``: a NaN weight (a NaN logit) must reach the sum."""
        ms_new, ms_use, al_s = max_shift(ms, zs)
        mt_new, mt_use, al_t = max_shift(mt, zt)
        es = tl.exp(zs - ms_use[:, None])
        et = tl.exp(zt - mt_use[:, None])
        if KIND == 0:
            a = al_t * a + tl.sum(tl.where(et == 0, 0.0, et * (zt - zs)), axis=1)
        if KIND == 1:
            a = al_s * a + tl.sum(tl.where(es == 0, 0.0, es * (zs - zt)), axis=1)
        ss = al_s * ss + tl.sum(es, axis=1)
        st = al_t * st + tl.sum(et, axis=1)
        return ms_new, ss, mt_new, st, a

    @triton.jit
    def jsd_terms(lq, lp, log_beta, log_1mb):
        """Per-entry ``q·(log q − log m)`` and ``p·(log p − log m)`` of the JSD, 0 where the weight is 0 (NaN
        where a log-prob is NaN)."""
        lm = log_mix(lp, lq, log_beta, log_1mb)
        tq = tl.where(lq == -float("inf"), 0.0, tl.exp(lq) * (lq - lm))
        tp = tl.where(lp == -float("inf"), 0.0, tl.exp(lp) * (lp - lm))
        return tq, tp

    @triton.jit
    def kl_grad(lq, lp, aux, beta, log_beta, log_1mb, KIND: tl.constexpr):
        """∂KL/∂z_s per entry (before the upstream grad and 1/T): forward q − p, reverse q·(log q − log p − KL),
        jsd (1−β)·q·(log(q/m) − KL(q‖m)); 0 where q = 0 (NaN where q is NaN)."""
        q = tl.exp(lq)
        if KIND == 0:
            gz = q - tl.exp(lp)
        elif KIND == 1:
            gz = tl.where(q == 0, 0.0, q * (lq - lp - aux))
        else:
            gz = tl.where(q == 0, 0.0, (1.0 - beta) * q * (lq - log_mix(lp, lq, log_beta, log_1mb) - aux))
        return gz

    @triton.autotune(configs=row_configs(), key=["V", "KIND"])
    @triton.jit
    def _vocab_kl_fwd_kernel(
        s_ptr, t_ptr, valid_ptr, kl_ptr, lse_s_ptr, lse_t_ptr, aux_ptr,
        V, stride_s, stride_t, inv_temp, beta, log_beta, log_1mb,
        KIND: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        one = tl.arange(0, 1)
        valid = tl.load(valid_ptr + row) != 0
        v_read = tl.where(valid, V, 0)
        ms = tl.full([1], -float("inf"), tl.float32)
        mt = tl.full([1], -float("inf"), tl.float32)
        ss = tl.zeros([1], tl.float32)
        st = tl.zeros([1], tl.float32)
        a = tl.zeros([1], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            zs = tl.load(s_ptr + row * stride_s + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            zt = tl.load(t_ptr + row * stride_t + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            zs = tl.where(in_v, zs, -float("inf"))[None, :]
            zt = tl.where(in_v, zt, -float("inf"))[None, :]
            ms, ss, mt, st, a = kl_online_update(ms, ss, mt, st, a, zs, zt, KIND)
        lse_s = ms + tl.log(ss)
        lse_t = mt + tl.log(st)
        aux = tl.zeros([1], tl.float32)
        if KIND == 0:
            kl = a / st + lse_s - lse_t
        elif KIND == 1:
            kl = a / ss + lse_t - lse_s
            aux = kl
        else:
            kqm = tl.zeros([1], tl.float32)
            kpm = tl.zeros([1], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                in_v = cols < V
                zs0 = tl.load(s_ptr + row * stride_s + cols, mask=cols < v_read, other=0.0).to(tl.float32)
                zt0 = tl.load(t_ptr + row * stride_t + cols, mask=cols < v_read, other=0.0).to(tl.float32)
                lq = tl.where(in_v, zs0 * inv_temp, -float("inf"))[None, :] - lse_s[:, None]
                lp = tl.where(in_v, zt0 * inv_temp, -float("inf"))[None, :] - lse_t[:, None]
                tq, tp = jsd_terms(lq, lp, log_beta, log_1mb)
                kqm += tl.sum(tq, axis=1)
                kpm += tl.sum(tp, axis=1)
            kl = beta * kpm + (1.0 - beta) * kqm
            aux = kqm
        # v_read > 0 is `valid`, recomputed from a register that is live across the loops anyway: keeping the
        # predicate itself live made ptxas (triton 3.6) park it in local memory, flagged by the resource report
        tl.store(kl_ptr + row + one, tl.where(v_read > 0, kl, 0.0))
        tl.store(lse_s_ptr + row + one, lse_s)
        tl.store(lse_t_ptr + row + one, lse_t)
        tl.store(aux_ptr + row + one, aux)

    @triton.autotune(configs=row_configs(), key=["V", "KIND"])
    @triton.jit
    def _vocab_kl_bwd_kernel(
        s_ptr, t_ptr, valid_ptr, lse_s_ptr, lse_t_ptr, aux_ptr, g_ptr, gs_ptr,
        V, stride_s, stride_t, stride_gs, inv_temp, beta, log_beta, log_1mb,
        KIND: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        valid = tl.load(valid_ptr + row) != 0
        v_read = tl.where(valid, V, 0)
        g = tl.where(valid, tl.load(g_ptr + row), 0.0) * inv_temp
        lse_s = tl.load(lse_s_ptr + row)
        lse_t = tl.load(lse_t_ptr + row)
        aux = tl.load(aux_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            zs0 = tl.load(s_ptr + row * stride_s + cols, mask=cols < v_read, other=0.0).to(tl.float32)
            zt0 = tl.load(t_ptr + row * stride_t + cols, mask=cols < v_read, other=0.0).to(tl.float32)
            gz = kl_grad(zs0 * inv_temp - lse_s, zt0 * inv_temp - lse_t, aux, beta, log_beta, log_1mb, KIND)
            gz = tl.where(valid, gz * g, 0.0)
            tl.store(gs_ptr + row * stride_gs + cols, gz.to(gs_ptr.dtype.element_ty), mask=in_v)


def _xdiff(w: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """``Σ_j w_j·(x_j − y_j)`` per row, with the terms of weight 0 left out (so ``−inf`` log-probs there, where
    ``x − y`` is ``−inf`` or NaN, add nothing). A weight > 0 against ``y = −inf`` gives ``+inf``, the true value.
    A NaN weight (a NaN logit in the row) is kept, so the row's value is NaN: the test is ``w == 0``, not
    ``w > 0``, which would read NaN as "weight 0" and return a finite divergence for a broken row."""
    return torch.where(w == 0, 0.0, w * (x - y)).sum(dim=1)


def _chunk_terms(zs, zt, kind, beta):
    """fp32 log q, log p (and log m for jsd) of a row chunk; logits already divided by T."""
    lq = torch.log_softmax(zs, dim=1)
    lp = torch.log_softmax(zt, dim=1)
    lm = None
    if kind == 2:
        lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
    return lq, lp, lm


def _fwd_torch(s, t, valid, inv_temp, kind, beta):
    n, v = s.shape
    kl, lse_s, lse_t, aux = (torch.zeros(n, dtype=torch.float32, device=s.device) for _ in range(4))
    step = max(rows_per_chunk(v, multiple=8) // 2, 8)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl].unsqueeze(1)
        zs = torch.where(vc, s[sl].float(), 0.0).mul_(inv_temp)
        zt = torch.where(vc, t[sl].float(), 0.0).mul_(inv_temp)
        lse_s[sl] = torch.logsumexp(zs, dim=1)
        lse_t[sl] = torch.logsumexp(zt, dim=1)
        lq, lp, lm = _chunk_terms(zs, zt, kind, beta)
        if kind == 0:
            val = _xdiff(lp.exp(), lp, lq)
        elif kind == 1:
            val = _xdiff(lq.exp(), lq, lp)
            aux[sl] = val
        else:
            kqm = _xdiff(lq.exp(), lq, lm)
            kpm = _xdiff(lp.exp(), lp, lm)
            val = beta * kpm + (1.0 - beta) * kqm
            aux[sl] = kqm
        kl[sl] = torch.where(valid[sl], val, 0.0)
    return kl, lse_s, lse_t, aux


def _bwd_torch(s, t, valid, lse_s, lse_t, aux, g, inv_temp, kind, beta):
    n, v = s.shape
    gs = torch.empty_like(s)
    step = max(rows_per_chunk(v, multiple=8) // 2, 8)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl].unsqueeze(1)
        lq = torch.where(vc, s[sl].float(), 0.0).mul_(inv_temp).sub_(lse_s[sl].unsqueeze(1))
        lp = torch.where(vc, t[sl].float(), 0.0).mul_(inv_temp).sub_(lse_t[sl].unsqueeze(1))
        q = torch.exp(lq)
        if kind == 0:
            gz = q.sub_(lp.exp_())
        elif kind == 1:
            gz = torch.where(q == 0, 0.0, q * (lq - lp - aux[sl].unsqueeze(1)))
        else:
            lm = torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))
            gz = torch.where(q == 0, 0.0, q * (lq - lm - aux[sl].unsqueeze(1))).mul_(1.0 - beta)
        gc = torch.where(valid[sl], g[sl].float(), 0.0) * inv_temp
        gs[sl] = torch.where(vc, gz.mul_(gc.unsqueeze(1)), 0.0)
    return gs


def _forward(student, teacher, valid, kind, beta, inv_temp, backend):
    n, v = student.shape
    if backend == "triton" and n > 0:
        kl, lse_s, lse_t, aux = (torch.empty(n, dtype=torch.float32, device=student.device) for _ in range(4))
        lb = math.log(beta) if kind == 2 else 0.0
        l1b = math.log1p(-beta) if kind == 2 else 0.0
        with device_guard(student):
            _vocab_kl_fwd_kernel[(n,)](
                student, teacher, valid.to(torch.int8), kl, lse_s, lse_t, aux,
                v, student.stride(0), teacher.stride(0), inv_temp, beta, lb, l1b, KIND=kind,
            )  # fmt: skip
        return kl, lse_s, lse_t, aux
    return _fwd_torch(student, teacher, valid, inv_temp, kind, beta)


class VocabKLFunction(torch.autograd.Function):
    """autograd.Function over 2-D student/teacher logits ``[N, V]`` and a flat bool ``valid [N]``."""

    @staticmethod
    def forward(ctx, student, teacher, valid, kind, beta, temperature, backend):
        inv_temp = 1.0 / temperature
        kl, lse_s, lse_t, aux = _forward(student, teacher, valid, kind, beta, inv_temp, backend)
        ctx.save_for_backward(student, teacher, valid, lse_s, lse_t, aux)
        ctx.cfg = (inv_temp, kind, beta, backend)
        return kl

    @staticmethod
    def backward(ctx, g):
        student, teacher, valid, lse_s, lse_t, aux = ctx.saved_tensors
        inv_temp, kind, beta, backend = ctx.cfg
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        n, v = student.shape
        if backend == "triton" and n > 0:
            gs = torch.empty_like(student)
            lb = math.log(beta) if kind == 2 else 0.0
            l1b = math.log1p(-beta) if kind == 2 else 0.0
            with device_guard(student):
                _vocab_kl_bwd_kernel[(n,)](
                    student, teacher, valid.to(torch.int8), lse_s, lse_t, aux, g.float().contiguous(), gs,
                    v, student.stride(0), teacher.stride(0), gs.stride(0), inv_temp, beta, lb, l1b, KIND=kind,
                )  # fmt: skip
        else:
            gs = _bwd_torch(student, teacher, valid, lse_s, lse_t, aux, g, inv_temp, kind, beta)
        return gs, None, None, None, None, None, None


def check_kind_beta(kind: str, beta: float) -> int:
    if kind not in KINDS:
        raise ArgumentError(f"kind: expected one of {sorted(KINDS)}, got {kind!r}")
    real = isinstance(beta, numbers.Real) and not isinstance(beta, bool)  # numpy floats fine, tensors not
    if kind == "jsd" and not (real and 0.0 < float(beta) < 1.0):
        raise ArgumentError(f"beta: expected a float in (0, 1) for kind='jsd', got {beta!r}")
    return KINDS[kind]


def valid_rows(
    lead_shape: torch.Size,
    num_classes: int,
    labels: Tensor | None,
    ignore_index: int,
    mask: Tensor | None,
    like: str,
    device: torch.device,
) -> Bool[Tensor, " N"]:
    """Flat bool ``[N]``: ``labels != ignore_index`` (when labels are given) AND ``mask`` (when given)."""
    valid = torch.ones(lead_shape, dtype=torch.bool, device=device).reshape(-1)
    if labels is not None:
        y = check_labels(labels, lead_shape, num_classes, ignore_index, like=like)
        valid = valid & (y != ignore_index)
    if mask is not None:
        ref = torch.empty(lead_shape, device="meta")
        valid = valid & as_bool_mask(mask, ref, name="mask", like_name=like + "[..., 0]").reshape(-1)
    return valid


def vocab_kl(
    student_logits: Float[Tensor, "*batch V"],
    teacher_logits: Float[Tensor, "*batch V"],
    *,
    kind: str = "forward",
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: Int[Tensor, "*batch"] | None = None,
    ignore_index: int = -100,
    mask: Bool[Tensor, "*batch"] | None = None,
    backend: str | None = None,
) -> Float[Tensor, "*batch"]:
    """Per-token divergence over the full vocabulary between student and teacher softmaxes, in fp32.

    See the module docstring for the three ``kind`` formulas (``forward`` = KL(teacher ‖ student),
    ``reverse`` = KL(student ‖ teacher), ``jsd`` = β-weighted JSD). Both logits are divided by ``temperature``.
    Positions where ``labels == ignore_index`` (if ``labels`` is given) or ``mask`` is false (if given) give 0 and
    no gradient; their logits are never read into a sum. ``−inf`` logits (a masked vocabulary entry, e.g. a shared
    sampling mask) are valid: an entry with probability 0 contributes nothing, so the result is finite whenever
    the divergence is (it is ``+inf`` only when one side puts mass where the other has none, e.g. forward KL with a
    teacher entry > 0 at a ``−inf`` student logit). Differentiable w.r.t. ``student_logits`` only; the teacher
    is a constant (a ``teacher_logits`` that requires grad is rejected rather than silently detached).
    Inputs fp32/bf16/fp16, math in fp32.

    NaN in a valid row (a NaN logit of the student or the teacher) gives that row NaN, value and gradient, for
    every ``kind`` and backend: a term is left out of a sum only when its weight is exactly 0, never because a
    comparison with NaN is false.

    Raises ``ValueError`` naming the argument for non-floating inputs, shape mismatches, an unknown ``kind``,
    ``beta`` outside (0, 1) for jsd, or labels out of range.
    """
    check_float_input("student_logits", student_logits)
    check_float_input("teacher_logits", teacher_logits)
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ArgumentError(f"student_logits: expected shape [..., V] with V > 0, got {shape_str(student_logits)}")
    if teacher_logits.shape != student_logits.shape:
        raise ArgumentError(f"teacher_logits: expected the shape of student_logits {shape_str(student_logits)}, "
                         f"got {shape_str(teacher_logits)}")
    if teacher_logits.requires_grad:
        raise ArgumentError("teacher_logits: requires grad, but vocab_kl is differentiable only w.r.t. the student; "
                         "pass teacher_logits.detach()")
    check_same_device(student_logits=student_logits, teacher_logits=teacher_logits, labels=labels, mask=mask)
    k = check_kind_beta(kind, beta)
    temperature = check_temperature(temperature)
    v = student_logits.shape[-1]
    lead = student_logits.shape[:-1]
    valid = valid_rows(lead, v, labels, ignore_index, mask, "student_logits", student_logits.device)
    backend = resolve_backend(backend, student_logits, teacher_logits)
    s = student_logits.reshape(-1, v)
    t = teacher_logits.reshape(-1, v)
    s = s if s.stride(-1) == 1 else s.contiguous()
    t = t if t.stride(-1) == 1 else t.contiguous()
    if torch.is_grad_enabled() and s.requires_grad:
        kl = VocabKLFunction.apply(s, t, valid, k, float(beta), temperature, backend)
    else:
        kl = _forward(s, t, valid, k, float(beta), 1.0 / temperature, backend)[0]
    return kl.reshape(lead)
