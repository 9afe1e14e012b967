"""``--cp``: the DP × CP trainer groups, one ``grpo_step`` under ``--cp 2``'s set-up against one unsharded process,
and a short ``grpo_sync.py --cp 2`` run under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from plumbing import trainer_groups

from rlblocks.errors import ArgumentError
from tests.cookbook.test_loops import ROOT, TORCHRUN, B, K, _check_common, _check_generated, _port, _read, _run

pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


def test_cp_must_divide_the_trainer_ranks():
    with pytest.raises(ArgumentError, match="--cp: expected a divisor of the trainer rank count 3, got 2"):
        trainer_groups(range(3), 2, 0)
    g = trainer_groups(range(4), 1, 2, train_group="train")  # --cp 1: the trainer group is the DP group
    assert (g.dp, g.cp, g.dp_rank, g.dp_size, g.cp_rank, g.cp_size) == ("train", None, 2, 4, 0, 1)


def test_grpo_step_with_cp2_matches_one_process(tmp_path):
    worker = Path(__file__).with_name("cp_step_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, str(worker), str(tmp_path / "pg_init")], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "cp grpo_step OK" in res.stdout


def test_sync_loop_cp2_under_torchrun(demo_model_dir, tmp_path):
    # 2 ranks = 1 DP × 2 CP: each rank generates half of the B groups, both train on all of them (2 epochs × 2
    # mini-batches, the same splits on both), each forwarding half of every sequence's positions
    cmd = [*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_port()),
           str(ROOT / "cookbook" / "grpo_sync.py"), "--model", demo_model_dir, "--runs-dir", str(tmp_path),
           "--name", "cp", "--prompts-per-step", str(B), "--group-size", str(K), "--eval-every", "1", "--quiet",
           "--steps", "3", "--cp", "2", "--ppo-epochs", "2", "--mini-batches", "2", "--lr", "3e-3"]
    _run(cmd)
    rows, summary = _read(tmp_path, "cp")
    _check_common(rows, summary, 3, 0)
    _check_generated(rows, summary)  # a CP group's samples are counted once, not once per rank
    assert all(r["ppo_updates"] == 4 for r in rows)
    assert max(r["grad_norm"] for r in rows) > 0
