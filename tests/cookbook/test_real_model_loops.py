"""Every cookbook loop, a step or two on the real model (``--model smollm2-135m``: SmolLM2-135M-Instruct, BPE
tokenizer, ChatML template) with a reasoning-gym task (``--prompts rg:...``): grpo_sync (full fine-tuning and LoRA,
``--distill-from`` a real-model checkpoint), grpo_async (TorchEngine), ppo (critic and reference from the same base),
agent_async (the calculator tool) and agent_gateway. Tiny budgets (2 prompts × 2 samples, 8 new tokens, 256
positions, 2 held-out items); the checks are on what the run files must hold and on the exported HF directories
(read back with safetensors and transformers, independently of the loops)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlblocks.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = ROOT / "cookbook"
RG = "rg:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&seed=1&size=40&eval_size=2"
SMALL = ["--prompts", RG, "--prompts-per-step", "2", "--group-size", "2"]
DIGITS = str(ROOT / "tests" / "cookbook" / "data" / "digit_reward.py") + ":digits"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float = 600) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2",
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"
    assert "Task was destroyed but it is pending" not in p.stderr
    return p.stdout


def _torchrun(script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(_port()), str(COOKBOOK / script)]


def _summary(runs: Path, name: str) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((runs / name / "summary.json").read_text())


def _check_rg_run(rows: list[dict], summary: dict, steps: int) -> None:
    assert summary["steps"] == steps and len(rows) == steps
    assert summary["task"] == RG and summary["heldout_prompts"] == 2
    for key in ("heldout_before", "heldout_after"):
        assert set(summary[key]) >= {"pass@1", "mean@1", "last_number"}, summary[key]
    assert "heldout_last_number" in rows[-1] and rows[-1]["heldout_acc"] is not None


def test_grpo_sync_full_and_lora_with_distillation_from_the_exported_policy(smollm2_dir, tmp_path):
    runs = tmp_path / "runs"
    sync = [sys.executable, str(COOKBOOK / "grpo_sync.py"), "--runs-dir", str(runs), "--max-model-len", "256",
            "--max-new-tokens", "8", "--eval-every", "0", "--steps", "1", "--quiet", *SMALL]
    # 1) full fine-tuning, the model by name; a dense reward so that the step moves the weights; held-out by rg
    out = _run([*sync, "--model", "smollm2-135m", "--name", "full", "--reward", DIGITS, "--eval-reward", "rg",
                "--lr", "1e-4", "--save-hf", str(tmp_path / "teacher")])
    assert f"2 prompts, {RG}" in out  # the held-out set named by where it came from
    rows, summary = _summary(runs, "full")
    _check_rg_run(rows, summary, 1)
    assert summary["samples_trained"] == 4 and summary["saved_hf"] == str(tmp_path / "teacher")
    saved = load_file(tmp_path / "teacher" / "model.safetensors")
    ckpt = load_checkpoint(runs / "full" / "ckpt.pt")["model"]
    base = load_file(Path(smollm2_dir) / "model.safetensors")
    assert set(saved) == set(base)
    for name, t in saved.items():  # the export is the trained weights, bit for bit
        assert torch.equal(t, ckpt[name]), name
    assert any(not torch.equal(t, base[name]) for name, t in saved.items())  # and training changed them
    # 2) a LoRA student distilled from that checkpoint (sampled reverse KL), exported merged
    _run([*sync, "--model", smollm2_dir, "--name", "lora", "--reward", "rg", "--lora-rank", "4", "--lr", "1e-3",
          "--distill-from", str(tmp_path / "teacher"), "--save-hf", str(tmp_path / "student")])
    rows, summary = _summary(runs, "lora")
    _check_rg_run(rows, summary, 1)
    assert summary["teacher_accuracy"] is not None and "distill_kl" in "".join(rows[-1])
    merged = load_file(tmp_path / "student" / "model.safetensors")
    ckpt = load_checkpoint(runs / "lora" / "ckpt.pt")["model"]
    key = "model.layers.0.self_attn.q_proj"
    a, b = ckpt[f"{key}.lora_A.default.weight"], ckpt[f"{key}.lora_B.default.weight"]
    assert b.abs().max() > 0  # the adapter trained
    want = base[f"{key}.weight"].double() + 2.0 * (b.double() @ a.double())  # alpha / r = 2
    assert torch.allclose(merged[f"{key}.weight"].double(), want, atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # frozen base


def test_grpo_async_torch_engine_lora_adapter_export(smollm2_dir, tmp_path):
    runs = tmp_path / "runs"
    _run([*_torchrun("grpo_async.py"), "--model", "smollm2-135m", "--runs-dir", str(runs), "--name", "async",
          "--reward", "rg", "--steps", "1", "--max-model-len", "256", "--max-new-tokens", "8", "--eval-every", "0",
          "--save-every", "0", "--sync", "lora", "--lora-rank", "4", "--save-hf", str(tmp_path / "adapter"),
          "--save-lora", "adapter", "--quiet", *SMALL])
    rows, summary = _summary(runs, "async")
    _check_rg_run(rows, summary, 1)
    assert summary["samples_trained"] == 4
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["base_model_name_or_path"] == smollm2_dir
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir), str(tmp_path / "adapter"))


def test_ppo_with_a_verifier_reward(smollm2_dir, tmp_path):
    runs = tmp_path / "runs"
    _run([sys.executable, str(COOKBOOK / "ppo.py"), "--model", "smollm2-135m", "--runs-dir", str(runs), "--name",
          "ppo", "--reward", "rg", "--steps", "1", "--max-model-len", "256", "--max-new-tokens", "8",
          "--eval-every", "0", "--ppo-epochs", "1", "--mini-batches", "1", "--quiet", *SMALL])
    rows, summary = _summary(runs, "ppo")
    _check_rg_run(rows, summary, 1)
    assert summary["samples_trained"] == 4 and summary["reward_model"] is None


def test_agent_async_with_the_calculator(smollm2_dir, tmp_path):
    runs = tmp_path / "runs"
    _run([*_torchrun("agent_async.py"), "--model", "smollm2-135m", "--runs-dir", str(runs), "--name", "agent",
          "--reward", "rg", "--steps", "1", "--time-limit", "0", "--turn-tokens", "16", "--max-turns", "2",
          "--eval-every", "0", "--save-every", "0", *SMALL])
    rows, summary = _summary(runs, "agent")
    _check_rg_run(rows, summary, 1)
    # the tools reached the model: the chat template lists them in the system turn (Hermes tool calling)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runs / "agent" / "policy")
    assert "<tools>" in tok.chat_template


def test_agent_gateway(smollm2_dir, tmp_path):
    runs = tmp_path / "runs"
    _run([sys.executable, str(COOKBOOK / "agent_gateway.py"), "--model", "smollm2-135m", "--runs-dir", str(runs),
          "--name", "gw", "--reward", "rg", "--steps", "1", "--heldout", "2", *SMALL])
    rows, summary = _summary(runs, "gw")
    assert summary["steps"] == 1 if "steps" in summary else len(rows) == 1
    assert summary["heldout_prompts"] == 2 and set(summary["heldout_after"]) >= {"pass@1", "last_number"}


def test_tinker_rl_recipe_through_the_sdk(smollm2_dir, tmp_path):
    """``make demo-tinker`` in miniature: tinker-cookbook's ``rl.train`` through the SDK against the server on the
    real model (one warm-start step, one RL step of 2 × 2 samples), and its task split."""
    pytest.importorskip("tinker_cookbook")
    import tinker_rl

    split = tinker_rl.task_split(0, 40, 100, 20, 2, 2, "+")
    held = {e["question"] for e in split["heldout"]}
    assert len(split["heldout"]) == 40 and len(split["train"]) == 100 and len(split["warm"]) == 20
    assert held.isdisjoint(e["question"] for e in split["train"] + split["warm"])
    for e in split["heldout"] + split["train"]:  # reasoning-gym's num_digits=2 draws terms in 0..100
        a, op, b = e["question"].removeprefix("Calculate ").rstrip(".").split()
        assert op == "+" and 0 <= int(a) <= 100 and 0 <= int(b) <= 100 and int(e["answer"]) == int(a) + int(b)
        assert e["metadata"]["num_digits"] == 2
    runs = tmp_path / "runs"
    _run([sys.executable, str(COOKBOOK / "tinker_rl.py"), "--runs-dir", str(runs), "--name", "tk", "--steps", "1",
          "--warm-steps", "1", "--warm-batch", "4", "--heldout", "4", "--groups-per-batch", "2", "--group-size", "2",
          "--max-tokens", "8", "--threads", "1"])
    summary = json.loads((runs / "tk" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["heldout_items"] == 4 and "operators '+'" in summary["task"]
    for stage in ("base", "before", "after"):
        assert 0.0 <= summary[stage]["accuracy"] <= summary[stage]["tagged"] + 1e-9 <= 1.0 + 1e-9
    rows = [json.loads(x) for x in (runs / "tk" / "cookbook" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "env/all/total_episodes" in r)
    assert step["env/all/total_episodes"] == 4 and step["tokens/trained"] > 0
    assert step["loss_fn_mapped/stable_reinforce->ppo:max"] == 0.0  # ppo was asked for by name, not mapped


@pytest.mark.parametrize(("flags", "message"), [
    (["--operators", "x"], "--operators: expected a non-empty string of '+', '-', '*', '/', got 'x'"),
    (["--min-digits", "3", "--max-digits", "2"], "--max-digits: expected >= --min-digits (3), got 2"),
])
def test_tinker_rl_flags_name_the_bad_value(flags, message, capsys):
    pytest.importorskip("tinker_cookbook")
    import tinker_rl

    with pytest.raises(SystemExit) as e:
        tinker_rl.main(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
