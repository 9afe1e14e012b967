"""Per-token log-probabilities (and entropy) of the labels from materialised logits, forward + backward.

``token_logprobs(logits[..., V], labels[...])`` returns ``logp = z_y − logsumexp(z)`` with ``z = logits / T`` in fp32,
and optionally the entropy ``H = logsumexp(z) − Σ_j softmax(z)_j·z_j``. Nothing of size ``[N, V]`` is saved for the
backward except the input logits themselves; the softmax is recomputed blockwise from them and the per-row
``logsumexp`` and entropy saved by the forward.

``−inf`` logits are valid (probability 0; every ``0·(−inf)`` is guarded).

Gradients (``g`` = upstream grad of logp, ``k`` = upstream grad of the entropy, ``p = softmax(z)``):
``∂/∂z_j = g·(δ_jy − p_j) − k·p_j·(log p_j + H)`` and ``∂/∂logits = (∂/∂z) / T``.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    apply_mask,
    check_float_input,
    check_labels,
    check_same_device,
    check_temperature,
    cols_per_block,
    device_guard,
    resolve_backend,
    rows_per_chunk,
    triton_available,
)

if triton_available():
    import triton
    import triton.language as tl

    from rlblocks.kernels._tiles import online_update, row_configs

    @triton.autotune(configs=row_configs(), key=["V", "HAS_ENT"])
    @triton.jit
    def _token_logprobs_fwd_kernel(
        x_ptr, y_ptr, lp_ptr, ent_ptr, lse_ptr,
        V, stride_x, inv_temp, ignore_index,
        HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One program per row; one pass over the vocabulary with the online (m, s, a) of _tiles.online_update on a
        # [1, BLOCK_V] tile (−inf logits are masked entries: probability 0).
        row = tl.program_id(0).to(tl.int64)
        one = tl.arange(0, 1)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        v_read = tl.where(valid, V, 0)  # ignored rows read nothing (a scalar-bool mask is not portable)
        m = tl.full([1], -float("inf"), tl.float32)
        s = tl.zeros([1], tl.float32)
        a = tl.zeros([1], tl.float32)
        zy = tl.zeros([1], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            z = tl.load(x_ptr + row * stride_x + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            z = tl.where(in_v, z, -float("inf"))[None, :]
            zy += tl.sum(tl.where(cols[None, :] == y, z, 0.0), axis=1)
            m, s, a = online_update(m, s, a, z, HAS_ENT)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row + one, lse)
        tl.store(lp_ptr + row + one, tl.where(valid, zy - lse, 0.0))
        if HAS_ENT:
            tl.store(ent_ptr + row + one, tl.where(valid, log_s - a / s, 0.0))

    @triton.autotune(configs=row_configs(), key=["V", "HAS_ENT"])
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
                gz = tl.where(p > 0, p * (-g - k * (lp + ent)), 0.0)  # p = 0 (a −inf logit): no 0·(−inf)
            else:
                gz = -g * p
            gz += tl.where(cols == y, g, 0.0)
            gz = tl.where(valid, gz * inv_temp, 0.0)
            tl.store(gx_ptr + row * stride_gx + cols, gz.to(gx_ptr.dtype.element_ty), mask=in_v)


def _fwd_torch(x, y, valid, inv_temp, has_ent):
    # One fp32 [rows, V] copy per chunk, shifted in place; exp(z − m) exists one column block at a time. −inf
    # logits are clamped to the most negative finite float after their exp (0) is taken, so e·z has no 0·(−inf).
    n, v = x.shape
    lp = torch.zeros(n, dtype=torch.float32, device=x.device)
    ent = torch.zeros(n if has_ent else 0, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    step = rows_per_chunk(v)
    col = cols_per_block(min(step, max(n, 1)))
    lowest = torch.finfo(torch.float32).min
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl]
        z = torch.where(vc.unsqueeze(1), x[sl].float(), 0.0).mul_(inv_temp)
        zy = z.gather(1, torch.where(vc, y[sl], 0).unsqueeze(1)).squeeze(1)
        m = z.amax(dim=1)
        z.sub_(m.unsqueeze(1))
        s = torch.zeros_like(m)
        a = torch.zeros_like(m)
        for j in range(0, v, col):
            zb = z[:, j : j + col]
            e = torch.exp(zb)
            s += e.sum(dim=1)
            if has_ent:
                a += torch.linalg.vecdot(e, zb.clamp_(min=lowest))
        log_s = torch.log(s)
        lse[sl] = m + log_s
        lp[sl] = torch.where(vc, zy - m - log_s, 0.0)
        if has_ent:
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
            # Where p = 0 (a −inf logit, or an underflow) the clamp keeps (log p + H)·k finite, so the product with
            # p is 0 instead of 0·(−inf); wherever p > 0, log p > −104 and the clamp changes nothing.
            lp.clamp_(min=-1e4)
            gz = lp.add_(ent[sl].unsqueeze(1)).mul_(-kc.unsqueeze(1)).sub_(gc.unsqueeze(1)).mul_(p)
        else:
            gz = lp.exp_().mul_(-gc.unsqueeze(1))
        gz.scatter_add_(1, torch.where(vc, y[sl], 0).unsqueeze(1), gc.unsqueeze(1))
        gx[sl] = gz.mul_(inv_temp)
    return gx


def _forward(logits, labels, inv_temp, ignore_index, has_ent, backend):
    n, v = logits.shape
    if backend == "triton" and n > 0:
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if has_ent else 0, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        with device_guard(logits):
            _token_logprobs_fwd_kernel[(n,)](  # never hand Triton an empty tensor: lse stands in when unused
                logits, labels, lp, ent if has_ent else lse, lse, v, logits.stride(0), inv_temp, ignore_index,
                HAS_ENT=has_ent,
            )  # fmt: skip
        return lp, ent, lse
    return _fwd_torch(logits, labels, labels != ignore_index, inv_temp, has_ent)


class TokenLogprobsFunction(torch.autograd.Function):
    """autograd.Function over 2-D ``logits [N, V]`` and flat ``labels [N]``; returns ``(logp, entropy)`` (entropy is
    an empty tensor when not requested)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, backend):
        inv_temp = 1.0 / temperature
        lp, ent, lse = _forward(logits, labels, inv_temp, ignore_index, return_entropy, backend)
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
            with device_guard(logits):
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
    mask: Bool[Tensor, "*batch"] | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str | None = None,
) -> Float[Tensor, "*batch"] | tuple[Float[Tensor, "*batch"], Float[Tensor, "*batch"]]:
    """Log-probability of each label, and optionally the entropy, from logits, in fp32.

    Formula: ``z = logits / temperature``; ``logp = z[label] − logsumexp(z)``; ``entropy = logsumexp(z) − Σ p·z``
    with ``p = softmax(z)`` (natural log). Inputs fp32/bf16/fp16, all math in fp32.

    Masked positions (``mask`` false, or ``labels == ignore_index``) give 0 for both outputs and no gradient; their
    logits are never read into a sum. ``−inf`` logits (masked vocabulary entries, e.g. a top-k / top-p sampling
    mask) are valid: they have probability 0 and contribute nothing (a label at a ``−inf`` logit has
    ``logp = −inf``); a row whose logits are all ``−inf`` has no distribution and gives NaN.
    Differentiable w.r.t. ``logits``, through both outputs. Memory: the backward keeps only the
    logits and two fp32 numbers per row; the torch path works on row chunks of about 64 MiB of fp32.

    Args:
        logits: ``[..., V]`` floating logits.
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.
        mask: optional ``[...]`` bool (or 0/1) mask of the positions to compute; false acts as ``ignore_index``.
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
    check_same_device(logits=logits, labels=labels, mask=mask)
    lead = logits.shape[:-1]
    y = check_labels(labels, lead, v, ignore_index, like="logits")
    y = apply_mask(y, mask, lead, ignore_index, like="labels")
    backend = resolve_backend(backend, logits)
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        lp, ent, _ = TokenLogprobsFunction.apply(x, y, temperature, int(ignore_index), bool(return_entropy), backend)
    else:
        lp, ent, _ = _forward(x, y, 1.0 / temperature, int(ignore_index), bool(return_entropy), backend)
    if return_entropy:
        return lp.reshape(lead), ent.reshape(lead)
    return lp.reshape(lead)
