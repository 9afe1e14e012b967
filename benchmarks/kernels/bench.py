"""Benchmark sweep of the fused linear log-prob (+ entropy) op: ``python benchmarks/kernels/bench.py --suite cpu``.

Suites: ``cpu`` (a scaled-down CPU set, a few minutes), ``cpu-large`` (one large CPU case: T=4096 H=512 V=32768 fp32,
forward+backward), ``cpu-real`` (a real small model's LM head, SmolLM2-135M's H=576 V=49152, at T=2048 and 8192, fp32
forward+backward, with and without entropy at 2048), ``gpu-large``, ``gpu-more`` and ``gpu-full`` (one CUDA device; see
``gpu_check.sh``), ``validate`` (seconds: every provider and mode once, to check that the script runs). ``--quick`` runs
``validate`` with 2 samples and fails unless every provider that ran agrees with the float64 reference (max abs error ≤
1e-4 in fp32) and the naive and rlblocks rows are there; it prints ``quick: ok``. One file: the providers, the suites
and the timing/memory harness share one row format, which the results files and ``gpu_check.sh`` read.

The CPU figures of ``results/kernels_cpu-real*`` come from (the 1-minute load average is printed and stored)::

    PYTHONPATH=$PWD python benchmarks/kernels/bench.py --suite cpu-real --clock cpu --threads 1 --samples 3 \
        --warmup 1 --err-rows 256 --providers naive,rlblocks,rlblocks_fused --out benchmarks/kernels/results
    PYTHONPATH=$PWD python benchmarks/kernels/bench.py --suite cpu-real --samples 5 --err-rows 512 \
        --out benchmarks/kernels/results

On a loaded CPU, ``--clock cpu --threads 1`` times each sample by the process's CPU seconds on one thread: the work
each provider does, whatever share of the cores the run gets (the wall-clock ratios there carry tens of percent of
noise, and 2-thread runs also wait on descheduled threads at every parallel op).

Providers (all compute per-token ``logp`` and optionally the entropy of ``softmax(hidden @ weightᵀ / T)``):

- ``naive``: materialised fp32 logits, ``log_softmax``, gather, entropy ``−Σ p·log p`` (what most RL code does).
- ``compiled_chunked``: the same math on row chunks, each chunk ``torch.compile``d and wrapped in activation
  checkpointing so the backward recomputes it (the best plain-PyTorch answer).
- ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"`` (``logp = −CE``,
  temperature folded into the hidden states; liger >= 0.8.2: older versions give wrong gradients with "none"). It
  defers the gradient to the backward and recomputes the logits there. No entropy; CUDA only.
- ``liger_sum``: the same with ``reduction="sum"``, where liger forms the gradient in the forward (one pass over
  the logits, 6·N·H·V executed FLOPs); the loss is ``−Σ logp`` (coefficient 1 per token). Mode ``full`` only.
- ``rlblocks``: ``rlblocks.kernels.linear_token_logprobs`` (Triton on CUDA, chunked torch on CPU).
- ``rlblocks_fused``: ``rlblocks.kernels.linear_token_logprobs_loss`` with the per-token coefficients known up front:
  the logits gradient is formed in the forward (6·N·H·V). Modes ``full`` and ``nograd``.

Modes: ``fwd`` (forward with autograd recording), ``bwd`` (backward only; forward run untimed first), ``full``
(forward + backward), ``nograd`` (forward under ``torch.no_grad``: the old/ref log-prob case).

Reported per row: p20/p50/p80 wall time over ``--samples`` samples interleaved across providers (provider order
rotates per sample); TF/s against the model FLOP count ``fwd = nograd = 2·N·H·V``, ``bwd = 4·N·H·V``,
``full = 6·N·H·V`` (the same for every provider), and % of peak from it (CUDA: ``--peak-tflops``, default 989.4 =
H100/H200 dense bf16; CPU: the best fp32 GEMM rate measured in the same run); a second TF/s against the FLOPs the
provider actually executes (a recomputing backward executes 6·N·H·V, so ``full`` is 8·N·H·V for ``rlblocks``,
``liger`` and ``compiled_chunked``); peak memory above the inputs, in MiB and as a multiple of the bf16 logits
``N·V·2`` bytes (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the peak of the running sum of the torch
allocator's alloc/free events recorded by ``torch.profiler(profile_memory=True)`` — memory that MKL/oneDNN allocate
internally is not seen); max abs error against a float64 reference (logp, entropy, grad hidden, grad weight) on
the first ``--err-rows`` rows (a sub-batch run through the same provider). Rows are appended to
``--out/kernels_<suite>.csv`` as they are measured; the JSON with machine and versions is written at the end, and
the last lines printed are a summary table (also: ``--table-from FILE.csv``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError

PROVIDERS = ("naive", "compiled_chunked", "liger", "liger_sum", "rlblocks", "rlblocks_fused")
MODES = ("fwd", "bwd", "full", "nograd")
MODEL_FLOPS = {"fwd": 2, "nograd": 2, "bwd": 4, "full": 6}  # × N·H·V: what the math needs, once
# × N·H·V actually executed: a recomputing backward redoes the logits GEMM; a forward that forms the gradient does
# all three GEMMs up front.
EXECUTED_FLOPS = {
    "naive": {"fwd": 2, "nograd": 2, "bwd": 4, "full": 6},
    "compiled_chunked": {"fwd": 2, "nograd": 2, "bwd": 6, "full": 8},
    "liger": {"fwd": 2, "nograd": 2, "bwd": 6, "full": 8},
    "liger_sum": {"full": 6},
    "rlblocks": {"fwd": 2, "nograd": 2, "bwd": 6, "full": 8},
    "rlblocks_fused": {"full": 6, "nograd": 2},
}
PROVIDER_MODES = {"liger_sum": ("full",), "rlblocks_fused": ("full", "nograd")}
IGNORE = -100
PEAK_BF16 = 989.4
# the clock of the timed samples (``--clock``): wall time, or the CPU seconds of this process (all its threads)
CLOCK = [time.perf_counter]


@dataclass
class Case:
    T: int
    H: int
    V: int
    dtype: str = "float32"
    modes: tuple[str, ...] = MODES
    entropy: tuple[bool, ...] = (False, True)
    providers: tuple[str, ...] = PROVIDERS


_GPU_P = ("naive", "liger", "liger_sum", "rlblocks", "rlblocks_fused")
SUITES: dict[str, list[Case]] = {
    # scaled-down CPU set: finishes in a few minutes on 2 cores
    "cpu": [Case(256, 128, 8192, providers=("naive", "compiled_chunked", "rlblocks", "rlblocks_fused")),
            Case(512, 64, 16384, providers=("naive", "compiled_chunked", "rlblocks", "rlblocks_fused"))],
    # one large CPU case: fwd+bwd, fp32
    "cpu-large": [Case(4096, 512, 32768, modes=("full",), entropy=(False,), providers=("naive", "rlblocks",
                                                                                   "rlblocks_fused"))],
    # a real small model's LM head (SmolLM2-135M: H=576, V=49152) at two batch sizes, fwd+bwd, fp32
    "cpu-real": [Case(t, 576, 49152, modes=("full",), entropy=ent,
                      providers=("naive", "compiled_chunked", "rlblocks", "rlblocks_fused"))
                 for t, ent in ((2048, (False, True)), (8192, (False,)))],
    # one large GPU case (an 8B model's LM head over a 128k vocabulary), run first by gpu_check.sh: forward and full
    "gpu-large": [Case(8192, 4096, 131072, "bfloat16", modes=("fwd", "full"), entropy=(False,), providers=_GPU_P)],
    # the rest of the one-H200 check: no-grad and entropy at the gpu-large shape, then other real vocabularies
    "gpu-more": [
        Case(8192, 4096, 131072, "bfloat16", modes=("nograd", "full"), entropy=(True,),
             providers=("naive", "rlblocks", "rlblocks_fused")),
        Case(4096, 896, 151936, "bfloat16", modes=("full", "nograd"), entropy=(False,), providers=_GPU_P),
        Case(16384, 4096, 32000, "bfloat16", modes=("full",), entropy=(False,), providers=_GPU_P),
        Case(2048, 8192, 128256, "bfloat16", modes=("full",), entropy=(False,), providers=_GPU_P),
    ],
    # the full sweep (GPU; long)
    "gpu-full": [
        Case(t, h, v, "bfloat16")
        for v in (32000, 128256, 151936)
        for h in (896, 4096, 8192)
        for t in (1024, 8192, 32768)
    ],
    # seconds on CPU: every provider and mode once, to check that the script itself runs (gpu_check.sh --validate)
    "validate": [Case(48, 32, 320, providers=("naive", "liger", "liger_sum", "rlblocks", "rlblocks_fused"))],
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

    def run(h, w, y, c1=None, c2=None):
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


def _make_liger(temperature: float, entropy: bool, device: torch.device, reduction: str):
    if entropy:
        raise Skip("liger: fused linear cross-entropy has no entropy output")
    if device.type != "cuda":
        raise Skip("liger: its fused linear cross-entropy runs Triton GPU kernels; no CUDA device here")
    try:
        from importlib import metadata

        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        version = metadata.version("liger-kernel")
    except Exception as e:
        raise Skip(f"liger: import failed ({type(e).__name__}: {e})") from e
    parts = tuple(int(x) for x in version.split(".")[:3] if x.isdigit())
    if reduction == "none" and parts < (0, 8, 2):
        raise Skip(f"liger: {version} < 0.8.2 computes wrong gradients with reduction='none'")

    def run(h, w, y, c1=None, c2=None):
        out = LigerFusedLinearCrossEntropyFunction.apply(h / temperature, w, y, None, None, IGNORE, 0.0, 0.0,
                                                         reduction)  # fmt: skip
        loss = out[0] if isinstance(out, tuple) else out
        if reduction == "sum":
            return loss.float(), None  # −Σ logp: the loss itself
        return -loss.float(), None

    return run


def make_provider(name: str, temperature: float, entropy: bool, device: torch.device, V: int) -> Callable:
    """``run(h, w, y, c1, c2) -> (out, ent)``: ``out`` is logp per token, except for the fused providers, whose
    ``out`` is the scalar loss ``Σ c1·logp + Σ c2·entropy`` (``liger_sum``: ``−Σ logp``)."""
    if name == "naive":
        return lambda h, w, y, c1=None, c2=None: _naive(h, w, y, temperature, entropy)
    if name == "compiled_chunked":
        if device.type == "cpu" and not _has_cpp_compiler():
            raise Skip("compiled_chunked: torch.compile on CPU needs a C++ compiler")
        from rlblocks.kernels._common import rows_per_chunk

        return _make_compiled_chunked(temperature, entropy, rows_per_chunk(V))
    if name == "liger":
        return _make_liger(temperature, entropy, device, "none")
    if name == "liger_sum":
        return _make_liger(temperature, entropy, device, "sum")
    if name == "rlblocks":
        from rlblocks.kernels import linear_token_logprobs

        def run(h, w, y, c1=None, c2=None):
            out = linear_token_logprobs(h, w, y, temperature=temperature, return_entropy=entropy)
            return (out[0], out[1]) if entropy else (out, None)

        return run
    if name == "rlblocks_fused":
        from rlblocks.kernels import linear_token_logprobs_loss

        def run(h, w, y, c1, c2):
            res = linear_token_logprobs_loss(h, w, y, c1, entropy_coef=c2 if entropy else None,
                                             temperature=temperature)  # fmt: skip
            return res.loss, None

        return run
    raise ArgumentError(f"provider: unknown {name!r}")


def _has_cpp_compiler() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _is_fused(name: str) -> bool:
    return name in ("liger_sum", "rlblocks_fused")


# ------------------------------------------------------------------------------------------------------ measuring
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(name, out, ent, c1, c2):
    if _is_fused(name):
        return out
    loss = (out * c1).sum()
    return loss + (ent * c2).sum() if ent is not None else loss


def _once(name, fn, mode, h, w, y, c1, c2) -> float:
    """Run one sample of ``mode``; return its time in seconds by ``CLOCK`` (only the timed part)."""
    device = h.device
    h.grad = None
    w.grad = None
    if mode == "nograd":
        _sync(device)
        t0 = CLOCK[0]()
        with torch.no_grad():
            fn(h, w, y, c1, c2)
        _sync(device)
        return CLOCK[0]() - t0
    if mode == "bwd":
        loss = _loss(name, *fn(h, w, y, c1, c2), c1, c2)
        _sync(device)
        t0 = CLOCK[0]()
        loss.backward()
        _sync(device)
        return CLOCK[0]() - t0
    _sync(device)
    t0 = CLOCK[0]()
    out = fn(h, w, y, c1, c2)
    if mode == "full":
        _loss(name, *out, c1, c2).backward()
    _sync(device)
    return CLOCK[0]() - t0


@contextlib.contextmanager
def _quiet_fds():
    """Silence fds 1 and 2 (the profiler's C++ side prints ``USDT ... profiler_start`` lines there)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _cpu_peak_bytes(run: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fds(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _peak_mem(name, fn, mode, h, w, y, c1, c2) -> float:
    """Peak MiB above what is live before the mode's work starts (inputs only; for bwd: incl. its forward)."""
    device = h.device
    h.grad = None
    w.grad = None

    def run():
        if mode == "nograd":
            with torch.no_grad():
                fn(h, w, y, c1, c2)
        elif mode == "fwd":
            fn(h, w, y, c1, c2)
        else:
            _loss(name, *fn(h, w, y, c1, c2), c1, c2).backward()

    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        run()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return _cpu_peak_bytes(run) / 2**20


def _coefs(name, c1, c2):
    """The per-token coefficients a provider's loss uses (``liger_sum``: −1 per token, i.e. loss = Σ CE)."""
    if name == "liger_sum":
        return -torch.ones_like(c1), torch.zeros_like(c2)
    return c1, c2


def _reference(h, w, y, c1, c2, temperature, entropy, chunk=256):
    """float64 logp / entropy / grads of ``Σ c1·logp + Σ c2·entropy``, materialising ``chunk`` rows of logits at a
    time (plain autograd)."""
    w64 = w.detach().double().requires_grad_()
    lps, ents, ghs = [], [], []
    for r0 in range(0, h.shape[0], chunk):
        hc = h.detach()[r0 : r0 + chunk].double().requires_grad_()
        lp, ent = _naive(hc, w64, y[r0 : r0 + chunk], temperature, entropy)
        loss = (lp * c1[r0 : r0 + chunk].double()).sum()
        if ent is not None:
            loss = loss + (ent * c2[r0 : r0 + chunk].double()).sum()
        loss.backward()
        lps.append(lp.detach())
        ents.append(ent.detach() if ent is not None else None)
        ghs.append(hc.grad)
    return {
        "logp": torch.cat(lps),
        "entropy": torch.cat(ents) if entropy else None,
        "grad_hidden": torch.cat(ghs),
        "grad_weight": w64.grad,
    }


def _errors(name, fn, h, w, y, c1, c2, temperature, entropy) -> dict[str, float]:
    """Max abs errors of one run of the provider on ``(h, w, y)`` against the float64 reference."""
    c1, c2 = _coefs(name, c1, c2)
    ref = _reference(h, w, y, c1, c2, temperature, entropy)
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    out, ent = fn(hh, ww, y, c1, c2)
    _loss(name, out, ent, c1, c2).backward()

    def err(a, b):
        return float((a.double() - b.to(a.device)).abs().max()) if a is not None and b is not None else float("nan")

    res = {"err_grad_hidden": err(hh.grad, ref["grad_hidden"]), "err_grad_weight": err(ww.grad, ref["grad_weight"])}
    if _is_fused(name):
        want = (ref["logp"] * c1.double()).sum()
        if ent is None and entropy and ref["entropy"] is not None:
            want = want + (ref["entropy"] * c2.double()).sum()
        res["err_loss"] = err(out.detach().reshape(1), want.reshape(1))
    else:
        res["err_logp"] = err(out.detach(), ref["logp"])
        res["err_entropy"] = err(ent.detach() if ent is not None else None, ref["entropy"])
    return res


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
    executed_nhv: float = float("nan")
    tflops_executed: float = float("nan")
    peak_mem_mb: float = float("nan")
    mem_vs_bf16_logits: float = float("nan")
    err_rows: int = 0
    errors: dict[str, float] = field(default_factory=dict)


ERR_KEYS = ("err_logp", "err_entropy", "err_loss", "err_grad_hidden", "err_grad_weight")
CSV_FIELDS = [f.name for f in fields(Row) if f.name != "errors"] + list(ERR_KEYS)


def _flat(r: Row) -> dict[str, Any]:
    d = {k: v for k, v in r.__dict__.items() if k != "errors"}
    for k in ERR_KEYS:
        d[k] = r.errors.get(k, float("nan"))
    return d


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class Sweep:
    """Runs cases; every finished row is appended to the CSV at once (a later crash or timeout loses nothing)."""

    def __init__(self, suite, out_dir, device, samples, temperature, peak, err_rows, deadline, log, warmup=2):
        self.suite, self.device, self.samples, self.temperature = suite, device, samples, temperature
        self.warmup = warmup
        self.peak, self.err_rows, self.deadline, self.log = peak, err_rows, deadline, log
        os.makedirs(out_dir, exist_ok=True)
        self.csv_path = os.path.join(out_dir, f"kernels_{suite}.csv")
        with open(self.csv_path, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=CSV_FIELDS).writeheader()
        self.rows: list[Row] = []

    def emit(self, rows: list[Row]) -> None:
        self.rows.extend(rows)
        with open(self.csv_path, "a", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            for r in rows:
                wr.writerow(_flat(r))

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def run_case(self, case: Case) -> None:
        dev = self.device
        dtype = getattr(torch, case.dtype)
        g = torch.Generator(device="cpu").manual_seed(0)
        h = torch.randn(case.T, case.H, generator=g).to(device=dev, dtype=dtype).requires_grad_()
        w = (torch.randn(case.V, case.H, generator=g) / case.H**0.5 * 2).to(device=dev, dtype=dtype).requires_grad_()
        y = torch.randint(0, case.V, (case.T,), generator=g)
        y[torch.rand(case.T, generator=g) < 0.2] = IGNORE
        y = y.to(dev)
        c1 = (torch.randn(case.T, generator=g) / case.T).to(dev)
        c2 = (torch.randn(case.T, generator=g) / case.T).to(dev)
        n_err = min(case.T, self.err_rows)
        bf16_logits_mb = case.T * case.V * 2 / 2**20

        def row(name, mode, entropy, **kw):
            return Row(self.suite, name, case.T, case.H, case.V, case.dtype, mode, entropy, self.temperature, **kw)

        for entropy in case.entropy:
            fns: dict[str, Callable] = {}
            pending: list[Row] = []
            for name in case.providers:
                try:
                    fns[name] = make_provider(name, self.temperature, entropy, dev, case.V)
                except Skip as e:
                    self.log(f"  skip {name}: {e}")
                    pending += [row(name, m, entropy, status=f"skipped: {e}") for m in case.modes]
                except Exception as e:  # a provider that cannot even be built must not stop the others
                    self.log(f"  skip {name}: failed to build ({type(e).__name__}: {str(e)[:200]})")
                    pending += [row(name, m, entropy, status=f"failed: {type(e).__name__}: {str(e)[:120]}")
                                for m in case.modes]  # fmt: skip
            errs: dict[str, dict[str, float]] = {}
            for name, fn in list(fns.items()):
                if self.out_of_time():
                    break
                try:
                    # warm-up (compilation, autotuning) of the graphs the case's modes run
                    warm = {"nograd" if m == "nograd" else "full" for m in case.modes}
                    for _ in range(self.warmup):
                        for mode in ("full", "nograd"):
                            if mode in warm and mode in PROVIDER_MODES.get(name, MODES):
                                _once(name, fn, mode, h, w, y, c1, c2)
                    errs[name] = _errors(name, fn, h[:n_err], w, y[:n_err], c1[:n_err], c2[:n_err],
                                         self.temperature, entropy)  # fmt: skip
                except Exception as e:  # one provider failing must not stop the others
                    self.log(f"  skip {name}: failed on this machine ({type(e).__name__}: {str(e)[:300]})")
                    del fns[name]
                    pending += [row(name, m, entropy, status=f"failed: {type(e).__name__}: {str(e)[:120]}")
                                for m in case.modes]  # fmt: skip
                    _free(dev)
            if pending:
                self.emit(pending)
            for mode in case.modes:
                names = [n for n in fns if mode in PROVIDER_MODES.get(n, MODES)]
                rows = [row(n, mode, entropy, status="n/a: the gradient is formed in the forward")
                        for n in fns if n not in names]  # fmt: skip
                if self.out_of_time():
                    self.emit(rows + [row(n, mode, entropy, status="skipped: time budget") for n in names])
                    continue
                times: dict[str, list[float]] = {n: [] for n in names}
                failed: dict[str, str] = {}
                for i in range(self.samples):
                    k = i % len(names) if names else 0
                    for name in names[k:] + names[:k]:  # rotate the order: no provider always runs first
                        if name in failed:
                            continue
                        try:
                            times[name].append(_once(name, fns[name], mode, h, w, y, c1, c2))
                        except Exception as e:
                            failed[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                            _free(dev)
                for name in names:
                    if name in failed or not times[name]:
                        rows.append(row(name, mode, entropy, status=failed.get(name, "failed: no sample")))
                        continue
                    try:
                        mem = _peak_mem(name, fns[name], mode, h, w, y, c1, c2)
                    except Exception as e:
                        self.log(f"  {name}: memory measurement failed ({type(e).__name__})")
                        mem = float("nan")
                        _free(dev)
                    ts = times[name]
                    p50 = _pct(ts, 0.5)
                    nhv = case.T * case.H * case.V
                    ex = EXECUTED_FLOPS[name].get(mode, float("nan"))
                    r = row(name, mode, entropy, samples=len(ts), p20_ms=_pct(ts, 0.2) * 1e3, p50_ms=p50 * 1e3,
                            p80_ms=_pct(ts, 0.8) * 1e3, tflops_p50=MODEL_FLOPS[mode] * nhv / p50 / 1e12,
                            executed_nhv=ex, tflops_executed=ex * nhv / p50 / 1e12, peak_mem_mb=mem,
                            mem_vs_bf16_logits=mem / bf16_logits_mb, err_rows=n_err, errors=errs.get(name, {}))
                    r.pct_peak = 100 * r.tflops_p50 / self.peak
                    rows.append(r)
                self.emit(rows)
                _print_mode(self.rows, case, mode, entropy, self.log)


def _free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
        err = max((v for v in r.errors.values() if v == v), default=float("nan"))
        log(f"  {r.provider:17s} p20/p50/p80 {r.p20_ms:9.2f} {r.p50_ms:9.2f} {r.p80_ms:9.2f} ms  "
            f"{r.tflops_p50:7.3f} TF/s ({r.pct_peak:5.1f}%)  exec {r.tflops_executed:7.3f} TF/s  "
            f"mem {r.peak_mem_mb:9.1f} MiB ({r.mem_vs_bf16_logits:5.3f}x bf16 logits)  max err {err:.2e}{ratio}")


def summary_table(rows: list[dict[str, Any]], peak: float) -> list[str]:
    """The short table printed last: one line per measured row."""
    out = [f"{'case':24s} {'mode':6s} {'ent':3s} {'provider':15s} {'p50 ms':>9s} {'TF/s':>7s} {'%peak':>6s} "
           f"{'exec NHV':>8s} {'exec TF/s':>9s} {'mem/bf16 logits':>15s} {'max err fp64':>12s}"]
    for r in rows:
        case = f"T{r['T']} H{r['H']} V{r['V']} {str(r['dtype']).replace('float', 'f').replace('bfloat', 'bf')}"
        ent = "yes" if str(r["entropy"]) in ("True", "true", "1") else "no"
        if r["status"] != "ok":
            out.append(f"{case:24s} {r['mode']:6s} {ent:3s} {r['provider']:15s} {str(r['status'])[:70]}")
            continue
        errs = [float(r[k]) for k in ERR_KEYS if k in r and r[k] not in ("", None) and not math.isnan(float(r[k]))]
        err = f"{max(errs):.1e}" if errs else "n/a"
        out.append(f"{case:24s} {r['mode']:6s} {ent:3s} {r['provider']:15s} {float(r['p50_ms']):9.2f} "
                   f"{float(r['tflops_p50']):7.2f} {float(r['pct_peak']):6.1f} "
                   f"{float(r['executed_nhv']):8.0f} {float(r['tflops_executed']):9.2f} "
                   f"{float(r['mem_vs_bf16_logits']):15.3f} {err:>12s}")  # fmt: skip
    out.append(f"TF/s and %peak count 2NHV forward, 6NHV forward+backward (peak {peak:.1f} TF/s on CUDA; on CPU the "
               "run's best fp32 GEMM); 'exec' counts the FLOPs each provider executes (recomputing backward: 8NHV)")
    return out


def table_from_csv(paths: list[str], peak: float) -> list[str]:
    rows: list[dict[str, Any]] = []
    for p in paths:
        if os.path.exists(p):
            with open(p, newline="") as f:
                rows += list(csv.DictReader(f))
    if not rows:
        return [f"no result rows in {', '.join(paths)}"]
    return summary_table(rows, peak)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu" if not torch.cuda.is_available() else "gpu-large")
    p.add_argument("--samples", type=int, default=30, help="interleaved samples per (case, mode, entropy, provider)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--providers", default=None, help="comma list to restrict providers")
    p.add_argument("--modes", default=None, help="comma list to restrict modes")
    p.add_argument("--tokens", default=None, help="comma list of T to restrict the suite's cases")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time samples by wall clock, or by this process's CPU seconds (with --threads 1 on a loaded "
                        "CPU: the work done, whatever share of the cores the run gets)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up runs per provider and mode before timing")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak used for %% of peak")
    p.add_argument("--err-rows", type=int, default=None,
                   help="rows of the float64 error check (default: all on CPU, 64 on CUDA)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start no new measurement after this many seconds (rows already written stay)")
    p.add_argument("--out", default="runs/bench_kernels")
    p.add_argument("--quick", action="store_true",
                   help="the validate suite with 2 samples; fail unless outputs agree with float64 ('quick: ok')")
    p.add_argument("--table-from", nargs="+", default=None, metavar="CSV",
                   help="only print the summary table of result CSVs and exit")
    args = p.parse_args(argv)
    log = lambda s: print(s, flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.table_from:
        peak = args.peak_tflops or PEAK_BF16
        for line in table_from_csv(args.table_from, peak):
            log(line)
        return []
    if args.quick:
        args.suite, args.samples = "validate", 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    cases = SUITES[args.suite]
    if args.providers:
        keep = tuple(args.providers.split(","))
        cases = [Case(**{**c.__dict__, "providers": tuple(x for x in c.providers if x in keep)}) for c in cases]
    if args.modes:
        keep = tuple(args.modes.split(","))
        cases = [Case(**{**c.__dict__, "modes": tuple(x for x in c.modes if x in keep)}) for c in cases]
    if args.tokens:
        keep_t = {int(x) for x in args.tokens.split(",")}
        cases = [c for c in cases if c.T in keep_t]
    if args.peak_tflops is not None:
        peak, peak_src = args.peak_tflops, "--peak-tflops"
    elif device.type == "cuda":
        peak, peak_src = PEAK_BF16, f"H100/H200 SXM dense bf16 ({PEAK_BF16} TF/s)"
    else:
        peak = _gemm_peak_tflops(device, torch.float32)
        peak_src = f"best fp32 GEMM measured in this run ({peak:.3f} TF/s; a CPU has no published bf16 peak)"
    err_rows = args.err_rows if args.err_rows is not None else (64 if device.type == "cuda" else 1 << 30)
    meta = {
        "suite": args.suite,
        "machine": machine_info(device),
        "flop_convention": "TF/s: fwd = nograd = 2*N*H*V, bwd = 4*N*H*V, full = 6*N*H*V for every provider; "
        "exec TF/s: the FLOPs the provider executes (executed_nhv x N*H*V); N counts all tokens incl. ignored",
        "peak_tflops": peak,
        "peak_source": peak_src,
        "memory_method": "CUDA: max_memory_allocated - allocated before; CPU: peak running sum of torch.profiler "
        "allocator events (profile_memory=True); both above the live inputs; mem_vs_bf16_logits = peak / (N*V*2 B)",
        "timing": f"{'CPU seconds of the process (process_time)' if args.clock == 'cpu' else 'wall clock'} "
        f"(perf_counter, CUDA-synchronised), torch threads {torch.get_num_threads()}, {args.samples} samples "
        f"interleaved across providers with rotating order, after {args.warmup} warm-up runs",
        "errors": f"max abs error vs float64 on the first {err_rows} rows (a sub-batch through the same provider)",
        "labels": f"20% ignored (-100), temperature {args.temperature:.2f}",
        "load_average_1min_start": os.getloadavg()[0],
    }
    log(json.dumps(meta["machine"]))
    log(f"peak: {peak_src}")
    log(f"load average (1 min) at start: {meta['load_average_1min_start']:.2f}")
    deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    sweep = Sweep(args.suite, args.out, device, args.samples, args.temperature, peak, err_rows, deadline, log,
                  args.warmup)
    for case in cases:
        try:
            sweep.run_case(case)
        except Exception as e:  # e.g. out of memory while building the inputs: record it, go on with the next case
            log(f"case T={case.T} H={case.H} V={case.V} failed: {type(e).__name__}: {str(e)[:300]}")
            sweep.emit([Row(args.suite, "all", case.T, case.H, case.V, case.dtype, "all", False, args.temperature,
                            status=f"failed: {type(e).__name__}: {str(e)[:120]}")])  # fmt: skip
            _free(device)
    meta["load_average_1min_end"] = os.getloadavg()[0]
    log(f"load average (1 min) at end: {meta['load_average_1min_end']:.2f}")
    json_path = os.path.join(args.out, f"kernels_{args.suite}.json")
    with open(json_path, "w") as f:
        json.dump({**meta, "rows": [_flat(r) for r in sweep.rows]}, f, indent=1, default=str)
    log(f"wrote {sweep.csv_path} and {json_path}")
    for line in summary_table([_flat(r) for r in sweep.rows], peak):
        log(line)
    if args.quick:
        _quick_check(sweep.rows)
        log("quick: ok")
    return sweep.rows


def _quick_check(rows: list[Row], tol: float = 1e-4) -> None:
    """``--quick``: every provider that ran agrees with float64; naive and rlblocks ran (skips elsewhere are fine)."""
    ok = [r for r in rows if r.status == "ok"]
    ran = {r.provider for r in ok}
    if not {"naive", "rlblocks"} <= ran:
        raise SystemExit(f"quick: naive and rlblocks must run, ran {sorted(ran)}")
    for r in ok:
        errs = [v for v in r.errors.values() if v == v]
        if not errs or max(errs) > tol:
            raise SystemExit(f"quick: {r.provider} {r.mode} entropy={r.entropy} disagrees with float64: {r.errors}")


if __name__ == "__main__":
    main()
