"""Vocab-parallel linear_token_logprobs: 2 gloo processes (torch.multiprocessing spawn) vs the unsharded result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlblocks.kernels._common import triton_available


def test_two_rank_gloo_matches_unsharded(tmp_path):
    backends = "torch,triton" if triton_available() else "torch"
    worker = Path(__file__).with_name("vocab_parallel_worker.py")
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    res = subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "pg_init"), backends],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "vocab-parallel OK" in res.stdout
