"""Fixtures of the rollout tests: tiny HF models loaded from the shared ``tiny_hf_dir`` checkpoint; the SGLang
contract pieces (``sglang_0_5_23``, vendored SGLang types) and the stricter fake server (``fake_sglang``) made
importable by name (pytest runs with ``--import-mode=importlib``, so this folder is not on ``sys.path``)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def _register(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    is_pkg = path.is_dir()
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py" if is_pkg else path, submodule_search_locations=[str(path)] if is_pkg else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_register("sglang_0_5_23", _HERE / "sglang_0_5_23")
_register("fake_sglang", _HERE / "fake_sglang.py")


def _load_tiny_model(path: str, sharpen: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture
def make_tiny_model(tiny_hf_dir):
    """Factory of fresh tiny Llamas in fp32 eval mode (tests may update their weights). ``sharpen`` scales
    ``lm_head`` so that next-token distributions are peaked: a random tiny model is nearly uniform, which makes
    top-k/top-p uninformative and greedy decoding a matter of near-ties."""
    return lambda sharpen=20.0: _load_tiny_model(tiny_hf_dir, sharpen)


@pytest.fixture
def tiny_model(make_tiny_model):
    """A fresh sharpened tiny Llama."""
    return make_tiny_model()
