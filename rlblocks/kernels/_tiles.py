"""Triton building blocks shared by the kernel ops (imported only when triton is installed).

- ``dot_tile``: one ``[BLOCK_N, BLOCK_V]`` fp32 tile of ``hidden @ weightᵀ``, accumulated over ``BLOCK_K`` slices
  of the hidden dimension with ``tl.dot`` (tensor cores for bf16/fp16; IEEE fp32 for fp32 inputs via
  ``PREC="ieee"``). ``UPCAST`` casts the loaded slices to fp32 first: the CPU interpreter needs it (its bf16
  ``tl.dot`` is wrong), GPUs do not.
- ``max_shift`` / ``online_update``: fold one ``[rows, cols]`` tile of logits into running per-row
  ``(m, s, a)`` (definitions in ``_common.py``).
- ``log_mix``: ``log(β·p + (1−β)·q)`` from ``log p`` and ``log q``.
- ``row_configs`` / ``tile_configs`` and ``keep_one_fp32_config``: the autotune sets.

Every reduction here is ``−inf``-safe: an entry whose logit is ``−inf`` has ``exp = 0`` and its ``0·(−inf)``
terms are replaced by 0, and a running max that is still ``−inf`` (nothing but masked entries so far) never
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
        d = tl.where(e > 0, z - m_use[:, None], 0.0)  # e = 0 where z = −inf: no 0·(−inf)
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
    """Configs of the one-row-per-program kernels over materialised logits (memory bound: wide vocab blocks)."""
    if interpret_mode():
        return [triton.Config({"BLOCK_V": 128}, num_warps=4)]
    return [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv, w in ((2048, 8), (4096, 8), (8192, 16))]


# The fp32 (IEEE, no tensor cores) variants exist for exactness tests; they get one config so that a cold start
# compiles and benchmarks nothing else. It is the first entry of every tile config list.
def tile_configs(role: str):
    """Autotune configs of the ``[BLOCK_N, BLOCK_V]`` tile kernels; ``role`` is ``"fwd"``, ``"bwd"`` or ``"kl"``."""
    if interpret_mode():
        return [triton.Config({"BLOCK_N": 16, "BLOCK_V": 64, "BLOCK_K": 32}, num_warps=4)]
    shapes = {
        "fwd": ((64, 64, 32, 4, 2), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 8, 4),
                (128, 128, 32, 4, 4)),
        "bwd": ((64, 64, 32, 4, 2), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)),
        "kl": ((64, 64, 32, 4, 2), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 3)),
    }[role]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bv, bk, w, st in shapes
    ]


def keep_one_fp32_config(first_arg: str):
    """``early_config_prune`` hook: fp32 inputs (tests at IEEE precision) keep only the first config; other
    dtypes keep the rest (the tensor-core configs the autotuner chooses from)."""

    def prune(configs, named_args, **kwargs):
        x = named_args.get(first_arg)
        is_fp32 = getattr(getattr(x, "dtype", None), "itemsize", 0) == 4
        if len(configs) == 1:
            return configs
        return configs[:1] if is_fp32 else configs[1:]

    return prune
