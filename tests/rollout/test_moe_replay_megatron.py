"""Routing replay (R3) on megatron-core MoE models (``TopKRouter``), checked against megatron-core itself.

The checks run in a child process (tests/rollout/_moe_replay_megatron_worker.py): megatron-core needs
``torch.distributed`` and the test-only CPU patches, which change process-wide state. What it checks:

- ``exact``: replaying the routing megatron chose is bit-exact; forced routing gives the same logits and router
  gradients as megatron-core's own ``RouterReplay`` (``moe_enable_routing_replay``), for softmax after and before
  top-k, sigmoid with expert bias and scaling, and group-limited top-k; a recorder inside a replay sees the forced
  experts; megatron's own replay slot is restored afterwards.
- ``errors``: a token-count mismatch and nested replays raise ArgumentError.
- ``perturbation``: a small weight update flips routes; replay brings the log-probs back (figures printed).
- ``hf_engine_megatron_trainer``: an HF Mixtral TorchEngine (bf16) samples and records, a megatron-core trainer
  (fp32, the same weights converted) scores the samples, with and without the engine's routing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_moe_replay_megatron_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_routing_replay_on_megatron_core(capsys):
    for pkg in ("megatron.core", "transformers"):
        if importlib.util.find_spec(pkg.split(".")[0]) is None:
            pytest.skip(f"{pkg} is not installed")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, env=env, timeout=600,
                          cwd=str(WORKER.parent))
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"megatron routing worker failed (rc {proc.returncode}):\n{out[-8000:]}", pytrace=False)
    with capsys.disabled():
        print("\n" + "\n".join(line for line in proc.stdout.splitlines() if line.strip()))
    for needle in ("group-limited top-k: own routing bitwise", "[R3 megatron weight_update]",
                   "[R3 HF Mixtral bf16 engine -> megatron fp32 trainer]"):
        assert needle in proc.stdout
