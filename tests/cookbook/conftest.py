"""Cookbook fixtures: the demo's own model (the toy Llama with its 64 positions and char tokenizer), briefly
warm-started so that some sampled answers are right and GRPO advantages are not all zero."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    """``toy.warm_start`` with the demo's settings but at most 300 SFT steps (~10 s): the same architecture,
    tokenizer and positions as ``make demo``'s model, knowing the answer format and a few sums."""
    import torch

    sys.path.insert(0, str(COOKBOOK))
    import toy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends with the other processes on a busy box
    try:
        return toy.warm_start(tmp_path_factory.mktemp("demo_model"), toy.WarmStart(max_steps=300),
                              log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
