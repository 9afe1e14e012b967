"""The engine flags of the loops that take ``--engine`` (``plumbing.EngineFlags``): the engine computes in the
trainer's dtype unless ``--engine-dtype`` says otherwise, a different dtype (or block-FP8 rollout weights) turns
``--correction auto`` into ``tis``, ``--kv-cache-mb`` sizes vLLM's KV cache, and ``make_engine`` hands both to the
engine."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from plumbing import make_engine, parse_flags, resolve_engine_dtype
from plumbing.engines import TRAINER_DTYPE, kv_cache_bytes

LOOPS = ["grpo_sync", "grpo_async"]


def parse(loop: str, argv: list[str]):
    mod = importlib.import_module(loop)
    return parse_flags(mod.Config, argv, check=mod.check_flags)


@pytest.mark.parametrize("loop", LOOPS)
def test_engine_follows_the_trainer_and_correction_stays_off(loop, capsys):
    cfg = parse(loop, [])
    assert TRAINER_DTYPE == torch.float32  # the loops' policies (plumbing's load_hf)
    assert resolve_engine_dtype(cfg) == torch.float32 and cfg.correction == "none" and cfg.kv_cache_mb == 0
    assert parse(loop, ["--engine-dtype", "float32"]).correction == "none"
    assert "--correction auto" not in capsys.readouterr().err


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_another_engine_dtype_turns_the_correction_on(loop, dtype, capsys):
    cfg = parse(loop, ["--engine-dtype", dtype])
    assert resolve_engine_dtype(cfg) == getattr(torch, dtype) and cfg.correction == "tis"
    assert f"--correction auto: tis (the engine samples with --engine-dtype {dtype}" in capsys.readouterr().err
    # an explicit choice is kept, "none" included (off on purpose)
    for choice in ("none", "mis", "tis"):
        assert parse(loop, ["--engine-dtype", dtype, "--correction", choice]).correction == choice
    assert parse(loop, ["--engine-dtype", dtype, "--correction-cap", "3"]).correction_cap == 3.0


def test_fp8_rollout_weights_turn_the_correction_on():
    cfg = parse("grpo_async", ["--rollout-dtype", "fp8"])
    assert cfg.correction == "tis" and resolve_engine_dtype(cfg) is None  # the FP8 kernels pick the activations


@pytest.mark.parametrize(
    ("loop", "argv", "flag"),
    [
        ("grpo_sync", ["--kv-cache-mb", "-1", "--engine", "vllm"], "--kv-cache-mb"),
        ("grpo_async", ["--kv-cache-mb", "256"], "--kv-cache-mb"),  # --engine torch: no vLLM cache to size
        ("grpo_sync", ["--engine-dtype", "bfloat16", "--distill-from", "t"], "--engine-dtype"),  # no correction there
        ("grpo_sync", ["--engine-dtype", "int8"], "--engine-dtype"),
    ],
)
def test_bad_engine_flags_are_refused(loop, argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse(loop, argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def _config_dir(tmp_path, **cfg) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    return str(tmp_path)


def test_kv_cache_size(tmp_path):
    # SmolLM2-135M's attention: 30 layers, 3 KV heads of 64 → 2·30·3·64 = 11,520 elements per token
    smol = _config_dir(tmp_path, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       hidden_size=576, head_dim=64, max_position_embeddings=8192)
    assert kv_cache_bytes(smol, torch.float32, 256) == 11_520 * 4 * 256 * 64  # 720 MiB: 64 sequences of 256
    assert kv_cache_bytes(smol, torch.bfloat16, 256) == 11_520 * 2 * 256 * 64
    assert kv_cache_bytes(smol, torch.float32, 16) == 64 << 20  # the floor
    assert kv_cache_bytes(smol, torch.float32, 8192) <= 4096 << 20  # the ceiling (and a quarter of the memory)
    assert kv_cache_bytes(smol, torch.float32, 256, kv_cache_mb=300) == 300 << 20  # the flag wins


def test_make_engine_passes_dtype_and_cache(tiny_hf_dir, monkeypatch):
    from rlblocks.rollout import VLLMEngine

    seen = {}
    monkeypatch.setattr(VLLMEngine, "from_pretrained", classmethod(lambda cls, path, **kw: seen.update(kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    make_engine("vllm", tiny_hf_dir, torch.device("cpu"), max_model_len=128, dtype=torch.float32, kv_cache_mb=96)
    assert (seen["dtype"], seen["kv_cache_memory_bytes"], seen["enforce_eager"]) == ("float32", 96 << 20, True)
    seen.clear()
    make_engine("vllm", tiny_hf_dir, torch.device("cpu"), max_model_len=128, dtype=None)
    assert "dtype" not in seen and seen["kv_cache_memory_bytes"] == 64 << 20  # vLLM's own dtype; the cache floor
    engine = make_engine("torch", tiny_hf_dir, torch.device("cpu"), max_model_len=64, dtype=torch.bfloat16)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
