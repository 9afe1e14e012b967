"""CUDA-only checks of the ring attention's block kernels (skipped without a GPU; run by gpu_check.sh).

On CUDA the ring runs ``aten._scaled_dot_product_flash_attention`` blocks (bf16/fp16) and their backward with the
MERGED output and log-sum-exp; the CPU tests cover the schedule with the CPU kernels. Here: the flash blocks
against the chunked torch kernel, and every rank of a 2- and 4-rank ring (``ring_attention_local``) against
``scaled_dot_product_attention`` in fp32, at Qwen3-0.6B's attention shapes (16 heads, 8 KV heads, head_dim 128).
bf16 tolerances: 2e-2 of each tensor's largest magnitude."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import ring_attention_local
from rlblocks.kernels.ring import _block_bwd, _block_fwd

pytestmark = pytest.mark.gpu
H, HKV, D = 16, 8, 128


def _close(name, got, want, tol=2e-2):
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= tol * max(scale, 1e-3), f"{name}: max abs error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("causal,nq,nk", [(True, 1024, 1024), (False, 512, 2048)])
def test_flash_blocks_match_the_torch_kernel(causal, nq, nk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, nq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, H, nk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    scale = D**-0.5
    out, lse, aux = _block_fwd("cuda", q, k, v, causal, scale)
    ref_out, ref_lse, _ = _block_fwd("math", q.float(), k.float(), v.float(), causal, scale)
    _close("out", out, ref_out)
    torch.testing.assert_close(lse.float(), ref_lse, atol=2e-2, rtol=0)
    dout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    got = _block_bwd("cuda", dout, q, k, v, out, lse, causal, scale, aux)
    want = _block_bwd("math", dout.float(), q.float(), k.float(), v.float(), ref_out, ref_lse, causal, scale, ())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        _close(name, a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_of_a_bf16_ring_matches_sdpa(world):
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(world)
    q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = ring_attention_local(q, k, v, world)
    got = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    _close("out", out, ref)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        _close(name, a, b)
