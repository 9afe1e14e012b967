"""rlblocks.reward stays light: no torch, transformers or math-verify on import, nor in a fresh worker process."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import reward_helpers

from rlblocks.reward import ProcessWorkers

HEAVY = ["torch", "transformers", "math_verify", "sympy", "numpy"]


def test_import_is_light():
    code = f"import sys, rlblocks.reward; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_reward_model_loads_on_first_use():
    code = "import sys, rlblocks.reward as r; m = r.RewardModel; print(m.__name__, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["RewardModel", "True"]


def test_a_worker_process_starts_without_heavy_imports():
    with ProcessWorkers(1) as w:
        assert w.run(reward_helpers.loaded, HEAVY, timeout=60) == []
