"""Triton building block shared by the fused-linear ops: one ``[BLOCK_N, BLOCK_V]`` tile of ``hidden @ weightᵀ``.

Imported only when triton is installed. The tile is accumulated in fp32 over ``BLOCK_K`` slices of the hidden
dimension with ``tl.dot`` (tensor cores for bf16/fp16; IEEE fp32 for fp32 inputs via ``PREC="ieee"``). ``UPCAST``
casts the loaded slices to fp32 first: the CPU interpreter needs it (its bf16 ``tl.dot`` is wrong), GPUs do not.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
