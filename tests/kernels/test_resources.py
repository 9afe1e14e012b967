"""The static sm_90 resource report (``benchmarks/kernels/resources.py``) compiles the GPU kernels with Triton's
real compiler (no GPU needed): a kernel that would not compile on a GPU fails here, and the report's checks fire
on a config that spills or oversubscribes its persistent grid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlblocks.kernels._common import triton_available

RESOURCES = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
CODE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, sys.argv[1])  # benchmarks/kernels: the report is a script there
import resources as r
import rlblocks.kernels._linear as L

rows = r.run(["linear_logprobs.fwd", "linear_logprobs.bwd"], ["bf16"], print,
             config_filter=lambda c: c.kwargs["BLOCK_V"] == 128 and c.num_warps == 8)
assert len(rows) == 7, rows  # 4 forward variants (incl. sampling replay), 3 backward
assert not any(x.problems() for x in rows), [x.problems() for x in rows]
assert all(x.hgmma > 0 and x.tma > 0 for x in rows), "expected wgmma and TMA in the bf16 GEMM kernels"
# a 128x256 tile on 8 warps holds 128 accumulator registers per thread: it spills, and 2 CTAs/SM cannot fit
spec = r.specs("bf16")[0]
cfg = triton.Config(dict(BLOCK_N=128, BLOCK_V=256, BLOCK_K=64, GROUP=8, CTAS_PER_SM=2, FLATTEN=True, WS=False),
                    num_warps=8, num_stages=3)
bad = r._compile_one(spec, L._linear_logprobs_fwd_kernel.fn, "bf16",
                     dict(HAS_ENT=True, STORE_E=False, HAS_TAU=False, USE_TMA=True, UPCAST=False, PREC="tf32"), cfg,
                     GPUTarget("cuda", 90, 64))
probs = bad.problems()
assert any("spills" in p for p in probs) and any("CTAs/SM" in p for p in probs), probs
print("resources-ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_report_compiles_for_sm90_and_flags_bad_configs():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", CODE, str(RESOURCES)], capture_output=True, text=True, timeout=900,
                         env=env)
    assert res.returncode == 0 and "resources-ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
