"""Benchmarks' ``--quick`` modes: each still runs and its own checks of agreement pass (equal generations for a seed,
finite log-probs, applied weights equal to the sent ones, prefix-shared log-probs and gradients equal to one row per
sample, a cost model the simulator runs); never their speed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

QUICK = {
    "kernels/prefix_share.py": "quick: ok",
    "kernels/bench.py": "quick: ok",
    "rollout/bench_engines.py": "quick: ok",
    "sync/bench_delta.py": "quick: ok",
    "tinker/bench_service.py": "quick: ok",
    "sim/calibrate.py": "quick: ok",  # measure_cpu_costs.py --quick, two 6-step loops, the prediction
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_mode_runs_and_agrees(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert QUICK[script] in out.stdout, out.stdout[-3000:]


@pytest.mark.slow
def test_bench_delta_runs_on_a_model_and_one_real_optimizer_step(tiny_hf_dir):
    """bench_delta.py's model rows (--model): the checkpoint's tensors at a given density, and the weights before
    and after one real AdamW step (a row at whatever fraction that step changed); every applied model equals the
    sent one (the benchmark asserts it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sync" / "bench_delta.py"), "--quick", "--model",
                          tiny_hf_dir, "--model-densities", "0.03", "--model-step-lr", "1e-3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    step = [ln for ln in out.stdout.splitlines() if ln.startswith("model one AdamW step")]
    assert step and "0.0000%" not in step[0], out.stdout[-3000:]  # the step changed some bf16 values
    assert any(ln.startswith("model step") for ln in out.stdout.splitlines()) and "quick: ok" in out.stdout
