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
and a chunked torch path (rows in chunks of ~64 MiB of fp32 logits; fp32 matmuls).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._validate import shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import (
    allreduce_stats,
    apply_mask,
    check_float_input,
    check_labels,
    check_same_device,
    check_temperature,
    cols_per_block,
    contract_grad_chunks,
    device_guard,
    grad_scale,
    interpret_mode,
    merge_partials,
    num_splits,
    resolve_backend,
    rows_per_chunk,
    shard_offset,
    triton_available,
    triton_dot_precision,
    zero_ignored_rows,
)

if triton_available():
    import triton
    import triton.language as tl

    from rlblocks.kernels._tiles import dot_tile, keep_one_fp32_config, online_update, tile_configs

    @triton.autotune(  # not N in the key: it changes every RL step
        configs=tile_configs("fwd"), key=["V", "H", "HAS_ENT"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("h_ptr")},
    )  # fmt: skip
    @triton.jit
    def _linear_logprobs_fwd_kernel(
        h_ptr, w_ptr, yl_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
        N, V, H, stride_hn, stride_wv, inv_temp, NUM_SPLITS,
        HAS_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program (row block, vocab split): loops over its vocab tiles; each tile is a [BLOCK_N, BLOCK_V] fp32
        # accumulator of hidden @ Wᵀ built from BLOCK_K slices with tl.dot, then folded into online stats.
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        yl = tl.load(yl_ptr + rows64, mask=row_ok, other=-1)
        n_tiles = tl.cdiv(V, BLOCK_V)
        per = tl.cdiv(n_tiles, NUM_SPLITS)
        t_lo = pid_s * per
        t_hi = tl.minimum(t_lo + per, n_tiles)
        m = tl.full([BLOCK_N], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_N], tl.float32)
        a = tl.zeros([BLOCK_N], tl.float32)
        zy = tl.zeros([BLOCK_N], tl.float32)
        for t in range(t_lo, t_hi):
            cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
            col_ok = cols < V
            cols64 = cols.to(tl.int64)
            acc = dot_tile(h_ptr, w_ptr, rows64, row_ok, cols64, col_ok, H, stride_hn, stride_wv,
                           UPCAST, PREC, BLOCK_N, BLOCK_V, BLOCK_K)
            z = tl.where(col_ok[None, :], acc * inv_temp, -float("inf"))
            zy += tl.sum(tl.where(cols[None, :] == yl[:, None], z, 0.0), axis=1)
            m, s, a = online_update(m, s, a, z, HAS_ENT)
        out = pid_s * N + rows64
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, s, mask=row_ok)
        tl.store(zy_ptr + out, zy, mask=row_ok)
        if HAS_ENT:
            tl.store(a_ptr + out, a, mask=row_ok)

    @triton.autotune(
        configs=tile_configs("bwd"), key=["H", "HAS_ENT"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("h_ptr")},
    )  # fmt: skip
    @triton.jit
    def _linear_logprobs_bwd_kernel(
        h_ptr, w_ptr, yl_ptr, lse_ptr, ent_ptr, g_ptr, k_ptr, scale_ptr, gz_ptr,
        N, VC, H, v_start, stride_hn, stride_wv, stride_gz, inv_temp,
        HAS_ENT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Recompute one [BLOCK_N, BLOCK_V] logits tile of the vocab chunk [v_start, v_start + VC) and write
        # scale·(∂/∂z)/T for it; the host contracts the chunk with cuBLAS into grad_hidden and grad_weight.
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        lc = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
        col_ok = lc < VC
        cols64 = (v_start + lc).to(tl.int64)  # row of the local weight shard
        acc = dot_tile(h_ptr, w_ptr, rows64, row_ok, cols64, col_ok, H, stride_hn, stride_wv,
                       UPCAST, PREC, BLOCK_N, BLOCK_V, BLOCK_K)
        yl = tl.load(yl_ptr + rows64, mask=row_ok, other=-1)
        lse = tl.load(lse_ptr + rows64, mask=row_ok, other=0.0)
        g = tl.load(g_ptr + rows64, mask=row_ok, other=0.0)
        lp = acc * inv_temp - lse[:, None]
        p = tl.exp(lp)
        if HAS_ENT:
            k = tl.load(k_ptr + rows64, mask=row_ok, other=0.0)
            ent = tl.load(ent_ptr + rows64, mask=row_ok, other=0.0)
            gz = p * (-g[:, None] - k[:, None] * (lp + ent[:, None]))
        else:
            gz = -g[:, None] * p
        gz += tl.where(cols64[None, :] == yl[:, None], g[:, None], 0.0)
        gz = gz * (inv_temp * tl.load(scale_ptr))
        tl.store(gz_ptr + rows64[:, None] * stride_gz + lc[None, :], gz.to(gz_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _fwd_stats_triton(h, w, yl, inv_temp, has_ent):
    n, hdim = h.shape
    v = w.shape[0]
    splits = num_splits(n, v, h.device)
    m, s, a, zy = (torch.empty(splits, n, dtype=torch.float32, device=h.device) for _ in range(4))
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)
    with device_guard(h):
        _linear_logprobs_fwd_kernel[grid](
            h, w, yl, m, s, a, zy, n, v, hdim, h.stride(0), w.stride(0), inv_temp, splits,
            HAS_ENT=has_ent, UPCAST=interpret_mode(), PREC=triton_dot_precision(h.dtype),
        )  # fmt: skip
    mm, ss, aa = merge_partials(m, s, a if has_ent else None)
    return mm, ss, aa, zy.sum(dim=0)


def _torch_rows(n: int, v: int) -> int:
    """Rows per chunk of the torch path: the chunk budget, and at most half the rows, so the extra memory stays
    below half of the fp32 logits even for small problems."""
    return max(1, min(rows_per_chunk(v), max(8, -(-n // 2))))


def _fwd_stats_torch(h, w, idx, owns, inv_temp, has_ent):
    # One [rows, V] fp32 buffer: logits, shifted in place; exp(z − m) exists only one column block at a time.
    n = h.shape[0]
    v = w.shape[0]
    w32 = w.float()
    m, s, zy = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))
    a = torch.empty(n, dtype=torch.float32, device=h.device) if has_ent else None
    step = _torch_rows(n, v)
    zbuf = torch.empty(min(step, n), v, dtype=torch.float32, device=h.device)
    col = cols_per_block(min(step, n)) if has_ent else v
    for r0 in range(0, n, step):
        sl = slice(r0, min(r0 + step, n))
        c = sl.stop - sl.start
        z = torch.mm(h[sl].float() * inv_temp, w32.t(), out=zbuf[:c])
        zy[sl] = torch.where(owns[sl], z.gather(1, idx[sl].unsqueeze(1)).squeeze(1), 0.0)
        mc = z.amax(dim=1)
        z.sub_(mc.unsqueeze(1))
        m[sl] = mc
        if not has_ent:
            s[sl] = z.exp_().sum(dim=1)
            continue
        sc = torch.zeros(c, dtype=torch.float32, device=h.device)
        ac = torch.zeros(c, dtype=torch.float32, device=h.device)
        for j in range(0, v, col):
            zb = z[:, j : j + col]
            e = torch.exp(zb)
            sc += e.sum(dim=1)
            ac += torch.linalg.vecdot(e, zb)
        s[sl] = sc
        a[sl] = ac
    return m, s, a, zy


def _bwd_triton(h, w, yl, lse, ent, g, k, inv_temp, need_h, need_w):
    # |∂/∂z_j| ≤ |g| + |k|·(1/e + H) per row (p·|log p| ≤ 1/e, Σ p = 1): the bound the fp16 scale is taken from.
    bound = g.abs() if k is None else g.abs() + k.abs() * (0.5 + ent.clamp_min(0))
    scale = grad_scale(bound, h.dtype)
    kk = k if k is not None else g

    def fill(gz, c0, c):
        grid = lambda meta: (triton.cdiv(h.shape[0], meta["BLOCK_N"]), triton.cdiv(c, meta["BLOCK_V"]))
        with device_guard(h):
            _linear_logprobs_bwd_kernel[grid](
                h, w, yl, lse, ent, g, kk, scale, gz, h.shape[0], c, h.shape[1], c0, h.stride(0), w.stride(0),
                gz.stride(0), inv_temp, HAS_ENT=k is not None, UPCAST=interpret_mode(),
                PREC=triton_dot_precision(h.dtype),
            )  # fmt: skip

    return contract_grad_chunks(h, w, fill, need_h, need_w, scale=scale)


def _bwd_torch(h, w, idx, owns, lse, ent, g, k, inv_temp, need_h, need_w):
    n, hdim = h.shape
    v = w.shape[0]
    w32 = w.float()
    gh = torch.empty(n, hdim, dtype=torch.float32, device=h.device) if need_h else None
    gw = torch.zeros(v, hdim, dtype=torch.float32, device=h.device) if need_w else None
    step = _torch_rows(n, v)
    zbuf = torch.empty(step, v, dtype=torch.float32, device=h.device)
    pbuf = torch.empty_like(zbuf) if k is not None else None
    for r0 in range(0, n, step):
        sl = slice(r0, min(r0 + step, n))
        c = sl.stop - sl.start
        hc = h[sl].float() * inv_temp
        g_own = torch.where(owns[sl], g[sl], 0.0).unsqueeze(1)  # label term: only the rank owning the label
        lp = torch.mm(hc, w32.t(), out=zbuf[:c]).sub_(lse[sl].unsqueeze(1))
        if k is None:
            # ∂/∂z = g·(onehot − p): keep p unscaled and move g onto the small [c, H] operands, so the
            # [c, V] block is touched only by the GEMMs, the shift and one exp.
            p = lp.exp_()
            gc = g[sl].unsqueeze(1)
            if need_h:
                pw = torch.mm(p, w32)
                gh[sl] = (g_own * w32[idx[sl]] - gc * pw) * inv_temp
            if need_w:
                gw.addmm_(p.t(), hc * -gc)
                gw.index_add_(0, idx[sl], hc * g_own)
            continue
        p = torch.exp(lp, out=pbuf[:c])
        gz = lp.add_(ent[sl].unsqueeze(1)).mul_(-k[sl].unsqueeze(1)).sub_(g[sl].unsqueeze(1)).mul_(p)
        gz.scatter_add_(1, idx[sl].unsqueeze(1), g_own)
        if need_h:
            torch.mm(gz, w32, out=gh[sl]).mul_(inv_temp)
        if need_w:
            gw.addmm_(gz.t(), hc)  # hc already carries 1/T
    return gh, gw


def _forward(h, w, y, inv_temp, ignore_index, has_ent, backend, group):
    """Stats pass shared by the autograd forward and the no-grad path: per-row ``(lse, logp, entropy)`` and what
    the backward needs (``h0``: hidden with ignored rows zeroed; the label's local index and owner mask)."""
    v_local = w.shape[0]
    v_off, _ = shard_offset(v_local, group)
    valid = y != ignore_index
    y_loc = y - v_off
    owns = valid & (y_loc >= 0) & (y_loc < v_local)
    idx = torch.where(owns, y_loc, 0)
    h0 = zero_ignored_rows(h, valid)
    if backend == "triton" and h.shape[0] > 0:
        yl = torch.where(owns, y_loc, -1)
        m, s, a, zy = _fwd_stats_triton(h0, w, yl, inv_temp, has_ent)
    else:
        yl = None
        m, s, a, zy = _fwd_stats_torch(h0, w, idx, owns, inv_temp, has_ent)
    if group is not None:
        m, s, a, extra = allreduce_stats(m, s, a, zy.unsqueeze(0), group)
        zy = extra[0]
    log_s = torch.log(s)
    lse = m + log_s
    lp = torch.where(valid, zy - lse, 0.0)
    if has_ent:
        ent = torch.where(valid, log_s - a / s, 0.0)
    else:
        ent = torch.zeros(0, dtype=torch.float32, device=h.device)
    return lp, ent, (h0, valid, idx, owns, lse, yl)


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """autograd.Function over ``hidden [N, H]``, ``weight [V_local, H]`` and flat ``labels [N]``; returns
    ``(logp, entropy)`` (entropy empty when not requested)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, ignore_index, return_entropy, backend, group, reduce_gh):
        inv_temp = 1.0 / temperature
        lp, ent, (h0, valid, idx, owns, lse, yl) = _forward(
            hidden, weight, labels, inv_temp, ignore_index, return_entropy, backend, group
        )
        ctx.save_for_backward(h0, weight, valid, idx, owns, lse, ent, yl)
        ctx.cfg = (inv_temp, return_entropy, backend, group, reduce_gh)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h0, weight, valid, idx, owns, lse, ent, yl = ctx.saved_tensors
        inv_temp, has_ent, backend, group, reduce_gh = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w) or (g_lp is None and g_ent is None):
            return (None,) * 9
        n = h0.shape[0]
        zero = torch.zeros((), dtype=torch.float32, device=h0.device)
        g = torch.where(valid, g_lp.float(), zero) if g_lp is not None else zero.expand(n).clone()
        k = torch.where(valid, g_ent.float(), zero) if (has_ent and g_ent is not None) else None
        ent_used = ent if k is not None else lse
        if backend == "triton" and n > 0:
            gh, gw = _bwd_triton(h0, weight, yl, lse, ent_used, g, k, inv_temp, need_h, need_w)
        else:
            gh, gw = _bwd_torch(h0, weight, idx, owns, lse, ent_used, g, k, inv_temp, need_h, need_w)
        if need_h and group is not None and reduce_gh:
            import torch.distributed as dist

            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
        gh = gh.to(h0.dtype) if need_h else None
        gw = gw.to(weight.dtype) if need_w else None
        return gh, gw, None, None, None, None, None, None, None


def _prepare(hidden, weight, labels, mask, temperature, ignore_index, backend, process_group):
    """Checks shared by the public wrappers; returns flat ``(h, w, y)``, the temperature and the backend."""
    check_float_input("hidden", hidden)
    check_float_input("weight", weight)
    if hidden.dim() < 1:
        raise ArgumentError(f"hidden: expected shape [..., H], got {shape_str(hidden)}")
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
    ignore_index: int = -100,
    return_entropy: bool = False,
    process_group: Any = None,
    allreduce_grad_hidden: bool = True,
    backend: str | None = None,
) -> Float[Tensor, "*batch"] | tuple[Float[Tensor, "*batch"], Float[Tensor, "*batch"]]:
    """Per-token label log-prob (and entropy) of ``hidden @ weight.T`` without materialising the logits, in fp32.

    Formula: ``z = (hidden @ weightᵀ) / temperature`` (fp32 accumulation); ``logp = z[label] − logsumexp(z)``;
    ``entropy = logsumexp(z) − Σ softmax(z)·z`` (natural log). Same outputs as
    ``token_logprobs(hidden @ weight.T, labels, ...)``.

    Masked positions (``mask`` false, or ``labels == ignore_index``) give 0 for both outputs and no gradient;
    their hidden rows are replaced by 0 before any product (NaN/inf there cannot leak). Differentiable w.r.t.
    ``hidden`` and ``weight`` (also through the entropy); the backward recomputes the logits blockwise. Extra
    memory is one chunk of logits (torch path: ≤ ~64 MiB of fp32 rows and at most half the rows, plus an fp32 copy
    of ``weight`` when it is bf16/fp16; Triton: a ``[N, vocab-chunk]`` gradient block of ≤ 256 MiB, and an fp32
    ``[N, H]`` grad-hidden accumulator) and O(N) fp32 stats, never ``[N, V]``. Without grad (``torch.no_grad``
    or inputs that do not require grad) nothing is kept for a backward.

    Args:
        hidden: ``[..., H]`` hidden states (fp32/bf16/fp16).
        weight: ``[V, H]`` LM head (same dtype as ``hidden``); with ``process_group``, this rank's ``[V/world, H]``
            contiguous vocabulary shard.
        labels: ``[...]`` global token ids in ``[0, V)`` (``V`` = full vocabulary) or ``ignore_index``.
        mask: optional ``[...]`` bool (or 0/1) mask of the positions to compute; false acts as ``ignore_index``.
        temperature: > 0; logits are divided by it.
        return_entropy: also return the per-token entropy.
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
    devices, a ``weight`` whose second dimension is not ``hidden.shape[-1]``, a labels/mask shape other than
    ``hidden.shape[:-1]``, or a label out of range (one host sync; skipped under ``torch.compile``).
    """
    h, w, y, temperature, backend = _prepare(
        hidden, weight, labels, mask, temperature, ignore_index, backend, process_group
    )
    lead = hidden.shape[:-1]
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        lp, ent = LinearTokenLogprobsFunction.apply(
            h, w, y, temperature, int(ignore_index), bool(return_entropy), backend, process_group,
            bool(allreduce_grad_hidden),
        )  # fmt: skip
    else:
        lp, ent, _ = _forward(h, w, y, 1.0 / temperature, int(ignore_index), bool(return_entropy), backend,
                              process_group)  # fmt: skip
    if return_entropy:
        return lp.reshape(lead), ent.reshape(lead)
    return lp.reshape(lead)
