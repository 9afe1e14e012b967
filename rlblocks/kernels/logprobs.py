"""Per-token log-probabilities (and entropy) of the labels from materialised logits, forward + backward.

``token_logprobs(logits[..., V], labels[...])`` returns ``logp = z_y − logsumexp(z)`` with ``z = logits / T`` in fp32,
and optionally the entropy ``H = logsumexp(z) − Σ_j softmax(z)_j·z_j``. Nothing of size ``[N, V]`` is saved for the
backward except the input logits themselves; the softmax is recomputed blockwise from them and the per-row
``logsumexp`` and entropy saved by the forward.

``−inf`` logits are valid (probability 0; every ``0·(−inf)`` is guarded). Sampling-mask replay (``top_k`` /
``top_p``, see ``_sampling.py``) is the same mechanism: entries below a per-row threshold are treated as ``−inf``
in the forward and in the backward, so the softmax is the one renormalised over the engine's kept set.

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
    check_flags,
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
from rlblocks.kernels._sampling import (
    Replay,
    check_sampling,
    chunked_select,
    mask_below,
    new_replay,
    num_candidates,
    select,
    sparse_grad,
    sparse_stats,
)

if triton_available():
    import triton
    import triton.language as tl

    from rlblocks.kernels._tiles import online_update, row_configs

    @triton.autotune(configs=row_configs(), key=["V", "HAS_ENT", "HAS_TAU"])
    @triton.jit
    def _token_logprobs_fwd_kernel(
        x_ptr, y_ptr, lp_ptr, ent_ptr, lse_ptr, tau_ptr,
        V, stride_x, inv_temp, ignore_index,
        HAS_ENT: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # One program per row; one pass over the vocabulary with the online (m, s, a) of _tiles.online_update on a
        # [1, BLOCK_V] tile (−inf logits are masked entries: probability 0). HAS_TAU: entries below the row's
        # sampling threshold (top-k / top-p replay) are masked the same way.
        row = tl.program_id(0).to(tl.int64)
        one = tl.arange(0, 1)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        v_read = tl.where(valid, V, 0)  # ignored rows read nothing (a scalar-bool mask is not portable)
        tau = -float("inf")
        if HAS_TAU:
            tau = tl.load(tau_ptr + row)
        m = tl.full([1], -float("inf"), tl.float32)
        s = tl.zeros([1], tl.float32)
        a = tl.zeros([1], tl.float32)
        zy = tl.zeros([1], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            z = tl.load(x_ptr + row * stride_x + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            z = tl.where(in_v & ~(z < tau), z, -float("inf"))[None, :]  # NaN is kept: it must show
            zy += tl.sum(tl.where(cols[None, :] == y, z, 0.0), axis=1)
            m, s, a = online_update(m, s, a, z, HAS_ENT)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row + one, lse)
        tl.store(lp_ptr + row + one, tl.where(valid, zy - lse, 0.0))
        if HAS_ENT:
            tl.store(ent_ptr + row + one, tl.where(valid, log_s - a / s, 0.0))

    @triton.autotune(configs=row_configs(), key=["V", "HAS_ENT", "HAS_TAU"])
    @triton.jit
    def _token_logprobs_bwd_kernel(
        x_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gx_ptr, tau_ptr,
        V, stride_x, stride_gx, inv_temp, ignore_index,
        HAS_ENT: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # glp is 0 on rows whose label has probability 0 (the host zeroes it), so only kept entries get gradient.
        row = tl.program_id(0).to(tl.int64)
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        v_read = tl.where(valid, V, 0)
        tau = -float("inf")
        if HAS_TAU:
            tau = tl.load(tau_ptr + row)
        lse = tl.load(lse_ptr + row)
        g = tl.where(valid, tl.load(glp_ptr + row), 0.0)
        if HAS_ENT:
            k = tl.where(valid, tl.load(gent_ptr + row), 0.0)
            ent = tl.load(ent_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            in_v = cols < V
            z = tl.load(x_ptr + row * stride_x + cols, mask=cols < v_read, other=0.0).to(tl.float32) * inv_temp
            kept = ~(z < tau)
            lp = z - lse
            p = tl.where(kept, tl.exp(lp), 0.0)
            if HAS_ENT:
                gz = tl.where(p == 0, 0.0, p * (-g - k * (lp + ent)))  # p = 0 (a −inf logit): no 0·(−inf)
            else:
                gz = -g * p
            gz += tl.where(cols == y, g, 0.0)
            gz = tl.where(valid, gz * inv_temp, 0.0)
            tl.store(gx_ptr + row * stride_gx + cols, gz.to(gx_ptr.dtype.element_ty), mask=in_v)


def _fwd_torch(x, y, valid, inv_temp, has_ent, sm):
    # One fp32 [rows, V] copy per chunk, shifted in place; exp(z − m) exists one column block at a time. −inf
    # logits are clamped to the most negative finite float after their exp (0) is taken, so e·z has no 0·(−inf).
    # Sampling-mask replay: a chunk whose kept sets lie among each row's candidates is reduced from them alone
    # (sparse); any other chunk gets −inf outside its kept sets and the dense pass below.
    n, v = x.shape
    lp = torch.zeros(n, dtype=torch.float32, device=x.device)
    ent = torch.zeros(n if has_ent else 0, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    step = rows_per_chunk(v)
    col = cols_per_block(min(step, max(n, 1)))
    lowest = torch.finfo(torch.float32).min
    rep = new_replay(n, num_candidates(sm, v), x.device) if sm is not None else None
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl]
        z = torch.where(vc.unsqueeze(1), x[sl].float(), 0.0).mul_(inv_temp)
        zy = z.gather(1, torch.where(vc, y[sl], 0).unsqueeze(1)).squeeze(1)
        if sm is not None:
            sel = select(z, sm.rows(sl), vc, rep.vals.shape[1])
            rep.tau[sl] = sel.tau
            if sel.sparse:
                lse[sl], lp[sl], e_c = sparse_stats(sel.vals, zy, sel.tau, vc, has_ent)
                if has_ent:
                    ent[sl] = e_c
                rep.vals[sl], rep.idx[sl], rep.sparse[sl] = sel.vals, sel.idx, True
                continue
            mask_below(z, sel.tau)
            zy = torch.where(zy < sel.tau, float("-inf"), zy)
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
    return lp, ent, lse, rep


def _sparse_bwd_rows(rep, sl, v, y, vc, lse, ent, gc, kc, inv_temp):
    """fp32 logits gradient of sparse rows ``sl``: zero except at the kept candidates and the label."""
    gz = sparse_grad(rep.vals[sl], lse[sl], ent[sl] if kc is not None else None, gc, kc)
    out = torch.zeros(gz.shape[0], v, dtype=torch.float32, device=gz.device)
    out.scatter_(1, rep.idx[sl], gz)
    out.scatter_add_(1, torch.where(vc, y[sl], 0).unsqueeze(1), gc.unsqueeze(1))
    return out.mul_(inv_temp)


def _bwd_torch(x, y, valid, lse, ent, g, k, inv_temp, rep, rows_all_sparse=False):
    n, v = x.shape
    gx = torch.empty_like(x)
    step = rows_per_chunk(v)
    for r0 in range(0, n, step):
        sl = slice(r0, r0 + step)
        vc = valid[sl]
        gc = torch.where(vc, g[sl], 0.0)
        kc = torch.where(vc, k[sl], 0.0) if k is not None else None
        if rep is not None and rep.sparse is not None and (rows_all_sparse or bool(rep.sparse[sl].all())):
            gx[sl] = _sparse_bwd_rows(rep, sl, v, y, vc, lse, ent, gc, kc, inv_temp)
            continue
        lp = torch.where(vc.unsqueeze(1), x[sl].float(), 0.0).mul_(inv_temp)
        if rep is not None:
            mask_below(lp, rep.tau[sl])
        lp.sub_(lse[sl].unsqueeze(1))
        if kc is not None:
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


def _forward(logits, labels, inv_temp, ignore_index, has_ent, backend, sm=None):
    """``(logp, entropy, lse, replay)``; ``replay`` (the kept sets, ``_sampling.Replay``) is ``None`` without
    top-k/top-p."""
    n, v = logits.shape
    valid = labels != ignore_index
    if backend == "triton" and n > 0:
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if has_ent else 0, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        rep = None
        if sm is not None:
            # kept sets from fp32 row chunks of z (≤ 64 MiB each); when every row's lies among its candidates the
            # outputs follow from them and no kernel runs; otherwise the kernel masks z < tau.
            def make_z(r0, r1):
                return torch.where(valid[r0:r1].unsqueeze(1), logits[r0:r1].float(), 0.0).mul_(inv_temp)

            cs = chunked_select(make_z, n, v, sm, valid, torch.where(valid, labels, 0), rows_per_chunk(v))
            if cs.vals is not None:
                lse, lp, e_c = sparse_stats(cs.vals, cs.zy, cs.tau, valid, has_ent)
                sparse = torch.ones(n, dtype=torch.bool, device=logits.device)
                return lp, (e_c if has_ent else ent), lse, Replay(cs.tau, cs.vals, cs.idx, sparse)
            rep = Replay(cs.tau, None, None, None)
        with device_guard(logits):
            _token_logprobs_fwd_kernel[(n,)](  # never hand Triton an empty tensor: lse stands in when unused
                logits, labels, lp, ent if has_ent else lse, lse, rep.tau if rep is not None else lse, v,
                logits.stride(0), inv_temp, ignore_index, HAS_ENT=has_ent, HAS_TAU=rep is not None,
            )  # fmt: skip
        return lp, ent, lse, rep
    return _fwd_torch(logits, labels, valid, inv_temp, has_ent, sm)


class TokenLogprobsFunction(torch.autograd.Function):
    """autograd.Function over 2-D ``logits [N, V]`` and flat ``labels [N]``; returns ``(logp, entropy)`` (entropy is
    an empty tensor when not requested)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, return_entropy, backend, sm):
        inv_temp = 1.0 / temperature
        lp, ent, lse, rep = _forward(logits, labels, inv_temp, ignore_index, return_entropy, backend, sm)
        dead = torch.isneginf(lp)  # label with probability 0 (outside the kept set): no gradient through logp
        ctx.save_for_backward(logits, labels, lse, ent, dead, *(rep if rep is not None else (None,) * 4))
        ctx.cfg = (inv_temp, ignore_index, return_entropy, backend)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return lp, ent, lse

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_lse):
        logits, labels, lse, ent, dead, *rep = ctx.saved_tensors
        rep = Replay(*rep) if rep[0] is not None else None
        inv_temp, ignore_index, has_ent, backend = ctx.cfg
        if not ctx.needs_input_grad[0] or (g_lp is None and g_ent is None):
            return (None,) * 7
        n, v = logits.shape
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        g = torch.where(dead, zero, g_lp.float()) if g_lp is not None else zero.expand(n).clone()
        k = g_ent.float() if (has_ent and g_ent is not None) else None
        if backend == "triton" and n > 0 and rep is not None and rep.sparse is not None:  # every row sparse
            gx = _bwd_torch(logits, labels, labels != ignore_index, lse, ent, g, k, inv_temp, rep, True)
        elif backend == "triton" and n > 0:
            gx = torch.empty_like(logits)
            kk = k if k is not None else g
            with device_guard(logits):
                _token_logprobs_bwd_kernel[(n,)](
                    logits, labels, lse, ent if k is not None else lse, g.contiguous(), kk.contiguous(), gx,
                    rep.tau if rep is not None else lse, v, logits.stride(0), gx.stride(0), inv_temp, ignore_index,
                    HAS_ENT=k is not None, HAS_TAU=rep is not None,
                )  # fmt: skip
        else:
            gx = _bwd_torch(logits, labels, labels != ignore_index, lse, ent, g, k, inv_temp, rep)
        return gx, None, None, None, None, None, None


def token_logprobs(
    logits: Float[Tensor, "*batch V"],
    labels: Int[Tensor, "*batch"],
    *,
    mask: Bool[Tensor, "*batch"] | None = None,
    temperature: float = 1.0,
    top_k: int | Int[Tensor, "*batch"] | None = None,
    top_p: float | Float[Tensor, "*batch"] | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_outside: bool = False,
    backend: str | None = None,
) -> Float[Tensor, "*batch"] | tuple[Tensor, ...]:
    """Log-probability of each label, and optionally the entropy, from logits, in fp32.

    Formula: ``z = logits / temperature``; ``logp = z[label] − logsumexp(z)``; ``entropy = logsumexp(z) − Σ p·z``
    with ``p = softmax(z)`` (natural log). Inputs fp32/bf16/fp16, all math in fp32.

    Sampling-mask replay (``top_k`` / ``top_p``): the distribution is the one the engine sampled from, in vLLM's
    sampler order and the convention of ``rlblocks.rollout.types`` ("processed" log-probs): ``z = logits / T``, then
    top-k keeps ``z_j >= z_(k)`` (the k-th largest, ties kept), then top-p drops a token when the top-k-renormalised
    mass ranked strictly above it is already ``>= top_p`` (the most probable token is always kept), and ``logp`` /
    ``entropy`` are those of ``softmax`` over the kept set ``S``: ``logp = z_y − logsumexp_{j∈S} z_j``. ``S`` is
    recomputed from these logits (one threshold per row, placed halfway between the smallest kept and the largest
    dropped value so that the backward's recomputation picks the same set; cumulative masses in float64). The
    choice of ``S`` is piecewise constant, so gradients flow through kept entries only:
    ``∂logp/∂z_j = δ_jy − p̃_j`` for ``j ∈ S`` and 0 outside. ``top_k <= 0`` (or ``>= V``) and ``top_p == 1``
    switch a filter off; both take a Python scalar or a per-token tensor of ``labels``' shape.
    The kept sets cost a few host syncs per row chunk (the candidate count, the rows the candidates do not
    settle), so the replay path is not meant for ``torch.compile(fullgraph=True)``; without ``top_k`` / ``top_p``
    nothing changes.

    A label outside ``S`` (the engine sampled a token the trainer's logits exclude, or a label at a ``−inf``
    logit) is reported, not clamped: its ``logp`` is ``−inf`` and it gets no gradient through ``logp``;
    ``return_outside=True`` also returns the bool ``outside`` (true exactly there, false at masked positions), so
    ``outside.sum()`` counts them and ``mask & ~outside`` drops them from a loss.

    Masked positions (``mask`` false, or ``labels == ignore_index``) give 0 for both outputs and no gradient; their
    logits are never read into a sum. ``−inf`` logits (masked vocabulary entries) are valid: they have probability
    0 and contribute nothing; a row whose logits are all ``−inf`` has no distribution and gives NaN. A NaN logit in
    a valid row gives that row NaN (``logp``, entropy and gradient), with or without ``top_k`` / ``top_p``: every
    "is this entry kept" test is written so that NaN fails the *drop* side (``~(z < tau)``, ``p == 0``), and such a
    row is not reported ``outside``.
    Differentiable w.r.t. ``logits``, through both outputs. Memory: the backward keeps only the logits and three
    fp32 numbers per row (lse, entropy, the sampling threshold); the torch path works on row chunks of about
    64 MiB of fp32 (the Triton path finds the thresholds on such chunks too).

    Args:
        logits: ``[..., V]`` floating logits.
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.
        mask: optional ``[...]`` bool (or 0/1) mask of the positions to compute; false acts as ``ignore_index``.
        temperature: the sampling temperature (> 0); logits are divided by it.
        top_k: the engine's top-k (``None`` / ``<= 0``: off), an int or a per-token integer tensor.
        top_p: the engine's top-p in ``(0, 1]`` (``None`` / 1: off), a float or a per-token floating tensor.
        return_entropy: also return the per-token entropy (of the processed distribution with top-k / top-p).
        return_outside: also return the bool ``outside`` described above (last in the tuple).
        backend: ``None``/``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns ``logp``, or a tuple ``(logp, entropy)``, ``(logp, outside)`` or ``(logp, entropy, outside)``.

    Raises ``ValueError`` naming the argument on a non-floating ``logits``, a labels shape that is not
    ``logits.shape[:-1]``, a label outside ``[0, V)`` that is not ``ignore_index``, or a ``top_k`` / ``top_p`` of
    the wrong type, shape or range (value checks: one host sync, skipped under ``torch.compile``).
    """
    check_float_input("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ArgumentError(f"logits: expected shape [..., V] with V > 0, got {list(logits.shape)}")
    temperature = check_temperature(temperature)
    check_flags(return_entropy=return_entropy, return_outside=return_outside)
    v = logits.shape[-1]
    check_same_device(logits=logits, labels=labels, mask=mask)
    lead = logits.shape[:-1]
    y = check_labels(labels, lead, v, ignore_index, like="logits")
    y = apply_mask(y, mask, lead, ignore_index, like="labels")
    sm = check_sampling(top_k, top_p, lead, v, y != ignore_index)
    backend = resolve_backend(backend, logits)
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        lp, ent, _ = TokenLogprobsFunction.apply(
            x, y, temperature, int(ignore_index), bool(return_entropy), backend, sm
        )
    else:
        lp, ent, _, _ = _forward(x, y, 1.0 / temperature, int(ignore_index), bool(return_entropy), backend, sm)
    out = [lp.reshape(lead)]
    if return_entropy:
        out.append(ent.reshape(lead))
    if return_outside:
        out.append(torch.isneginf(lp).reshape(lead))
    return out[0] if len(out) == 1 else tuple(out)
