"""Static sm_90 (H100/H200) resource report of every Triton kernel config, on a machine without a GPU.

``python benchmarks/kernels/resources.py`` compiles each autotune config of each kernel of ``rlblocks.kernels`` for
``GPUTarget("cuda", 90, 64)`` with Triton's own compiler (the configs a GPU autotuner would try: fp32 gets its
single IEEE config, bf16 the tensor-core ones), reads the cubin with the ``cuobjdump`` bundled in the triton
package, and prints per config: registers per thread, stack bytes and spill instructions (``STL``/``LDL``),
shared memory (dynamic + static), CTAs per SM that fit (registers, shared memory, threads), and whether the SASS
uses wgmma (``HGMMA``) and TMA (``UTMALDG``/``UTMASTG``). Exit status 1 when a bf16/fp16 config spills, uses more
than 227 KB of shared memory, or (persistent kernels) declares more resident CTAs per SM than fit.

The report needs triton (the ``kernels`` extra) and no CUDA; it takes a few seconds per config.

Examples::

    python benchmarks/kernels/resources.py                     # every kernel, bf16 and fp32
    python benchmarks/kernels/resources.py --kernels linear_logprobs --dtypes bf16 --out report.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# Resource figures of sm_90 (CUDA programming guide, compute capability 9.0).
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA = 227 * 1024
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32


@dataclasses.dataclass
class Spec:
    """How to compile one kernel: which pointer arguments carry the input dtype (the rest are fp32 unless named in
    ``i64`` / ``i8``), which scalars are floats (the rest int32; ``div16`` ones marked divisible by 16, as Triton's
    launcher specialises them at run time for the usual shapes), and the constexpr variants to compile."""

    name: str
    module: str
    kernel: str
    inputs: tuple[str, ...]
    floats: tuple[str, ...]
    variants: tuple[dict[str, Any], ...]
    i64: tuple[str, ...] = ()
    i8: tuple[str, ...] = ()
    div16: tuple[str, ...] = ()
    descs: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # arg -> (rows key, cols key)
    configs: tuple = ()  # for a kernel without @autotune: the launch configs the host uses


def _fused_grad_configs() -> tuple:
    import triton

    from rlblocks.kernels.linear_logprobs_loss import FUSED_GRAD_BLOCK_N, FUSED_GRAD_WARPS

    return tuple(triton.Config({"BLOCK_N": FUSED_GRAD_BLOCK_N, "BLOCK_V": bv}, num_warps=FUSED_GRAD_WARPS)
                 for bv in (64, 128))  # the BLOCK_V values of the forward configs  # fmt: skip


def _prec(dtype: str) -> str:
    return "ieee" if dtype == "fp32" else "tf32"


def specs(dtype: str) -> list[Spec]:
    """The kernels of ``rlblocks.kernels`` with the roles of their arguments (follow a kernel's signature when it
    changes: a stale role fails to compile here)."""
    p = _prec(dtype)
    lin = ("H", "stride_hn", "stride_wv", "stride_gz", "stride_e")
    tma = {"h": ("BLOCK_N", "BLOCK_K"), "w": ("BLOCK_V", "BLOCK_K"), "gz": ("BLOCK_N", "BLOCK_V")}
    return [
        Spec("linear_logprobs.fwd", "rlblocks.kernels._linear", "_linear_logprobs_fwd_kernel",
             inputs=("h", "w", "e_ptr"), floats=("inv_temp",), i64=("yl_ptr",), div16=lin, descs=tma,
             variants=tuple(dict(HAS_ENT=e, STORE_E=se, HAS_TAU=t, USE_TMA=True, UPCAST=False, PREC=p)
                            for e, se, t in ((False, False, False), (True, False, False), (True, True, False),
                                             (True, False, True)))),
        Spec("linear_logprobs.bwd", "rlblocks.kernels._linear", "_linear_logprobs_bwd_kernel",
             inputs=("h", "w", "gz"), floats=("inv_temp",), i64=("yl_ptr",), div16=lin, descs=tma,
             variants=tuple(dict(HAS_ENT=e, HAS_TAU=t, USE_TMA=True, UPCAST=False, PREC=p)
                            for e, t in ((False, False), (True, False), (True, True)))),
        Spec("linear_logprobs.fused_grad", "rlblocks.kernels.linear_logprobs_loss", "_fused_grad_kernel",
             inputs=("e_ptr", "gz_ptr"), floats=("inv_temp",), i64=("yl_ptr",), div16=("stride_e", "stride_gz"),
             variants=tuple(dict(HAS_ENT=e) for e in (False, True)), configs=_fused_grad_configs()),
        Spec("linear_kl.fwd", "rlblocks.kernels.linear_kl", "_linear_kl_fwd_kernel",
             inputs=("hs_ptr", "ws_ptr", "ht_ptr", "wt_ptr"), floats=("inv_temp", "log_beta", "log_1mb"),
             div16=("HS", "HT", "stride_hs", "stride_ws", "stride_ht", "stride_wt"),
             variants=tuple(dict(KIND=k, PASS=ps, UPCAST=False, PREC_S=p, PREC_T=p)
                            for k, ps in ((0, 1), (1, 1), (2, 1), (2, 2)))),
        Spec("linear_kl.bwd", "rlblocks.kernels.linear_kl", "_linear_kl_bwd_kernel",
             inputs=("hs_ptr", "ws_ptr", "ht_ptr", "wt_ptr", "gz_ptr"),
             floats=("inv_temp", "beta", "log_beta", "log_1mb"),
             div16=("HS", "HT", "stride_hs", "stride_ws", "stride_ht", "stride_wt", "stride_gz"),
             variants=tuple(dict(KIND=k, UPCAST=False, PREC_S=p, PREC_T=p) for k in (0, 1, 2))),
        Spec("logprobs.fwd", "rlblocks.kernels.logprobs", "_token_logprobs_fwd_kernel",
             inputs=("x_ptr",), floats=("inv_temp",), i64=("y_ptr",), div16=("stride_x",),
             variants=tuple(dict(HAS_ENT=e, HAS_TAU=t) for e, t in ((False, False), (True, False), (True, True)))),
        Spec("logprobs.bwd", "rlblocks.kernels.logprobs", "_token_logprobs_bwd_kernel",
             inputs=("x_ptr", "gx_ptr"), floats=("inv_temp",), i64=("y_ptr",), div16=("stride_x", "stride_gx"),
             variants=tuple(dict(HAS_ENT=e, HAS_TAU=t) for e, t in ((False, False), (True, False), (True, True)))),
        Spec("kl.fwd", "rlblocks.kernels.kl", "_vocab_kl_fwd_kernel",
             inputs=("s_ptr", "t_ptr"), floats=("inv_temp", "beta", "log_beta", "log_1mb"), i8=("valid_ptr",),
             div16=("stride_s", "stride_t"), variants=tuple(dict(KIND=k) for k in (0, 1, 2))),
        Spec("kl.bwd", "rlblocks.kernels.kl", "_vocab_kl_bwd_kernel",
             inputs=("s_ptr", "t_ptr", "gs_ptr"), floats=("inv_temp", "beta", "log_beta", "log_1mb"),
             i8=("valid_ptr",), div16=("stride_s", "stride_t", "stride_gs"),
             variants=tuple(dict(KIND=k) for k in (0, 1, 2))),
    ]


@dataclasses.dataclass
class Row:
    kernel: str
    dtype: str
    variant: str
    config: str
    regs: int = -1
    stack: int = -1
    spill_insts: int = -1
    smem: int = -1
    ctas_per_sm: int = -1
    limiter: str = ""
    hgmma: int = 0
    hmma: int = 0
    tma: int = 0
    declared_ctas: int | None = None
    compile_s: float = 0.0
    status: str = "ok"

    def problems(self) -> list[str]:
        out = []
        if self.status != "ok":
            return [self.status]
        if self.dtype != "fp32" and (self.spill_insts > 0 or self.stack > 0):
            out.append(f"spills ({self.stack} B stack, {self.spill_insts} STL/LDL)")
        if self.smem > SMEM_PER_CTA:
            out.append(f"shared memory {self.smem} B > {SMEM_PER_CTA} B")
        if self.declared_ctas is not None and self.ctas_per_sm < self.declared_ctas:
            out.append(f"declares {self.declared_ctas} CTAs/SM for its persistent grid, {self.ctas_per_sm} fit")
        return out


def _bin_dir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _occupancy(regs: int, smem: int, warps: int) -> tuple[int, str]:
    threads = 32 * warps
    # registers are allocated per warp in units of 256 (8 per thread)
    per_thread = -(-max(regs, 1) // 8) * 8
    by_regs = REGS_PER_SM // (per_thread * threads)
    by_smem = SMEM_PER_SM // (smem + 1024) if smem > 0 else MAX_CTAS_PER_SM  # 1 KB per CTA is reserved
    by_threads = MAX_THREADS_PER_SM // threads
    limits = {"regs": by_regs, "smem": by_smem, "threads": by_threads, "ctas": MAX_CTAS_PER_SM}
    name = min(limits, key=limits.get)
    return limits[name], name


def _compile_one(spec: Spec, jit_fn, dtype: str, variant: dict, config, target) -> Row:
    import triton
    from triton.compiler import ASTSource

    kw = dict(config.kwargs)
    cfg_txt = ",".join(f"{k}={v}" for k, v in kw.items()) + f",w={config.num_warps},st={config.num_stages}"
    if getattr(config, "maxnreg", None):
        cfg_txt += f",maxnreg={config.maxnreg}"
    row = Row(spec.name, dtype, ",".join(f"{k}={v}" for k, v in variant.items()), cfg_txt)
    consts = {**variant, **kw}
    sig: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, param) in enumerate(zip(jit_fn.arg_names, jit_fn.params)):
        if param.is_constexpr:
            sig[name] = "constexpr"
            consts.setdefault(name, None)
        elif name in spec.descs:
            r, c = spec.descs[name]
            sig[name] = f"tensordesc<{dtype}[{consts[r]}, {consts[c]}]>"
        elif name.endswith("_ptr"):
            if name in spec.inputs:
                elt = dtype
            else:
                elt = "i64" if name in spec.i64 else ("i8" if name in spec.i8 else "fp32")
            sig[name] = "*" + elt
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in spec.floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in spec.div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = [k for k, v in consts.items() if v is None]
    if missing:
        row.status = f"no value for constexpr {missing}"
        return row
    opts = dict(num_warps=config.num_warps, num_stages=config.num_stages, num_ctas=getattr(config, "num_ctas", 1))
    if getattr(config, "maxnreg", None):
        opts["maxnreg"] = config.maxnreg
    t0 = time.perf_counter()
    try:
        ck = triton.compile(ASTSource(jit_fn, sig, constexprs=consts, attrs=attrs), target=target, options=opts)
    except Exception as e:  # a config that does not compile is a finding, not a crash of the report
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        row.status = f"compile failed: {type(e).__name__}: {(lines[-1] if lines else '')[:200]}"
        return row
    row.compile_s = time.perf_counter() - t0
    row.declared_ctas = kw.get("CTAS_PER_SM")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        bins = _bin_dir()
        res = subprocess.run([os.path.join(bins, "cuobjdump"), "--dump-resource-usage", cubin],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([os.path.join(bins, "cuobjdump"), "--dump-sass", cubin],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    if not m:
        row.status = "cuobjdump: no resource line"
        return row
    row.regs, row.stack = int(m.group(1)), int(m.group(2))
    static_smem = int(m.group(3))
    row.smem = int(ck.metadata.shared) + static_smem
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    row.spill_insts = sum(o in ("STL", "LDL") for o in ops)
    row.hgmma = sum(o == "HGMMA" for o in ops)
    row.hmma = sum(o == "HMMA" for o in ops)
    row.tma = sum(o in ("UTMALDG", "UTMASTG", "UTMAREDG") for o in ops)
    row.ctas_per_sm, row.limiter = _occupancy(row.regs, row.smem, config.num_warps)
    return row


def _configs_for(kernel, dtype: str) -> list:
    """The configs a GPU autotuner would consider for ``dtype`` (after the package's fp32 pruning)."""
    configs = list(kernel.configs)
    prune = getattr(kernel, "early_config_prune", None)
    if prune is None:
        return configs
    import torch

    fake = torch.empty(0, dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    return prune(configs, {prune.first_arg: fake})


def run(kernels: list[str] | None, dtypes: list[str], log: Callable[[str], None],
        config_filter: Callable[[Any], bool] | None = None) -> list[Row]:  # fmt: skip
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("resources: unset TRITON_INTERPRET (the report compiles the GPU configs)")
    import importlib

    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 64)
    rows: list[Row] = []
    for dtype in dtypes:
        for spec in specs(dtype):
            if kernels and not any(spec.name == k or spec.name.startswith(k + ".") for k in kernels):
                continue
            kernel = getattr(importlib.import_module(spec.module), spec.kernel)
            jit_fn = kernel.fn if hasattr(kernel, "configs") else kernel
            for config in spec.configs or _configs_for(kernel, dtype):
                if config_filter is not None and not config_filter(config):
                    continue
                for variant in spec.variants:
                    row = _compile_one(spec, jit_fn, dtype, variant, config, target)
                    rows.append(row)
                    log(format_row(row))
    return rows


HEADER = (f"{'kernel':20s} {'dtype':5s} {'variant':34s} {'config':46s} {'regs':>4s} {'stack':>5s} {'spill':>5s} "
          f"{'smem KB':>7s} {'CTA/SM':>6s} {'limit':7s} {'wgmma':>5s} {'tma':>3s} {'s':>4s}  check")  # fmt: skip


def format_row(r: Row) -> str:
    probs = r.problems()
    check = "FAIL: " + "; ".join(probs) if probs else "ok"
    if r.status != "ok":
        return f"{r.kernel:20s} {r.dtype:5s} {r.variant[:34]:34s} {r.config[:46]:46s} {check}"
    wg = "yes" if r.hgmma else ("hmma" if r.hmma else "no")
    return (f"{r.kernel:20s} {r.dtype:5s} {r.variant[:34]:34s} {r.config[:46]:46s} {r.regs:4d} {r.stack:5d} "
            f"{r.spill_insts:5d} {r.smem / 1024:7.1f} {r.ctas_per_sm:6d} {r.limiter:7s} {wg:>5s} "
            f"{'yes' if r.tma else 'no':>3s} {r.compile_s:4.1f}  {check}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default=None, help="comma list of kernel names or op prefixes (default: all), e.g. "
                   "linear_logprobs or linear_logprobs.fwd")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma list of input dtypes: bf16, fp16, fp32")
    p.add_argument("--out", default=None, help="also write the report (text) to this file")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    lines: list[str] = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    import triton

    log(f"sm_90 static resource report (triton {triton.__version__}, python {sys.version.split()[0]}); "
        f"occupancy from {REGS_PER_SM} regs, {SMEM_PER_SM // 1024} KB smem, {MAX_THREADS_PER_SM} threads per SM")
    log(HEADER)
    rows = run(args.kernels.split(",") if args.kernels else None, args.dtypes.split(","), log)
    bad = [r for r in rows if r.problems()]
    log(f"{len(rows)} configs compiled, {len(bad)} failing the check (bf16/fp16 spills, > 227 KB shared memory, "
        f"persistent grid larger than the CTAs that fit, or a compile error)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    raise SystemExit(main())
