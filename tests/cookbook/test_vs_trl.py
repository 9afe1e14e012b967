"""``benchmarks/cookbook/vs_trl.py --quick``: both sides (rlblocks' grpo_sync.py, TRL's GRPOTrainer) run one step of
the same job on the real model and report the same figures. Structure only, never speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("trl")


@pytest.mark.slow
def test_quick_run_reports_both_sides(smollm2_dir, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "benchmarks/cookbook/vs_trl.py", "--quick", "--model", smollm2_dir,
                        "--engine", "torch", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "vs_trl.json").read_text())
    assert report["quick"] is True
    assert report["job"]["steps"] == 1 and report["job"]["prompts_per_step"] == 2
    assert set(report["results"]) == {"rlblocks", "trl"}
    sys.path.insert(0, str(ROOT / "benchmarks/cookbook"))
    from vs_trl import FIELDS

    for side, r in report["results"].items():
        assert set(FIELDS) <= set(r), (side, sorted(r))
        assert r["steps"] == 1, (side, r)
        assert r["heldout_n"] == 2, (side, r)
        assert 0.0 <= r["heldout_acc"] <= 1.0 and 0.0 <= r["mean_reward"] <= 1.0, (side, r)
        assert 0 < r["generate_seconds"] <= r["step_seconds"], (side, r)
        assert r["peak_rss_mib"] > 100, (side, r)  # the model alone is ~540 MB in fp32
    assert report["speedup_steps_per_second"] > 0
    md = (tmp_path / "vs_trl.md").read_text()
    assert "| rlblocks |" in md and "| trl |" in md and "load average" in md
