"""Per-token log-probabilities (and entropy) of the labels from materialised logits, forward + backward.

``token_logprobs(logits[..., V], labels[...])`` returns ``logp = z_y − logsumexp(z)`` with ``z = logits / T`` in fp32,
and optionally the entropy ``H = logsumexp(z) − Σ_j softmax(z)_j·z_j``. Nothing of size ``[N, V]`` is saved for the
backward except the input logits themselves; the softmax is recomputed blockwise from them and the per-row
``logsumexp`` and entropy saved by the forward.

Gradients (``g`` = upstream grad of logp, ``k`` = upstream grad of the entropy, ``p = softmax(z)``):
``∂/∂z_j = g·(δ_jy − p_j) − k·p_j·(log p_j + H)`` and ``∂/∂logits = (∂/∂z) / T``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    check_float_input,
    check_labels,
    check_temperature,
    interpret_mode,
    resolve_backend,
    rows_per_chunk,
    triton_available,
)

if triton_available():
    import triton
    import triton.language as tl

    def _configs():
        if interpret_mode():
            return [triton.Config({"BLOCK_V": 128}, num_warps=4)]
        return [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv, w in ((2048, 8), (4096, 8), (8192, 16))]

    @triton.autotune(configs=_configs(), key=["V", "HAS_ENT"])
    @triton.jit
    def _token_logprobs_fwd_kernel(
        x_ptr, y_ptr, lp_ptr, ent_ptr, lse_ptr,
        V, stride_x, inv_temp, ignore_index,
        HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One program per row; one pass over the vocabulary with an online max / Σexp / Σexp·(z−m).
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        v_read = tl.where(valid, V, 0)  # ignored rows read nothing (a scalar-bool mask is not portable)
        m = -float("inf")
        s = 0.0
        a = 0.0
        zy = 0.0
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            z = tl.load(x_ptr + row * stride_x + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            z = tl.where(in_v, z, -float("inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            if HAS_ENT:
                dm = tl.where(s > 0, m - m_new, 0.0)
                d = tl.where(in_v, z - m_new, 0.0)
                a = alpha * (a + dm * s) + tl.sum(e * d, axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            zy += tl.sum(tl.where(cols == y, z, 0.0), axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row, lse)
        tl.store(lp_ptr + row, tl.where(valid, zy - lse, 0.0))
        if HAS_ENT:
            tl.store(ent_ptr + row, tl.where(valid, log_s - a / s, 0.0))

    @triton.autotune(configs=_configs(), key=["V", "HAS_ENT"])
    @triton.jit
    def _token_logprobs_bwd_kernel(
        x_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gx_ptr,
        V, stride_x, stride_gx, inv_temp, ignore_index,
        HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        v_read = tl.where(valid, V, 0)
        lse = tl.load(lse_ptr + row)
        g = tl.where(valid, tl.load(glp_ptr + row), 0.0)
        if HAS_ENT:
            k = tl.where(valid, tl.load(gent_ptr + row), 0.0)
            ent = tl.load(ent_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            z = tl.load(x_ptr + row * stride_x + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            lp = z - lse
            p = tl.exp(lp)
            if HAS_ENT:
                gz = p * (-g - k * (lp + ent))
            else:
                gz = -g * p
            gz += tl.where(cols == y, g, 0.0)
            gz = tl.where(valid, gz * inv_temp, 0.0)
            tl.store(gx_ptr + row * stride_gx + cols, gz.to(gx_ptr.dtype.element_ty), mask=in_v)


def _fwd_torch(x, y, valid, inv_temp, has_ent):
    n, v = x.shape
    lp = torch.zeros(n, dtype=torch.float32, device=x.device)
    ent = torch.zeros(n if has_ent else 0, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    step = rows_per_chunk(v)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl]
        z = torch.where(vc.unsqueeze(1), x[sl].float(), 0.0).mul_(inv_temp)
        zy = z.gather(1, torch.where(vc, y[sl], 0).unsqueeze(1)).squeeze(1)
        m = z.amax(dim=1)
        z.sub_(m.unsqueeze(1))
        e = torch.exp(z)
        s = e.sum(dim=1)
        log_s = torch.log(s)
        lse[sl] = m + log_s
        lp[sl] = torch.where(vc, zy - m - log_s, 0.0)
        if has_ent:
            a = torch.linalg.vecdot(e, z)
            ent[sl] = torch.where(vc, log_s - a / s, 0.0)
    return lp, ent, lse


def _bwd_torch(x, y, valid, lse, ent, g, k, inv_temp):
    n, v = x.shape
    gx = torch.empty_like(x)
    step = rows_per_chunk(v)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl]
        gc = torch.where(vc, g[sl], 0.0)
        lp = torch.where(vc.unsqueeze(1), x[sl].float(), 0.0).mul_(inv_temp).sub_(lse[sl].unsqueeze(1))
        if k is not None:
            kc = torch.where(vc, k[sl], 0.0)
            p = torch.exp(lp)
            gz = lp.add_(ent[sl].unsqueeze(1)).mul_(-kc.unsqueeze(1)).sub_(gc.unsqueeze(1)).mul_(p)
        else:
            gz = lp.exp_().mul_(-gc.unsqueeze(1))
        gz.scatter_add_(1, torch.where(vc, y[sl], 0).unsqueeze(1), gc.unsqueeze(1))
        gx[sl] = gz.mul_(inv_temp)
    return gx


class TokenLogprobsFunction(torch.autograd.Function):
    """autograd.Function over 2-D ``logits [N, V]`` and flat ``labels [N]``; returns ``(logp, entropy)`` (entropy is
    an empty tensor when not requested)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, backend):
        inv_temp = 1.0 / temperature
        valid = labels != ignore_index
        n, v = logits.shape
        if backend == "triton" and n > 0:
            lp = torch.empty(n, dtype=torch.float32, device=logits.device)
            ent = torch.empty(n if return_entropy else 0, dtype=torch.float32, device=logits.device)
            lse = torch.empty(n, dtype=torch.float32, device=logits.device)
            _token_logprobs_fwd_kernel[(n,)](  # never hand Triton an empty tensor: lse stands in when unused
                logits, labels, lp, ent if return_entropy else lse, lse, v, logits.stride(0), inv_temp, ignore_index,
                HAS_ENT=return_entropy,
            )  # fmt: skip
        else:
            lp, ent, lse = _fwd_torch(logits, labels, valid, inv_temp, return_entropy)
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.cfg = (inv_temp, ignore_index, return_entropy, backend)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        logits, labels, lse, ent = ctx.saved_tensors
        inv_temp, ignore_index, has_ent, backend = ctx.cfg
        if not ctx.needs_input_grad[0] or (g_lp is None and g_ent is None):
            return (None,) * 6
        n, v = logits.shape
        g = g_lp.float() if g_lp is not None else torch.zeros(n, dtype=torch.float32, device=logits.device)
        k = g_ent.float() if (has_ent and g_ent is not None) else None
        if backend == "triton" and n > 0:
            gx = torch.empty_like(logits)
            kk = k if k is not None else g
            _token_logprobs_bwd_kernel[(n,)](
                logits, labels, lse, ent if k is not None else lse, g.contiguous(), kk.contiguous(), gx,
                v, logits.stride(0), gx.stride(0), inv_temp, ignore_index, HAS_ENT=k is not None,
            )  # fmt: skip
        else:
            gx = _bwd_torch(logits, labels, labels != ignore_index, lse, ent, g, k, inv_temp)
        return gx, None, None, None, None, None


def token_logprobs(
    logits: Float[Tensor, "*batch V"],
    labels: Int[Tensor, "*batch"],
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str | None = None,
) -> Float[Tensor, "*batch"] | tuple[Float[Tensor, "*batch"], Float[Tensor, "*batch"]]:
    """Log-probability of each label, and optionally the entropy, from logits, in fp32.

    Formula: ``z = logits / temperature``; ``logp = z[label] − logsumexp(z)``; ``entropy = logsumexp(z) − Σ p·z``
    with ``p = softmax(z)`` (natural log). Inputs fp32/bf16/fp16, all math in fp32.

    Ignored positions (``labels == ignore_index``) give 0 for both outputs and no gradient; their logits are never
    read into a sum. Differentiable w.r.t. ``logits``, through both outputs. Memory: the backward keeps only the
    logits and two fp32 numbers per row; the torch path works on row chunks of about 64 MiB of fp32.

    Args:
        logits: ``[..., V]`` floating logits.
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.
        temperature: the sampling temperature (> 0); logits are divided by it.
        return_entropy: also return the per-token entropy.
        backend: ``None``/``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Raises ``ValueError`` naming the argument on a non-floating ``logits``, a labels shape that is not
    ``logits.shape[:-1]``, or a label outside ``[0, V)`` that is not ``ignore_index`` (one host sync, skipped
    under ``torch.compile``).
    """
    check_float_input("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ArgumentError(f"logits: expected shape [..., V] with V > 0, got {list(logits.shape)}")
    temperature = check_temperature(temperature)
    v = logits.shape[-1]
    y = check_labels(labels, logits.shape[:-1], v, ignore_index, like="logits")
    backend = resolve_backend(backend, logits)
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    lp, ent, _ = TokenLogprobsFunction.apply(x, y, temperature, int(ignore_index), bool(return_entropy), backend)
    lead = logits.shape[:-1]
    if return_entropy:
        return lp.reshape(lead), ent.reshape(lead)
    return lp.reshape(lead)
