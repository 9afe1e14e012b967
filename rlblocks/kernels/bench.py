"""Benchmark sweep of the fused linear log-prob (+ entropy) op: ``python -m rlblocks.kernels.bench --suite cpu``.

Providers (all compute per-token ``logp`` and optionally the entropy of ``softmax(hidden @ weightᵀ / T)``):

- ``naive``: materialised fp32 logits, ``log_softmax``, gather, entropy ``−Σ p·log p`` (what most RL code does).
- ``compiled_chunked``: the same math on row chunks, each chunk ``torch.compile``d and wrapped in activation
  checkpointing so the backward recomputes it (the best plain-PyTorch answer).
- ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"`` (``logp = −CE``,
  temperature folded into the hidden states); no entropy, CUDA only (its kernels are Triton GPU kernels).
- ``rlblocks``: ``rlblocks.kernels.linear_token_logprobs`` (Triton on CUDA, chunked torch on CPU).

Modes: ``fwd`` (forward with autograd recording), ``bwd`` (backward only; forward run untimed first), ``full``
(forward + backward), ``nograd`` (forward under ``torch.no_grad``: the old/ref log-prob case).

Reported per row: p20/p50/p80 wall time over ``--samples`` samples interleaved across providers (provider order
rotates per sample); TF/s with the FLOP convention ``fwd = nograd = 2·T·H·V``, ``bwd = 6·T·H·V`` (recompute +
two gradient GEMMs), ``full = 8·T·H·V`` — the same nominal count for every provider, so TF/s is comparable
effective throughput; % of peak (CUDA: ``--peak-tflops``, default 989.4 = H100/H200 dense bf16; CPU: the best
fp32 GEMM rate measured in the same run, since a CPU has no published bf16 peak); peak memory above the inputs
(CUDA: ``torch.cuda.max_memory_allocated``; CPU: the peak of the running sum of the torch allocator's
alloc/free events recorded by ``torch.profiler(profile_memory=True)`` — memory that MKL/oneDNN allocate
internally is not seen); max abs error against a float64 reference computed in row chunks (logp, entropy,
grad hidden, grad weight). CSV and JSON (with machine and versions) go to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError

PROVIDERS = ("naive", "compiled_chunked", "liger", "rlblocks")
MODES = ("fwd", "bwd", "full", "nograd")
FLOP_FACTOR = {"fwd": 2, "nograd": 2, "bwd": 6, "full": 8}
IGNORE = -100


@dataclass
class Case:
    T: int
    H: int
    V: int
    dtype: str = "float32"
    modes: tuple[str, ...] = MODES
    entropy: tuple[bool, ...] = (False, True)
    providers: tuple[str, ...] = PROVIDERS


SUITES: dict[str, list[Case]] = {
    # scaled-down CPU set: finishes in a few minutes on 2 cores
    "cpu": [Case(256, 128, 8192), Case(512, 64, 16384)],
    # the CPU performance goal of the issue: fwd+bwd, fp32
    "goal": [Case(4096, 512, 32768, modes=("full",), entropy=(False,), providers=("naive", "rlblocks"))],
    # one H200 in a few minutes (gpu_check.sh); real vocabularies and hidden sizes
    "gpu": [
        Case(8192, 4096, 131072, "bfloat16"),
        Case(4096, 896, 151936, "bfloat16", modes=("full", "nograd"), providers=("naive", "liger", "rlblocks")),
        Case(2048, 8192, 128256, "bfloat16", modes=("full", "nograd"), providers=("naive", "liger", "rlblocks")),
        Case(16384, 4096, 32000, "bfloat16", modes=("full",), providers=("naive", "liger", "rlblocks")),
    ],
    # the full sweep of the issue (GPU; long)
    "gpu-full": [
        Case(t, h, v, "bfloat16")
        for v in (32000, 128256, 151936)
        for h in (896, 4096, 8192)
        for t in (1024, 8192, 32768)
    ],
}


class Skip(Exception):
    """A provider that cannot run here; the message is the reason (printed and written to the results)."""


# ----------------------------------------------------------------------------------------------------- providers
def _naive(h: Tensor, w: Tensor, y: Tensor, temperature: float, entropy: bool):
    valid = y != IGNORE
    z = h @ w.T
    z = z if z.dtype == torch.float64 else z.float()  # fp32 logits (fp64 only for the reference)
    lsm = torch.log_softmax(z / temperature, dim=-1)
    lp = torch.where(valid, lsm.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1), 0.0)
    if not entropy:
        return lp, None
    ent = torch.where(valid, -(lsm.exp() * lsm).sum(-1), 0.0)
    return lp, ent


def _make_compiled_chunked(temperature: float, entropy: bool, chunk_rows: int):
    from torch.utils.checkpoint import checkpoint

    chunk_fn = torch.compile(lambda hc, w, yc: _naive(hc, w, yc, temperature, entropy), dynamic=False)

    def run(h, w, y):
        lps, ents = [], []
        for r0 in range(0, h.shape[0], chunk_rows):
            args = (h[r0 : r0 + chunk_rows], w, y[r0 : r0 + chunk_rows])
            if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
                lp, ent = checkpoint(chunk_fn, *args, use_reentrant=False)
            else:
                lp, ent = chunk_fn(*args)
            lps.append(lp)
            ents.append(ent)
        return torch.cat(lps), (torch.cat(ents) if entropy else None)

    return run


def _make_liger(temperature: float, entropy: bool, device: torch.device):
    if entropy:
        raise Skip("liger: fused linear cross-entropy has no entropy output")
    if device.type != "cuda":
        raise Skip("liger: its fused linear cross-entropy runs Triton GPU kernels; no CUDA device here")
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception as e:
        raise Skip(f"liger: import failed ({type(e).__name__}: {e})") from e

    def run(h, w, y):
        out = LigerFusedLinearCrossEntropyFunction.apply(h / temperature, w, y, None, None, IGNORE, 0.0, 0.0, "none")
        loss = out[0] if isinstance(out, tuple) else out
        return -loss.float(), None

    return run


def make_provider(name: str, temperature: float, entropy: bool, device: torch.device, V: int) -> Callable:
    if name == "naive":
        return lambda h, w, y: _naive(h, w, y, temperature, entropy)
    if name == "compiled_chunked":
        from rlblocks.kernels._common import rows_per_chunk

        return _make_compiled_chunked(temperature, entropy, rows_per_chunk(V))
    if name == "liger":
        return _make_liger(temperature, entropy, device)
    if name == "rlblocks":
        from rlblocks.kernels import linear_token_logprobs

        def run(h, w, y):
            out = linear_token_logprobs(h, w, y, temperature=temperature, return_entropy=entropy)
            return (out[0], out[1]) if entropy else (out, None)

        return run
    raise ArgumentError(f"provider: unknown {name!r}")


# ------------------------------------------------------------------------------------------------------ measuring
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(lp, ent, c1, c2):
    loss = (lp * c1).sum()
    return loss + (ent * c2).sum() if ent is not None else loss


def _once(fn, mode, h, w, y, c1, c2) -> float:
    """Run one sample of ``mode``; return its wall time in seconds (only the timed part)."""
    device = h.device
    h.grad = None
    w.grad = None
    if mode == "nograd":
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(h, w, y)
        _sync(device)
        return time.perf_counter() - t0
    if mode == "bwd":
        loss = _loss(*fn(h, w, y), c1, c2)
        _sync(device)
        t0 = time.perf_counter()
        loss.backward()
        _sync(device)
        return time.perf_counter() - t0
    _sync(device)
    t0 = time.perf_counter()
    out = fn(h, w, y)
    if mode == "full":
        _loss(*out, c1, c2).backward()
    _sync(device)
    return time.perf_counter() - t0


def _cpu_peak_bytes(run: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _peak_mem(fn, mode, h, w, y, c1, c2) -> tuple[float, str]:
    """Peak bytes above what is live before the mode's work starts (inputs only; for bwd: incl. its forward)."""
    device = h.device
    h.grad = None
    w.grad = None

    def run():
        if mode == "nograd":
            with torch.no_grad():
                fn(h, w, y)
        elif mode == "fwd":
            fn(h, w, y)
        else:
            _loss(*fn(h, w, y), c1, c2).backward()

    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20, "torch.cuda.max_memory_allocated"
    return _cpu_peak_bytes(run) / 2**20, "torch.profiler allocator events (CPU)"


def _reference(h, w, y, c1, c2, temperature, entropy, chunk=512):
    """float64 logp / entropy / grads, materialising the logits of ``chunk`` rows at a time (plain autograd)."""
    w64 = w.detach().double().requires_grad_()
    lps, ents, ghs = [], [], []
    for r0 in range(0, h.shape[0], chunk):
        hc = h.detach()[r0 : r0 + chunk].double().requires_grad_()
        lp, ent = _naive(hc, w64, y[r0 : r0 + chunk], temperature, entropy)
        lp = lp.double() if lp.dtype != torch.float64 else lp
        cc1 = c1[r0 : r0 + chunk].double()
        cc2 = c2[r0 : r0 + chunk].double()
        _loss(lp, ent, cc1, cc2).backward()
        lps.append(lp.detach())
        ents.append(ent.detach() if ent is not None else None)
        ghs.append(hc.grad)
    return {
        "logp": torch.cat(lps),
        "entropy": torch.cat(ents) if entropy else None,
        "grad_hidden": torch.cat(ghs),
        "grad_weight": w64.grad,
    }


def _errors(fn, h, w, y, c1, c2, ref) -> dict[str, float]:
    h.grad = None
    w.grad = None
    lp, ent = fn(h, w, y)
    _loss(lp, ent, c1, c2).backward()

    def err(a, b):
        return float((a.double() - b.to(a.device)).abs().max()) if a is not None and b is not None else float("nan")

    return {
        "err_logp": err(lp.detach(), ref["logp"]),
        "err_entropy": err(ent.detach() if ent is not None else None, ref["entropy"]),
        "err_grad_hidden": err(h.grad, ref["grad_hidden"]),
        "err_grad_weight": err(w.grad, ref["grad_weight"]),
    }


def _gemm_peak_tflops(device, dtype) -> float:
    a = torch.randn(2048, 1024, device=device, dtype=dtype)
    b = torch.randn(8192, 1024, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b.t())
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * 1024 * 8192 / best / 1e12


def machine_info(device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    from importlib import metadata

    for dist_name in ("triton", "liger-kernel", "rlblocks"):
        try:
            info[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            info[dist_name] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


# ------------------------------------------------------------------------------------------------------- the sweep
@dataclass
class Row:
    suite: str
    provider: str
    T: int
    H: int
    V: int
    dtype: str
    mode: str
    entropy: bool
    temperature: float
    status: str = "ok"
    samples: int = 0
    p20_ms: float = float("nan")
    p50_ms: float = float("nan")
    p80_ms: float = float("nan")
    tflops_p50: float = float("nan")
    pct_peak: float = float("nan")
    peak_mem_mb: float = float("nan")
    errors: dict[str, float] = field(default_factory=dict)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_case(suite, case: Case, device, samples, temperature, peak_tflops, log) -> list[Row]:
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(case.T, case.H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(case.V, case.H, generator=g) / case.H**0.5 * 2).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, case.V, (case.T,), generator=g)
    y[torch.rand(case.T, generator=g) < 0.2] = IGNORE
    y = y.to(device)
    c1 = torch.randn(case.T, generator=g).to(device) / case.T
    c2 = torch.randn(case.T, generator=g).to(device) / case.T
    rows: list[Row] = []
    for entropy in case.entropy:
        ref = None
        if case.T * case.V <= 2**31:
            ref = _reference(h, w, y, c1, c2, temperature, entropy)
        fns: dict[str, Callable] = {}
        for name in case.providers:
            try:
                fns[name] = make_provider(name, temperature, entropy, device, case.V)
            except Skip as e:
                log(f"  skip {name}: {e}")
                for mode in case.modes:
                    rows.append(Row(suite, name, case.T, case.H, case.V, case.dtype, mode, entropy, temperature,
                                    status=f"skipped: {e}"))
        errs: dict[str, dict[str, float]] = {}
        for name, fn in list(fns.items()):
            try:
                for _ in range(2):  # warm-up (compilation, autotuning)
                    _once(fn, "full", h, w, y, c1, c2)
                    _once(fn, "nograd", h, w, y, c1, c2)
                errs[name] = _errors(fn, h, w, y, c1, c2, ref) if ref is not None else {}
            except Exception as e:
                log(f"  skip {name}: failed on this machine ({type(e).__name__}: {str(e)[:200]})")
                del fns[name]
                for mode in case.modes:
                    rows.append(Row(suite, name, case.T, case.H, case.V, case.dtype, mode, entropy, temperature,
                                    status=f"skipped: failed ({type(e).__name__})"))
        for mode in case.modes:
            times: dict[str, list[float]] = {n: [] for n in fns}
            names = list(fns)
            for i in range(samples):
                k = i % len(names) if names else 0
                for name in names[k:] + names[:k]:  # rotate the order: no provider always runs first
                    times[name].append(_once(fns[name], mode, h, w, y, c1, c2))
            flops = FLOP_FACTOR[mode] * case.T * case.H * case.V
            for name in names:
                mem, _method = _peak_mem(fns[name], mode, h, w, y, c1, c2)
                ts = times[name]
                p50 = _pct(ts, 0.5)
                row = Row(suite, name, case.T, case.H, case.V, case.dtype, mode, entropy, temperature,
                          samples=len(ts), p20_ms=_pct(ts, 0.2) * 1e3, p50_ms=p50 * 1e3, p80_ms=_pct(ts, 0.8) * 1e3,
                          tflops_p50=flops / p50 / 1e12, peak_mem_mb=mem, errors=errs.get(name, {}))
                row.pct_peak = 100 * row.tflops_p50 / peak_tflops
                rows.append(row)
            _print_mode(rows, case, mode, entropy, log)
    return rows


def _print_mode(rows, case, mode, entropy, log):
    sel = [r for r in rows if (r.T, r.H, r.V, r.mode, r.entropy) == (case.T, case.H, case.V, mode, entropy)]
    base = next((r for r in sel if r.provider == "naive" and r.status == "ok"), None)
    log(f"T={case.T} H={case.H} V={case.V} {case.dtype} mode={mode} entropy={entropy}")
    for r in sel:
        if r.status != "ok":
            log(f"  {r.provider:17s} {r.status}")
            continue
        ratio = ""
        if base is not None:
            ratio = f"  time x{r.p50_ms / base.p50_ms:5.2f}  mem x{r.peak_mem_mb / max(base.peak_mem_mb, 1e-9):5.3f}"
        err = r.errors.get("err_logp", float("nan"))
        log(f"  {r.provider:17s} p20/p50/p80 {r.p20_ms:9.2f} {r.p50_ms:9.2f} {r.p80_ms:9.2f} ms  "
            f"{r.tflops_p50:7.3f} TF/s ({r.pct_peak:5.1f}%)  mem {r.peak_mem_mb:9.1f} MiB  err {err:.2e}{ratio}")


def write_results(out_dir, suite, rows, meta):
    os.makedirs(out_dir, exist_ok=True)
    flat = []
    for r in rows:
        d = {k: v for k, v in r.__dict__.items() if k != "errors"}
        for k in ("err_logp", "err_entropy", "err_grad_hidden", "err_grad_weight"):
            d[k] = r.errors.get(k, float("nan"))
        flat.append(d)
    csv_path = os.path.join(out_dir, f"kernels_{suite}.csv")
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(flat[0]))
        wr.writeheader()
        wr.writerows(flat)
    json_path = os.path.join(out_dir, f"kernels_{suite}.json")
    with open(json_path, "w") as f:
        json.dump({**meta, "rows": flat}, f, indent=1, default=str)
    return csv_path, json_path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu" if not torch.cuda.is_available() else "gpu")
    p.add_argument("--samples", type=int, default=30, help="interleaved samples per (case, mode, entropy, provider)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--providers", default=None, help="comma list to restrict providers")
    p.add_argument("--modes", default=None, help="comma list to restrict modes")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak used for %% of peak")
    p.add_argument("--out", default="runs/bench_kernels")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = lambda s: print(s, flush=True)
    cases = SUITES[args.suite]
    if args.providers:
        keep = tuple(args.providers.split(","))
        cases = [Case(**{**c.__dict__, "providers": tuple(x for x in c.providers if x in keep)}) for c in cases]
    if args.modes:
        keep = tuple(args.modes.split(","))
        cases = [Case(**{**c.__dict__, "modes": tuple(x for x in c.modes if x in keep)}) for c in cases]
    if args.peak_tflops is not None:
        peak, peak_src = args.peak_tflops, "--peak-tflops"
    elif device.type == "cuda":
        peak, peak_src = 989.4, "H100/H200 SXM dense bf16 (989.4 TF/s)"
    else:
        peak = _gemm_peak_tflops(device, torch.float32)
        peak_src = f"best fp32 GEMM measured in this run ({peak:.3f} TF/s; a CPU has no published bf16 peak)"
    meta = {
        "suite": args.suite,
        "machine": machine_info(device),
        "flop_convention": "fwd = nograd = 2*T*H*V, bwd = 6*T*H*V, full = 8*T*H*V (same nominal count for every "
        "provider); T counts all tokens including ignored ones",
        "peak_tflops": peak,
        "peak_source": peak_src,
        "memory_method": "CUDA: max_memory_allocated - allocated before; CPU: peak running sum of torch.profiler "
        "allocator events (profile_memory=True); both above the live inputs",
        "timing": f"wall clock (perf_counter, CUDA-synchronised), {args.samples} samples interleaved across "
        "providers with rotating order, after 2 warm-up runs",
        "labels": f"20% ignored (-100), temperature {args.temperature:.2f}",
    }
    log(json.dumps(meta["machine"]))
    log(f"peak: {peak_src}")
    rows: list[Row] = []
    for case in cases:
        rows += run_case(args.suite, case, device, args.samples, args.temperature, peak, log)
    csv_path, json_path = write_results(args.out, args.suite, rows, meta)
    log(f"wrote {csv_path} and {json_path}")
    return rows


if __name__ == "__main__":
    main()
