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

from typing import Any, NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import check_last_dim, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels import _common
from rlblocks.kernels._common import (
    allreduce_stats,
    apply_mask,
    check_flags,
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
    mm_fp32,
    persistent_programs,
    resolve_backend,
    rows_per_chunk,
    shard_offset,
    tile_count,
    triton_available,
    triton_dot_precision,
    zero_ignored_rows,
)
from rlblocks.kernels._sampling import (
    ChunkedSelection,
    Replay,
    check_sampling,
    chunked_select,
    group_thresholds,
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

    from rlblocks.kernels._tiles import gemm_configs, keep_one_fp32_config, load_dot, tile_coords, tile_stats

    @triton.autotune(  # not N in the key: it changes every RL step
        configs=gemm_configs("fwd"), key=["V", "H", "HAS_ENT", "STORE_E", "HAS_TAU", "USE_TMA", "PREC"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("h")},
    )  # fmt: skip
    @triton.jit
    def _linear_logprobs_fwd_kernel(
        h, w, yl_ptr, m_ptr, s_ptr, a_ptr, zy_ptr, e_ptr, tau_ptr,
        N, V, H, stride_hn, stride_wv, stride_e, inv_temp,
        HAS_ENT: tl.constexpr, STORE_E: tl.constexpr, HAS_TAU: tl.constexpr, USE_TMA: tl.constexpr,
        UPCAST: tl.constexpr,
        PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr, CTAS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        # Persistent: each program walks the (row block, vocab tile) list in grouped order with stride = number of
        # programs; per tile one fp32 [BLOCK_N, BLOCK_V] accumulator of hidden @ Wᵀ (tl.dot over BLOCK_K slices),
        # then the tile's (max, Σexp, Σexp·(z−max)) per row go to row `tile` of the partial-stats arrays (merged on
        # the host), and the tile holding a row's label writes its logit. STORE_E also writes exp(z − max_tile)
        # (the fused-loss path turns it into the logits gradient without recomputing the GEMM). HAS_TAU: entries
        # below the row's sampling threshold (top-k / top-p replay) are −inf, i.e. outside the distribution.
        n_rb = tl.cdiv(N, BLOCK_N)
        n_vt = tl.cdiv(V, BLOCK_V)
        for tile in tl.range(tl.program_id(0), n_rb * n_vt, tl.num_programs(0), flatten=FLATTEN,
                             warp_specialize=WS):  # fmt: skip
            rb, vt = tile_coords(tile, n_rb, n_vt, GROUP)
            r0 = rb * BLOCK_N
            c0 = vt * BLOCK_V
            acc = load_dot(h, w, r0, c0, N, V, H, stride_hn, stride_wv, USE_TMA, UPCAST, PREC,
                           BLOCK_N, BLOCK_V, BLOCK_K)  # fmt: skip
            rows = r0 + tl.arange(0, BLOCK_N)
            cols = c0 + tl.arange(0, BLOCK_V)
            row_ok = rows < N
            col_ok = cols < V
            rows64 = rows.to(tl.int64)
            z = acc * inv_temp
            keep = col_ok[None, :]
            if HAS_TAU:
                tau = tl.load(tau_ptr + rows64, mask=row_ok, other=-float("inf"))
                keep = keep & ~(z < tau[:, None])  # NaN is kept: it must show
            z = tl.where(keep, z, -float("inf"))
            m_t, s_t, a_t, e = tile_stats(z, HAS_ENT)
            out = vt.to(tl.int64) * N + rows64
            tl.store(m_ptr + out, m_t, mask=row_ok)
            tl.store(s_ptr + out, s_t, mask=row_ok)
            if HAS_ENT:
                tl.store(a_ptr + out, a_t, mask=row_ok)
            yl = tl.load(yl_ptr + rows64, mask=row_ok, other=-1)
            zy = tl.sum(tl.where(cols[None, :] == yl[:, None], z, 0.0), axis=1)
            tl.store(zy_ptr + rows64, zy, mask=row_ok & (yl >= c0) & (yl < c0 + BLOCK_V))
            if STORE_E:
                tl.store(e_ptr + rows64[:, None] * stride_e + cols[None, :], e.to(e_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip

    @triton.autotune(
        configs=gemm_configs("bwd"), key=["H", "HAS_ENT", "HAS_TAU", "USE_TMA", "PREC"],
        prune_configs_by={"early_config_prune": keep_one_fp32_config("h")},
    )  # fmt: skip
    @triton.jit
    def _linear_logprobs_bwd_kernel(
        h, w, yl_ptr, lse_ptr, ent_ptr, g_ptr, k_ptr, scale_ptr, gz, tau_ptr,
        N, VC, H, v_start, stride_hn, stride_wv, stride_gz, inv_temp,
        HAS_ENT: tl.constexpr, HAS_TAU: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
        PREC: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr, CTAS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        # Persistent over the tiles of the vocab chunk [v_start, v_start + VC): recompute the logits tile, write
        # scale·(∂/∂z)/T into the chunk's gradient block; the host contracts the block with cuBLAS.
        n_rb = tl.cdiv(N, BLOCK_N)
        n_vt = tl.cdiv(VC, BLOCK_V)
        scale = tl.load(scale_ptr) * inv_temp
        for tile in tl.range(tl.program_id(0), n_rb * n_vt, tl.num_programs(0), flatten=FLATTEN,
                             warp_specialize=WS):  # fmt: skip
            rb, vt = tile_coords(tile, n_rb, n_vt, GROUP)
            r0 = rb * BLOCK_N
            lc0 = vt * BLOCK_V  # column inside the chunk
            acc = load_dot(h, w, r0, v_start + lc0, N, v_start + VC, H, stride_hn, stride_wv, USE_TMA, UPCAST,
                           PREC, BLOCK_N, BLOCK_V, BLOCK_K)  # fmt: skip
            rows = r0 + tl.arange(0, BLOCK_N)
            row_ok = rows < N
            rows64 = rows.to(tl.int64)
            lc = lc0 + tl.arange(0, BLOCK_V)
            yl = tl.load(yl_ptr + rows64, mask=row_ok, other=-1)
            lse = tl.load(lse_ptr + rows64, mask=row_ok, other=0.0)
            g = tl.load(g_ptr + rows64, mask=row_ok, other=0.0)
            lp = acc * inv_temp - lse[:, None]
            p = tl.exp(lp)
            if HAS_TAU:
                # Outside the kept set: p = 0 (lp stays finite, so p·(lp + H) has no 0·(−inf)). The test is
                # z − lse >= tau − lse, so no second [BLOCK_N, BLOCK_V] tile of z stays live (with it, the 128×128
                # entropy config spilled on triton 3.6); the threshold's midpoint placement absorbs the rounding.
                lo = tl.load(tau_ptr + rows64, mask=row_ok, other=-float("inf")) - lse
                p = tl.where(lp < lo[:, None], 0.0, p)
            if HAS_ENT:
                k = tl.load(k_ptr + rows64, mask=row_ok, other=0.0)
                ent = tl.load(ent_ptr + rows64, mask=row_ok, other=0.0)
                gzt = p * (-g[:, None] - k[:, None] * (lp + ent[:, None]))
            else:
                gzt = -g[:, None] * p
            gzt += tl.where((v_start + lc)[None, :] == yl[:, None], g[:, None], 0.0)
            gzt = gzt * scale
            if USE_TMA:
                gz.store([r0, lc0], gzt.to(gz.dtype))
            else:
                tl.store(gz + rows64[:, None] * stride_gz + lc[None, :], gzt.to(gz.dtype.element_ty),
                         mask=row_ok[:, None] & (lc < VC)[None, :])  # fmt: skip

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


def _use_tma(*ts: Tensor) -> bool:
    """Host-side TMA descriptors need Hopper or newer (or the interpreter), 16-byte aligned bases and row strides,
    and a contiguous last dimension; anything else reads through pointers."""
    if not all(t.dim() == 2 and t.stride(-1) == 1 for t in ts):
        return False
    if not all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts):
        return False
    if ts[0].is_cuda:
        return torch.cuda.get_device_capability(ts[0].device)[0] >= 9
    return interpret_mode()


def _desc(t: Tensor, use_tma: bool):
    if not use_tma:
        return t
    from triton.tools.tensor_descriptor import TensorDescriptor

    # the block shape is set per autotune config by _tiles.set_desc_blocks
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])


def _persistent_grid(n, v, device):
    return lambda meta: (persistent_programs(tile_count(n, v, meta["BLOCK_N"], meta["BLOCK_V"]), device,
                                             meta["CTAS_PER_SM"]),)  # fmt: skip


def _min_block_v(kernel, dtype) -> int:
    """The smallest BLOCK_V the autotuner may pick for ``dtype`` (sizes the per-tile stats before the pick)."""
    fake = torch.empty(0, dtype=dtype)
    configs = keep_one_fp32_config("h")(kernel.configs, {"h": fake})
    return min(c.kwargs["BLOCK_V"] for c in configs)


def _fwd_stats_triton(h, w, yl, inv_temp, has_ent, e_out=None, tau=None):
    """Launch the forward kernel; return the merged ``(m, s, a)``, the label logit and the per-tile maxima
    ``[n_vocab_tiles, N]`` with the BLOCK_V that produced them (for the fused-loss path)."""
    n, hdim = h.shape
    v = w.shape[0]
    max_tiles = -(-v // _min_block_v(_linear_logprobs_fwd_kernel, h.dtype))
    m, s, a = (torch.empty(max_tiles, n, dtype=torch.float32, device=h.device) for _ in range(3))
    zy = torch.zeros(n, dtype=torch.float32, device=h.device)
    tma = _use_tma(h, w)
    e = e_out if e_out is not None else m  # never hand Triton an empty tensor: m stands in when e is not stored
    with device_guard(h):
        _linear_logprobs_fwd_kernel[_persistent_grid(n, v, h.device)](
            _desc(h, tma), _desc(w, tma), yl, m, s, a, zy, e, tau if tau is not None else zy, n, v, hdim,
            h.stride(0), w.stride(0), e.stride(0), inv_temp, HAS_ENT=has_ent, STORE_E=e_out is not None,
            HAS_TAU=tau is not None, USE_TMA=tma, UPCAST=interpret_mode(), PREC=triton_dot_precision(h.dtype),
        )  # fmt: skip
    block_v = _linear_logprobs_fwd_kernel.best_config.kwargs["BLOCK_V"]
    n_vt = -(-v // block_v)
    mm, ss, aa = merge_partials(m[:n_vt], s[:n_vt], a[:n_vt] if has_ent else None)
    return mm, ss, aa, zy, (m[:n_vt], block_v)


_LOWEST = torch.finfo(torch.float32).min


def _torch_rows(n: int, v: int) -> int:
    """Rows per chunk of the torch path: the chunk budget, and at most half the rows, so the extra memory stays
    below half of the fp32 logits even for small problems."""
    return max(1, min(rows_per_chunk(v), max(8, -(-n // 2))))


def _fwd_stats_torch(h, w, idx, owns, inv_temp, has_ent, sm=None, group=None):
    # One [rows, V] fp32 buffer: logits, shifted in place; exp(z − m) exists only one column block at a time.
    # Sampling-mask replay: a chunk whose kept sets lie among each row's candidates is reduced from them alone
    # (sparse; its stats are written as m = lse, s = 1, a = −H); any other chunk gets −inf outside its kept sets.
    n = h.shape[0]
    v = w.shape[0]
    w32 = w.float()
    m, s, zy = (torch.empty(n, dtype=torch.float32, device=h.device) for _ in range(3))
    a = torch.empty(n, dtype=torch.float32, device=h.device) if has_ent else None
    v_all = v if group is None else shard_offset(v, group)[1]
    rep = new_replay(n, num_candidates(sm, v_all), h.device) if sm is not None else None
    step = _torch_rows(n, v)
    zbuf = torch.empty(min(step, n), v, dtype=torch.float32, device=h.device)
    # Entropy: exp(z − m) one column block at a time into a reused buffer of at most half the chunk (a small chunk
    # must not double its memory), then z·e in place; few, large ops (on a busy CPU each op's fixed cost counts).
    col = min(2 * cols_per_block(min(step, n)), max(256, -(-v // 2))) if has_ent else v
    ebuf = torch.empty(min(step, n), min(col, v), dtype=torch.float32, device=h.device) if has_ent else None
    for r0 in range(0, n, step):
        sl = slice(r0, min(r0 + step, n))
        c = sl.stop - sl.start
        z = torch.mm(h[sl].float() * inv_temp, w32.t(), out=zbuf[:c])
        zy[sl] = torch.where(owns[sl], z.gather(1, idx[sl].unsqueeze(1)).squeeze(1), 0.0)
        if sm is not None and group is not None:  # vocab-parallel: global thresholds, the masked dense path
            rep.tau[sl] = group_thresholds(z, sm.rows(sl), group, rep.vals.shape[1])
            mask_below(z, rep.tau[sl])
            # the label's owner masks it (other ranks hold 0 there, the SUM's neutral value)
            zy[sl] = torch.where(owns[sl] & (zy[sl] < rep.tau[sl]), float("-inf"), zy[sl])
        elif sm is not None:
            sel = select(z, sm.rows(sl), owns[sl], rep.vals.shape[1])
            rep.tau[sl] = sel.tau
            if sel.sparse:
                lse_c, _, e_c = sparse_stats(sel.vals, zy[sl], sel.tau, owns[sl], has_ent)
                zy[sl] = torch.where(zy[sl] < sel.tau, float("-inf"), zy[sl])
                m[sl], s[sl] = lse_c, 1.0
                if has_ent:
                    a[sl] = -e_c
                rep.vals[sl], rep.idx[sl], rep.sparse[sl] = sel.vals, sel.idx, True
                continue
            mask_below(z, sel.tau)
            zy[sl] = torch.where(zy[sl] < sel.tau, float("-inf"), zy[sl])
        mc = z.amax(dim=1)
        # a vocab shard may hold none of a row's kept set (max −inf): shift by 0 there, so its s and a are 0
        z.sub_(torch.where(torch.isfinite(mc), mc, 0.0).unsqueeze(1))
        m[sl] = mc
        if not has_ent:
            s[sl] = z.exp_().sum(dim=1)
            continue
        if sm is not None:  # −inf entries (outside the kept set): e = 0 there, so a finite z makes e·z = 0
            z.clamp_(min=_LOWEST)
        sc = None
        for j in range(0, v, col):
            zb = z[:, j : j + col]
            e = torch.exp(zb, out=ebuf[:c, : zb.shape[1]])
            sc = e.sum(dim=1) if sc is None else sc.add_(e.sum(dim=1))
            zb.mul_(e)  # e·(z − m): z is not needed after this block
        s[sl] = sc
        a[sl] = z.sum(dim=1)
    return m, s, a, zy, rep


def _bwd_triton(h, w, yl, lse, ent, g, k, inv_temp, need_h, need_w, tau=None):
    # |∂/∂z_j| ≤ |g| + |k|·(1/e + H) per row (p·|log p| ≤ 1/e, Σ p = 1): the bound the fp16 scale is taken from.
    bound = g.abs() if k is None else g.abs() + k.abs() * (0.5 + ent.clamp_min(0))
    scale = grad_scale(bound, h.dtype)
    kk = k if k is not None else g
    tma_hw = _use_tma(h, w)

    def fill(gz, c0, c):
        tma = tma_hw and _use_tma(gz)
        with device_guard(h):
            _linear_logprobs_bwd_kernel[_persistent_grid(h.shape[0], c, h.device)](
                _desc(h, tma), _desc(w, tma), yl, lse, ent, g, kk, scale, _desc(gz, tma),
                tau if tau is not None else lse, h.shape[0], c, h.shape[1], c0, h.stride(0), w.stride(0),
                gz.stride(0), inv_temp, HAS_ENT=k is not None, HAS_TAU=tau is not None, USE_TMA=tma,
                UPCAST=interpret_mode(), PREC=triton_dot_precision(h.dtype),
            )  # fmt: skip

    return contract_grad_chunks(h, w, fill, need_h, need_w, scale=scale)


def _grad_chunk_torch(lp, pbuf, hc, w32, idx_c, owns_c, g_c, k_c, ent_c, inv_temp, gh_out, gw, need_h, need_w,
                      masked=False):
    """One row chunk of the torch backward: ``lp`` [c, V] holds ``log p`` (overwritten), ``hc`` = ``h/T`` of the
    chunk; writes ``grad_hidden`` rows into ``gh_out`` and accumulates ``grad_weight`` into ``gw``."""
    g_own = torch.where(owns_c, g_c, 0.0).unsqueeze(1)  # label term: only the rank owning the label
    if k_c is None:
        # ∂/∂z = g·(onehot − p): keep p unscaled and move g onto the small [c, H] operands, so the [c, V] block
        # is touched only by the GEMMs and one exp.
        p = lp.exp_()
        gc = g_c.unsqueeze(1)
        if need_h:
            torch.sub(g_own * w32[idx_c], gc * torch.mm(p, w32), out=gh_out).mul_(inv_temp)
        if need_w:
            gw.addmm_(p.t(), hc * -gc)
            gw.index_add_(0, idx_c, hc * g_own)
        return
    p = torch.exp(lp, out=pbuf)
    if masked:  # −inf entries (outside a sampling mask): p = 0 there, and a finite log p avoids 0·(−inf) below
        lp.clamp_(min=-1e4)
    gz = lp.add_(ent_c.unsqueeze(1)).mul_(-k_c.unsqueeze(1)).sub_(g_c.unsqueeze(1)).mul_(p)
    gz.scatter_add_(1, idx_c.unsqueeze(1), g_own)
    if need_h:
        torch.mm(gz, w32, out=gh_out).mul_(inv_temp)
    if need_w:
        gw.addmm_(gz.t(), hc)  # hc already carries 1/T


def _sparse_grad_rows(rep, sl, hc, w32, idx, owns, lse, ent, g, k, inv_temp, gh_out, gw, need_h, need_w):
    """Gradients of sparse rows ``sl``: ``∂L/∂z`` is nonzero only at each row's ``C`` kept candidates and its label,
    so ``grad_hidden = (Σ_c gz_c·W[idx_c] + g·W[y]) / T`` and ``grad_weight[idx_c] += gz_c·h / T`` are gathers and
    index-adds of ``C`` weight rows per token: no logits GEMM. Sub-chunks keep the ``[rows, C, H]`` temporaries at
    ≤ ~64 MiB."""
    hdim = w32.shape[1]
    vals, cidx = rep.vals[sl], rep.idx[sl]
    gz = sparse_grad(vals, lse[sl], ent[sl] if k is not None else None, g[sl], k[sl] if k is not None else None)
    g_own = torch.where(owns[sl], g[sl], 0.0).unsqueeze(1)
    rows = max(1, _common.TORCH_CHUNK_BYTES // (4 * hdim * max(1, vals.shape[1])))
    for r0 in range(0, gz.shape[0], rows):
        q = slice(r0, r0 + rows)
        if need_h:
            ghq = torch.bmm(gz[q].unsqueeze(1), w32[cidx[q]]).squeeze(1)
            gh_out[q] = ghq.add_(g_own[q] * w32[idx[sl][q]]).mul_(inv_temp)
        if need_w:
            gw.index_add_(0, cidx[q].reshape(-1), (gz[q].unsqueeze(2) * hc[q].unsqueeze(1)).reshape(-1, hdim))
            gw.index_add_(0, idx[sl][q], hc[q] * g_own[q])


def _bwd_torch(h, w, idx, owns, lse, ent, g, k, inv_temp, need_h, need_w, rep=None, rows_all_sparse=False):
    n, hdim = h.shape
    v = w.shape[0]
    w32 = w.float()
    gh = torch.empty(n, hdim, dtype=torch.float32, device=h.device) if need_h else None
    gw = torch.zeros(v, hdim, dtype=torch.float32, device=h.device) if need_w else None
    step = _torch_rows(n, v)
    zbuf = pbuf = None
    for r0 in range(0, n, step):
        sl = slice(r0, min(r0 + step, n))
        c = sl.stop - sl.start
        hc = h[sl].float() * inv_temp
        if rep is not None and rep.sparse is not None and (rows_all_sparse or bool(rep.sparse[sl].all())):
            _sparse_grad_rows(rep, sl, hc, w32, idx, owns, lse, ent, g, k, inv_temp, gh[sl] if need_h else None,
                              gw, need_h, need_w)  # fmt: skip
            continue
        if zbuf is None:
            zbuf = torch.empty(min(step, n), v, dtype=torch.float32, device=h.device)
            pbuf = torch.empty_like(zbuf) if k is not None else None
        lp = torch.mm(hc, w32.t(), out=zbuf[:c])
        if rep is not None:
            mask_below(lp, rep.tau[sl])
        lp.sub_(lse[sl].unsqueeze(1))
        _grad_chunk_torch(lp, pbuf[:c] if pbuf is not None else None, hc, w32, idx[sl], owns[sl], g[sl],
                          k[sl] if k is not None else None, ent[sl] if k is not None else None, inv_temp,
                          gh[sl] if need_h else None, gw, need_h, need_w, masked=rep is not None)  # fmt: skip
    return gh, gw


def _triton_group_thresholds(h0, w, inv_temp, sm, group):
    """Vocab-parallel thresholds for the Triton kernels, from fp32 row chunks of this rank's logits (the same
    chunks on every rank, so the collectives of ``group_thresholds`` line up)."""
    n, v = h0.shape[0], w.shape[0]
    c = num_candidates(sm, shard_offset(v, group)[1])
    rows = rows_per_chunk(v)
    taus = [group_thresholds(mm_fp32(h0[r0 : r0 + rows], w.t()).mul_(inv_temp), sm.rows(slice(r0, r0 + rows)),
                             group, c) for r0 in range(0, n, rows)]  # fmt: skip
    return torch.cat(taus).contiguous()


def _triton_select(h0, w, inv_temp, sm, valid, idx):
    """Kept sets for the Triton path, from fp32 row chunks of ``z = (h0 @ wᵀ)/T`` (cuBLAS, ≤ 64 MiB of logits at a
    time): when every row's kept set lies among its candidates, the outputs follow from them and no kernel runs;
    otherwise the kernels take the thresholds (one extra GEMM in the forward)."""
    n, v = h0.shape[0], w.shape[0]

    def make_z(r0, r1):
        return mm_fp32(h0[r0:r1], w.t()).mul_(inv_temp)

    return chunked_select(make_z, n, v, sm, valid, idx, rows_per_chunk(v))


def _forward(h, w, y, inv_temp, ignore_index, has_ent, backend, group, sm=None):
    """Stats pass shared by the autograd forward and the no-grad path: per-row ``(lse, logp, entropy)`` and what
    the backward needs (``h0``: hidden with ignored rows zeroed; the label's local index and owner mask; the
    sampling thresholds ``tau``, ``None`` without top-k/top-p)."""
    v_local = w.shape[0]
    v_off, _ = shard_offset(v_local, group)
    valid = y != ignore_index
    y_loc = y - v_off
    owns = valid & (y_loc >= 0) & (y_loc < v_local)
    idx = torch.where(owns, y_loc, 0)
    h0 = zero_ignored_rows(h, valid)
    rep = None
    if backend == "triton" and h.shape[0] > 0:
        yl = torch.where(owns, y_loc, -1)
        cs = None
        if sm is not None and group is not None:
            cs = ChunkedSelection(_triton_group_thresholds(h0, w, inv_temp, sm, group), None, None, None)
        elif sm is not None:
            cs = _triton_select(h0, w, inv_temp, sm, owns, idx)
        if cs is not None and cs.vals is not None:  # every row sparse: sampling-mask stats from the candidates
            m, _, e_c = sparse_stats(cs.vals, cs.zy, cs.tau, owns, has_ent)
            s = torch.ones_like(m)
            a = -e_c if has_ent else None
            zy = torch.where(cs.zy < cs.tau, float("-inf"), cs.zy)
            rep = Replay(cs.tau, cs.vals, cs.idx, torch.ones_like(owns))
        else:
            rep = Replay(cs.tau, None, None, None) if cs is not None else None
            m, s, a, zy, _ = _fwd_stats_triton(h0, w, yl, inv_temp, has_ent, tau=rep.tau if rep else None)
    else:
        yl = None
        m, s, a, zy, rep = _fwd_stats_torch(h0, w, idx, owns, inv_temp, has_ent, sm, group)
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
    return lp, ent, (h0, valid, idx, owns, lse, yl, rep)


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
