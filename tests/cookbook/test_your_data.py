"""Every loop on a dataset of its own: the shipped GSM8K-style JSONL (``--prompt-field question``), ``--reward math``
and a ``module:function`` reward, a tiny random Llama with a byte-level BPE tokenizer and a Qwen-style chat
template. Two steps each; the run files say what was trained and evaluated, and the custom reward's scores in the
per-prompt evaluation files are recomputed here from the responses they hold.

The model is random: it does not solve GSM8K (its math rewards are 0 or nearly so). What is checked is the
plumbing: the prompts and references the loops read, that the named rewards scored every sample, and the files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests" / "cookbook" / "data" / "gsm8k_style.jsonl"
ROWS = [json.loads(line) for line in GSM8K.read_text().splitlines()]
ANSWER = {r["question"]: r["answer"] for r in ROWS}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

REWARD_PY = '''
import json
import os


def by_length(sample):
    """1 for a response whose length is a multiple of 3; every call is written to $REWARD_LOG."""
    score = float(len(sample.response) % 3 == 0)
    log = os.environ.get("REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"response": sample.response, "reference": sample.reference, "score": score}) + "\\n")
    return score
'''


def by_length(text: str) -> float:
    return float(len(text) % 3 == 0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def reward_file(tmp_path) -> str:
    (tmp_path / "my_reward.py").write_text(REWARD_PY)
    return f"{tmp_path / 'my_reward.py'}:by_length"


def _run(cmd: list[str], tmp_path: Path, timeout: float = 420) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning", REWARD_LOG=str(tmp_path / "reward_log.jsonl"))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"


def _data_flags(model: str, runs: Path, name: str, *extra: str) -> list[str]:
    return ["--model", model, "--runs-dir", str(runs), "--name", name, "--prompts", str(GSM8K),
            "--prompt-field", "question", "--steps", "2", "--eval-every", "1", "--quiet", *extra]


def _check(runs: Path, name: str, *, eval_steps: list[int], custom_eval: bool) -> dict:
    """The common checks of a run; returns its summary."""
    from plumbing import COMMON_KEYS

    d = runs / name
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((d / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(COMMON_KEYS) <= set(r), set(COMMON_KEYS) - set(r)
        assert r["reward_failures"] == 0 and 0.0 <= r["reward"] <= 1.0
    assert summary["task"] == str(GSM8K) and summary["heldout_prompts"] == 4  # a tenth of the 40 rows
    assert sorted(int(p.stem.split("_")[1]) for p in (d / "eval").glob("step_*.jsonl")) == eval_steps
    for step in eval_steps:
        lines = [json.loads(x) for x in (d / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        prompts, totals = lines[:-1], lines[-1]
        assert len(prompts) == 4 and totals["totals"] and totals["failures"] == 0
        for p in prompts:
            assert p["reference"] == ANSWER[p["prompt"]]  # --answer-field answer of the same row
            if custom_eval:  # the module:function reward scored each held-out response
                assert p["scores"] == [by_length(t) for t in p["responses"]]
        assert totals["mean@1"] == pytest.approx(sum(p["mean"] for p in prompts) / 4)
    return summary


@pytest.mark.slow
def test_grpo_sync_on_the_jsonl(bpe_chat_dir, tmp_path, reward_file):
    _run([sys.executable, "cookbook/grpo_sync.py", *_data_flags(
        bpe_chat_dir, tmp_path, "s", "--reward", "math", "--eval-reward", reward_file, "--prompts-per-step", "4",
        "--group-size", "4", "--max-new-tokens", "16", "--log-to", "tensorboard")], tmp_path)
    summary = _check(tmp_path, "s", eval_steps=[0, 1, 2], custom_eval=True)
    pool = summary["reward"]["pool"]
    assert summary["reward"]["reward"] == "math" and pool["ok"] == pool["submitted"] == 2 * 16
    log = [json.loads(x) for x in (tmp_path / "reward_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 * 4  # the custom reward scored the held-out answers only: 3 evaluations × 4 prompts
    assert (tmp_path / "s" / "tensorboard").is_dir()


@pytest.mark.slow
def test_grpo_async_on_the_jsonl_with_a_module_function_reward(bpe_chat_dir, tmp_path, reward_file):
    # the custom reward trains: it runs on the rollout rank, in worker processes, which import it by name
    _run([*TORCHRUN, "--master_port", str(_port()), "cookbook/grpo_async.py", *_data_flags(
        bpe_chat_dir, tmp_path, "a", "--reward", reward_file, "--eval-reward", "math", "--prompts-per-step", "4",
        "--group-size", "4", "--max-new-tokens", "16")], tmp_path)
    summary = _check(tmp_path, "a", eval_steps=[0, 1, 2], custom_eval=False)
    log = [json.loads(x) for x in (tmp_path / "reward_log.jsonl").read_text().splitlines()]
    assert len(log) == summary["samples_generated"] >= 2 * 16  # every generated sample scored, once
    assert all(r["score"] == by_length(r["response"]) for r in log)
    held = {json.loads(x)["reference"] for x in (tmp_path / "a" / "eval" / "step_000000.jsonl").read_text()
            .splitlines()[:-1]}
    assert {r["reference"] for r in log} <= set(ANSWER.values()) - held  # training prompts only, never held out
    assert summary["eval_reward"]["reward"] == "math" and summary["eval_reward"]["pool"]["ok"] == 3 * 4


@pytest.mark.slow
def test_ppo_on_the_jsonl(bpe_chat_dir, tmp_path, reward_file):
    _run([sys.executable, "cookbook/ppo.py", *_data_flags(
        bpe_chat_dir, tmp_path, "p", "--reward", "math", "--eval-reward", reward_file, "--prompts-per-step", "4",
        "--group-size", "2", "--max-new-tokens", "16")], tmp_path)
    summary = _check(tmp_path, "p", eval_steps=[0, 1, 2], custom_eval=True)
    assert summary["reward_failures"] == 0 and summary["samples_trained"] == 2 * 8


@pytest.mark.slow
def test_agent_async_on_the_jsonl(bpe_chat_dir, tmp_path, reward_file):
    _run([*TORCHRUN, "--master_port", str(_port()), "cookbook/agent_async.py", *_data_flags(
        bpe_chat_dir, tmp_path, "g", "--reward", "math", "--eval-reward", reward_file, "--prompts-per-step", "2",
        "--group-size", "2", "--time-limit", "0", "--max-turns", "2", "--turn-tokens", "16",
        "--tools", "rlblocks.rollout.agents:calculator_tool")], tmp_path)
    summary = _check(tmp_path, "g", eval_steps=[0, 1, 2], custom_eval=True)
    assert summary["samples_trained"] == 2 * 4 and summary["rollout"].get("reward_failures", 0) == 0
