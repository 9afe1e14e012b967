"""pytest-benchmark suite of the fused linear log-prob op (CPU-sized; on CUDA it uses the same shapes in bf16).

Run: ``.venv/bin/pytest benchmarks/kernels -q --benchmark-group-by=param:case,param:mode,param:entropy``.
Each benchmark is one (provider, mode, entropy) at a small shape; ``extra_info`` records the nominal FLOPs
(``MODEL_FLOPS``: 2·T·H·V forward, 4·T·H·V backward, 6·T·H·V both) and the max error against float64 (of logp,
or of the loss for the fused providers). The sweep with p20/p50/p80, TF/s, memory and CSV/JSON output is
``python benchmarks/kernels/bench.py``.
"""

from __future__ import annotations

import pytest
import torch
from bench import IGNORE, MODEL_FLOPS, PROVIDER_MODES, Skip, _loss, _naive, make_provider

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
CASES = {"small": (256, 128, 8192), "vocab32k": (512, 64, 32000)}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    t, h, v = CASES[request.param]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g).to(DEVICE, DTYPE).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 2).to(DEVICE, DTYPE).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    labels[torch.rand(t, generator=g) < 0.2] = IGNORE
    c = torch.randn(t, generator=g).to(DEVICE) / t
    return request.param, hidden, weight, labels.to(DEVICE), c


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("mode", ["fwd", "full", "nograd", "bwd"])
@pytest.mark.parametrize("provider", ["naive", "compiled_chunked", "liger", "liger_sum", "rlblocks",
                                      "rlblocks_fused"])
def test_linear_logprobs(benchmark, case, provider, mode, entropy):
    name, h, w, y, c = case
    t, hd, v = CASES[name]
    if mode not in PROVIDER_MODES.get(provider, (mode,)):
        pytest.skip(f"{provider}: the gradient is formed in the forward; mode {mode} does not apply")
    try:
        fn = make_provider(provider, 0.7, entropy, DEVICE, v)
    except Skip as e:
        pytest.skip(str(e))

    def fwd():
        return fn(h, w, y, c, c)

    def full():
        _loss(provider, *fn(h, w, y, c, c), c, c).backward()
        _sync()

    def nograd():
        with torch.no_grad():
            fn(h, w, y, c, c)
        _sync()

    def bwd_setup():
        h.grad = w.grad = None
        return (_loss(provider, *fn(h, w, y, c, c), c, c),), {}

    def bwd(loss):
        loss.backward()
        _sync()

    full()  # warm-up (compilation)
    if mode == "bwd":
        benchmark.pedantic(bwd, setup=bwd_setup, rounds=10, iterations=1)
    else:
        run = {"fwd": fwd, "full": full, "nograd": nograd}[mode]
        benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)
    with torch.no_grad():
        ref_lp = _naive(h.double(), w.double(), y, 0.7, False)[0]
        if provider in ("liger_sum", "rlblocks_fused"):  # their output is the loss
            cc = -torch.ones_like(c) if provider == "liger_sum" else c
            got = fn(h, w, y, cc, torch.zeros_like(c))[0].reshape(1)
            ref = (ref_lp * cc.double()).sum().reshape(1)
        else:
            got, ref = fn(h, w, y, c, c)[0], ref_lp
    err = float((got.double() - ref).abs().max())
    benchmark.extra_info.update(
        {"T": t, "H": hd, "V": v, "flops": MODEL_FLOPS[mode] * t * hd * v, "max_err_vs_fp64": err}
    )
    assert err < (1e-4 if DTYPE == torch.float32 else 5e-2)
