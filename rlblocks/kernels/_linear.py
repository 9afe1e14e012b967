"""Shared pieces of the two fused LM-head ops (``linear_logprobs.py``, ``linear_logprobs_loss.py``).

The Triton forward-stats and backward kernels with their launchers, the chunked torch paths, the sampling-mask
replay thresholds and ``_forward``, the stats pass both ops run. The math is in ``linear_logprobs.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.kernels import _common
from rlblocks.kernels._common import (
    allreduce_stats,
    cols_per_block,
    contract_grad_chunks,
    device_guard,
    grad_scale,
    interpret_mode,
    merge_partials,
    mm_fp32,
    persistent_programs,
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
    """Rows per chunk of the torch path: the chunk budget (``TORCH_CHUNK_BYTES`` of fp32 logits), at most 1/16 of
    the rows but 64 (enough rows per pass of the GEMMs over the weight), and at most half the rows, so the chunk
    stays a small fraction of the ``[N, V]`` logits that plain autograd holds (1/16 from N = 1024 on)."""
    return max(1, min(rows_per_chunk(v), max(64, -(-n // 16)), max(8, -(-n // 2))))


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
        # ∂/∂z = g·(onehot − p) = −g·(p − onehot) on the rank owning the label (−g·p elsewhere): the label enters
        # the [c, V] block as one scattered −1 per row and g moves onto the small [c, H] operands, so the block is
        # touched only by one exp, the scatter and the two GEMMs (an index_add_ of the label rows into grad_weight
        # costs as much as a GEMM on a CPU).
        p = lp.exp_()
        p.scatter_add_(1, idx_c.unsqueeze(1), -owns_c.to(p.dtype).unsqueeze(1))
        gc = g_c.unsqueeze(1)
        if need_h:
            torch.mm(p, w32, out=gh_out).mul_(gc * -inv_temp)
        if need_w:
            gw.addmm_(p.t(), hc * -gc)
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


def _torch_cols(n: int, v: int) -> int:
    """Vocabulary rows per block of the dense torch backward: an fp32 ``[N, cols]`` block within the chunk budget
    (``TORCH_CHUNK_BYTES``), at most 1/32 of the vocabulary (but 64; the block GEMMs stay large: all N rows), at
    most ``V``."""
    return max(1, min(v, cols_per_block(n, _common.TORCH_CHUNK_BYTES, multiple=8), max(64, -(-v // 32))))


def _bwd_torch_vocab(h, w, idx, owns, lse, ent, g, k, inv_temp, need_h, need_w):
    """The dense torch backward over vocabulary blocks: per block of ``cols`` weight rows, the logits of all N rows
    are recomputed (one GEMM), turned into ``∂L/∂z`` in place and contracted. The block's ``grad_weight`` rows are
    written once by a GEMM over all N rows, and ``grad_hidden`` accumulates in an fp32 ``[N, H]``; row chunks
    instead read and rewrite the whole ``[V, H]`` ``grad_weight`` once per chunk, which on a CPU costs as much
    memory traffic as the GEMM that feeds it."""
    n, hdim = h.shape
    v = w.shape[0]
    w32 = w.float()
    hc = h.float() * inv_temp
    cols = _torch_cols(n, v)
    buf = torch.empty(n * cols, dtype=torch.float32, device=h.device)
    pbuf = torch.empty_like(buf) if k is not None else None
    gh = torch.zeros(n, hdim, dtype=torch.float32, device=h.device) if need_h else None
    gw = torch.empty(v, hdim, dtype=torch.float32, device=h.device) if need_w else None
    # no entropy: ∂/∂z = −g·(p − onehot) with the label's −1 scattered into p, and g on the [N, H] operands
    hg = hc * -g.unsqueeze(1) if (k is None and need_w) else None
    for j0 in range(0, v, cols):
        cb = min(cols, v - j0)
        wb = w32[j0 : j0 + cb]
        lp = torch.mm(hc, wb.t(), out=buf[: n * cb].view(n, cb)).sub_(lse.unsqueeze(1))  # log p
        inb = owns & (idx >= j0) & (idx < j0 + cb)  # the label lies in this block (on this rank)
        loc = torch.where(inb, idx - j0, 0).unsqueeze(1)
        if k is None:
            gz = lp.exp_()
            gz.scatter_add_(1, loc, -inb.to(gz.dtype).unsqueeze(1))
            hw = hg
        else:
            p = torch.exp(lp, out=pbuf[: n * cb].view(n, cb))
            gz = lp.add_(ent.unsqueeze(1)).mul_(-k.unsqueeze(1)).sub_(g.unsqueeze(1)).mul_(p)
            gz.scatter_add_(1, loc, torch.where(inb, g, 0.0).unsqueeze(1))
            hw = hc
        if need_h:
            gh.addmm_(gz, wb)
        if need_w:
            torch.mm(gz.t(), hw, out=gw[j0 : j0 + cb])
    if need_h:
        gh.mul_((-g * inv_temp).unsqueeze(1) if k is None else inv_temp)
    return gh, gw


def _bwd_torch(h, w, idx, owns, lse, ent, g, k, inv_temp, need_h, need_w, rep=None, rows_all_sparse=False):
    if rep is None:  # no sampling-mask replay: every row dense
        return _bwd_torch_vocab(h, w, idx, owns, lse, ent, g, k, inv_temp, need_h, need_w)
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
