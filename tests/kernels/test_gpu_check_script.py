"""benchmarks/kernels/gpu_check.sh in its CPU --validate mode: every step of the GPU check runs (toy sizes, torch
path), so a broken script is caught before device time is spent on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels" / "gpu_check.sh"


def test_script_is_valid_bash():
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_validate_mode_runs_every_step(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, SAMPLES="2")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(["bash", str(SCRIPT), "--validate"], env=env, capture_output=True, text=True, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for step in ("3/8 large case: ok", "4/8 tests: ok", "4b/8 context parallel: ok", "6/8 prefix share: ok",
                 "7/8 more cases: ok", "all steps ok"):
        assert step in summary, summary
    assert "5/8 vllm fp8: ok" in summary or "5/8 vllm fp8: skipped (no vllm" in summary, summary
    assert "liger" in summary  # installed from .whl/, or a line saying why the liger rows are skipped
    table = summary[summary.index("== 8/8 table") :].splitlines()
    header = next(ln for ln in table if ln.startswith("case"))
    for col in ("TF/s", "%peak", "exec TF/s", "mem/bf16 logits", "max err fp64"):
        assert col in header
    measured = [ln for ln in table if " rlblocks " in ln and "failed" not in ln and "skipped" not in ln]
    modes = {ln.split()[4] for ln in measured}
    assert modes == {"fwd", "full", "bwd", "nograd"}, table
    # every measured row has a finite error against float64, below the fp32 contract
    for ln in measured:
        assert float(ln.split()[-1]) < 1e-4, ln
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert len(files) <= 11, files  # the eleven files the script's header lists
    prefix = summary[summary.index("== 6/8 prefix share") :]
    assert all(f"\n{way} " in prefix for way in ("padded", "packed", "shared")), prefix
    cp = summary[summary.index("== 4b/8 context parallel") :]
    assert " tokens " in cp and "x CP1" in cp  # the context-parallel table, CP = 1 and 2 side by side
