"""Triton building blocks shared by the kernel ops (imported only when triton is installed).

- ``tile_coords``: grouped (L2-swizzled) order of output tiles for the persistent grids.
- ``load_dot`` / ``dot_tile``: one ``[BLOCK_N, BLOCK_V]`` fp32 tile of ``hidden @ weightᵀ``, accumulated over
  ``BLOCK_K`` slices of the hidden dimension with ``tl.dot`` (tensor cores for bf16/fp16; IEEE fp32 for fp32 inputs via
  ``PREC="ieee"``). ``UPCAST`` casts the loaded slices to fp32 first: the CPU interpreter needs it (its bf16
  ``tl.dot`` is wrong), GPUs do not. ``load_dot`` reads through TMA descriptors when the tensors allow it.
- ``tile_stats``: the ``(m, s, a)`` of one tile, stored per tile and merged on the host (``merge_partials``).
- ``max_shift`` / ``online_update``: fold one ``[rows, cols]`` tile of logits into running per-row
  ``(m, s, a)`` (definitions in ``_common.py``).
- ``log_mix``: ``log(β·p + (1−β)·q)`` from ``log p`` and ``log q``.
- ``row_configs`` / ``tile_configs`` and ``keep_one_fp32_config``: the autotune sets.

Every reduction here is ``−inf``-safe: an entry whose logit is ``−inf`` has ``exp = 0`` and its ``0·(−inf)``
terms are replaced by 0 (tested as ``exp == 0``, never ``exp > 0``, so a NaN entry is not mistaken for one and
reaches the sums), and a running max that is still ``−inf`` (nothing but masked entries so far) never
enters an exponent. That is what makes masked vocabularies valid input, and it is the hook for sampling-mask
replay: turning the entries outside a top-k / top-p set into ``−inf`` before ``online_update`` is all a kernel
has to add.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlblocks.kernels._common import interpret_mode


@triton.jit
def dot_tile(
    h_ptr, w_ptr, rows64, row_ok, cols64, col_ok, H, stride_hn, stride_wv,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        hb = tl.load(h_ptr + rows64[:, None] * stride_hn + (k0 + ks)[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_ptr + cols64[:, None] * stride_wv + (k0 + ks)[None, :],
                     mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            hb = hb.to(tl.float32)
            wb = wb.to(tl.float32)
        acc = tl.dot(hb, tl.trans(wb), acc, input_precision=PREC)
    return acc


@triton.jit
def tile_coords(tile, n_row_blocks, n_col_tiles, GROUP: tl.constexpr):
    """(row block, column tile) of linear ``tile`` in grouped (L2-swizzled) order: consecutive tiles walk ``GROUP``
    row blocks down one column tile, then the next column, so the tiles resident at once share ``GROUP`` hidden
    blocks and a few weight blocks instead of streaming every hidden block for every weight block."""
    per_group = GROUP * n_col_tiles
    first = (tile // per_group) * GROUP
    size = tl.minimum(n_row_blocks - first, GROUP)
    in_group = tile % per_group
    return first + in_group % size, in_group // size


@triton.jit
def load_dot(
    h, w, r0, c0, N, V, H, stride_hn, stride_wv,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N, BLOCK_V]`` tile ``h[r0:r0+BN] @ w[c0:c0+BV]ᵀ`` over the whole hidden dimension.

    ``USE_TMA``: ``h`` and ``w`` are host-side tensor descriptors (block shapes ``[BLOCK_N, BLOCK_K]`` and
    ``[BLOCK_V, BLOCK_K]``); the copy engine loads the slices into swizzled shared memory and fills out-of-range
    rows/columns with 0, so the loop has no masks or address math. Otherwise ``h``/``w`` are pointers (rows past
    ``N`` / ``V`` and columns past ``H`` read as 0)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            hb = h.load([r0, k0])
            wb = w.load([c0, k0])
            if UPCAST:
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            acc = tl.dot(hb, wb.T, acc, input_precision=PREC)
    else:
        rows = (r0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (c0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        acc = dot_tile(h, w, rows, rows < N, cols, cols < V, H, stride_hn, stride_wv, UPCAST, PREC,
                       BLOCK_N, BLOCK_V, BLOCK_K)  # fmt: skip
    return acc


@triton.jit
def tile_stats(z, HAS_ENT: tl.constexpr):
    """Per-row ``(m, s, a, e)`` of one logits tile ``z`` [rows, cols] (masked entries ``−inf``, at least one finite
    entry per row): ``m = max z``, ``e = exp(z − m)``, ``s = Σ e``, ``a = Σ e·(z − m)`` (0 where ``e = 0``)."""
    m = tl.max(z, axis=1)
    m_use = tl.where(m == -float("inf"), 0.0, m)
    e = tl.exp(z - m_use[:, None])
    s = tl.sum(e, axis=1)
    a = tl.zeros_like(s)
    if HAS_ENT:
        a = tl.sum(tl.where(e == 0, 0.0, e * (z - m_use[:, None])), axis=1)
    return m, s, a, e


@triton.jit
def max_shift(m, z):
    """New running max of ``m`` [rows] and the tile ``z`` [rows, cols], the finite shift to use in exponents, and
    the factor ``exp(m_old − shift)`` that rescales sums taken relative to the old max."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    # Still −inf: nothing but masked entries so far. Shift by 0 instead, so no exponent sees −inf − (−inf).
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, m_use, tl.exp(m - m_use)


@triton.jit
def online_update(m, s, a, z, HAS_ENT: tl.constexpr):
    """Running ``(m, s, a)`` [rows] after the logits tile ``z`` [rows, cols] (masked entries ``−inf``)."""
    m_new, m_use, alpha = max_shift(m, z)
    e = tl.exp(z - m_use[:, None])
    if HAS_ENT:
        d = tl.where(e == 0, 0.0, z - m_use[:, None])  # e = 0 where z = −inf: no 0·(−inf)
        dm = tl.where(s > 0, m - m_use, 0.0)
        a = alpha * (a + dm * s) + tl.sum(e * d, axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, a


@triton.jit
def log_mix(lp, lq, log_beta, log_1mb):
    """``log(β·p + (1−β)·q)``, stable; ``−inf`` when both ``p`` and ``q`` are 0."""
    x = lp + log_beta
    y = lq + log_1mb
    mx = tl.maximum(x, y)
    mx_use = tl.where(mx == -float("inf"), 0.0, mx)
    return mx_use + tl.log(tl.exp(x - mx_use) + tl.exp(y - mx_use))


def row_configs():
    """Configs of the one-row-per-program kernels over materialised logits (memory bound: wide vocab blocks; two
    candidates keep a cold start's compile time short)."""
    if interpret_mode():
        return [triton.Config({"BLOCK_V": 128}, num_warps=4)]
    return [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv, w in ((4096, 8), (8192, 16))]


# The fp32 (IEEE, no tensor cores) variants exist for exactness tests; they get one config so that a cold start
# compiles and benchmarks nothing else. It is the first entry of every tile config list. The bf16 shapes of the
# KL kernels (two accumulators per tile: student and teacher) are the ones that do not spill on sm_90 in the static
# resource report (128x128 forward tiles spilled up to 1.1 KB).
def tile_configs(role: str):
    """Autotune configs of the ``[BLOCK_N, BLOCK_V]`` tile kernels of ``linear_kl``; ``role``: ``"kl_fwd"`` or
    ``"kl_bwd"``."""
    if interpret_mode():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}, num_warps=4)]
    shapes = {
        "kl_fwd": ((64, 64, 32, 4, 2), (64, 128, 64, 8, 3), (64, 64, 64, 8, 3), (64, 64, 32, 4, 3)),
        "kl_bwd": ((64, 64, 32, 4, 2), (128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3)),
    }[role]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bv, bk, w, st in shapes
    ]


def set_desc_blocks(nargs):
    """Autotune pre-hook: give the host-side TMA descriptors the block shapes of the config about to run (they
    are built before the config is known). Pointer arguments are left alone."""
    bn, bv, bk = nargs["BLOCK_N"], nargs["BLOCK_V"], nargs["BLOCK_K"]
    for name, shape in (("h", [bn, bk]), ("w", [bv, bk]), ("gz", [bn, bv])):
        d = nargs.get(name)
        if hasattr(d, "block_shape"):
            d.block_shape = shape


# (BLOCK_N, BLOCK_V, BLOCK_K, num_warps, num_stages, CTAS_PER_SM) of the persistent GEMM-tile kernels. The first
# entry is the fp32 one (IEEE fp32 tests). Every bf16 entry passes the static resource report (see
# benchmarks/kernels/results/): no spills, <= 227 KB shared memory, and CTAS_PER_SM CTAs fit on one SM (the
# persistent grid launches exactly that many per SM; a config that did not fit would run its grid in two rounds).
# 128x128 on two warpgroups (~190-254 registers, 1 CTA/SM) has the larger MMAs; 128x64 on one warpgroup
# (164-242 registers, 74-98 KB) fits 2 CTAs/SM, so one CTA's epilogue (exp, sums, stores) overlaps the other's
# MMAs. 128x256 and 64x256 tiles spill in the epilogue and are not offered.
GEMM_SHAPES = {
    "fwd": ((64, 64, 32, 4, 2, 2), (128, 128, 64, 8, 3, 1), (128, 64, 64, 4, 3, 2), (128, 64, 64, 4, 4, 2)),
    "bwd": ((64, 64, 32, 4, 2, 2), (128, 128, 64, 8, 3, 1), (128, 64, 64, 4, 3, 2)),
}


def gemm_configs(role: str):
    """Autotune configs of the persistent GEMM-tile kernels (``role``: ``"fwd"`` or ``"bwd"``).

    ``FLATTEN`` lets the compiler pipeline the tile loop and the K loop as one (the next tile's first TMA loads
    are in flight during this tile's epilogue); ``WS`` (Triton's automatic warp specialization) stays off: on
    sm_90 it compiled to the same code in the resource report."""
    extra = {"GROUP": 8, "FLATTEN": True, "WS": False}
    if interpret_mode():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32, "CTAS_PER_SM": 1, **extra},
                              num_warps=4, pre_hook=set_desc_blocks)]  # fmt: skip
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "CTAS_PER_SM": ctas, **extra},
                      num_warps=w, num_stages=st, pre_hook=set_desc_blocks)
        for bn, bv, bk, w, st, ctas in GEMM_SHAPES[role]
    ]  # fmt: skip


def keep_one_fp32_config(first_arg: str):
    """``early_config_prune`` hook: fp32 inputs (tests at IEEE precision) keep only the first config; other
    dtypes keep the rest (the tensor-core configs the autotuner chooses from)."""

    def prune(configs, named_args, **kwargs):
        x = named_args.get(first_arg)
        x = getattr(x, "base", x)  # a TMA descriptor: the tensor it describes
        is_fp32 = getattr(getattr(x, "dtype", None), "itemsize", 0) == 4
        if len(configs) == 1:
            return configs
        return configs[:1] if is_fp32 else configs[1:]

    prune.first_arg = first_arg  # read by the resource report, to prune as the GPU autotuner does
    return prune
