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


@pytest.mark.slow
def test_bench_engines_compare_measures_each_engine_in_its_own_process(tiny_hf_dir):
    """``--compare`` runs ``--measure KIND`` in a fresh process per engine and rep and tabulates what they print:
    one row per batch size, one line per rep, every rate positive."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rollout" / "bench_engines.py"), "--compare",
                          "--engines", "torch", "hf", "--model", tiny_hf_dir, "--batches", "2", "3", "--reps", "1",
                          "--prompt-len", "5", "--new-tokens", "4"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "each in a fresh process per rep" in lines[0]
    rows = [ln.split("|") for ln in lines if ln.startswith("| 2 |") or ln.startswith("| 3 |")]
    assert len(rows) == 2, out.stdout
    for row in rows:
        torch_tps, hf_tps, vs_vllm, vs_hf = (c.strip() for c in row[2:6])
        assert float(torch_tps) > 0 and float(hf_tps) > 0 and vs_vllm == "-" and float(vs_hf) > 0
    reps = [ln for ln in lines if ln.strip().startswith("rep ")]
    assert len(reps) == 2 and all("torch " in r and "hf " in r for r in reps), out.stdout


@pytest.mark.parametrize("script", ["rollout/bench_engines.py", "sync/bench_delta.py"])
def test_named_model_reaches_the_cookbook_model_helper(script):
    """``--model NAME`` goes through ``cookbook/plumbing/models.py`` (whose package imports the cookbook's sibling
    modules by name): an unknown name is refused by that helper, naming the known models, rather than the script
    reporting the helper missing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--model", "no-such-model"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "no named-model helper" not in out.stdout + out.stderr, out.stderr[-3000:]
    assert "one of smollm2-135m, got 'no-such-model'" in out.stderr, out.stderr[-3000:]
