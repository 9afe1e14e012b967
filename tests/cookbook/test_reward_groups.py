"""A reward call whose retries ran out fails its whole group in every loop: the group is not trained (never scored 0,
never trained with a baseline over the rest of it) and is counted, under ``samples_failed_reward`` (metrics and
summary) and ``groups_failed_reward`` (summary), in ``grpo_sync.py``, ``grpo_async.py``, ``ppo.py``,
``agent_async.py`` and ``agent_gateway.py``.

The failure is deterministic: a ``file.py:function`` reward that raises for the references whose character codes
sum to a multiple of 3 (about a third of the prompts; every sample of such a prompt's group fails) and scores 1.0
otherwise, each call logged to ``$REWARD_LOG``. A trained step's mean reward is then exactly 1.0 unless a failed
sample was trained (as its 0.0 placeholder), and the calls that did not raise are the samples trained (each scored
once). The held-out evaluation uses ``verifier``, so the log holds the training calls only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests" / "cookbook" / "data" / "gsm8k_style.jsonl"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1"]
B, K = 4, 4  # prompt groups per step, samples per group

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

FLAKY_PY = '''
import json
import os


def fails(reference) -> bool:
    return sum(map(ord, str(reference))) % 3 == 0


def flaky(sample):
    """1.0, except for a reference whose character codes sum to a multiple of 3: that call raises."""
    bad = fails(sample.reference)
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"reference": str(sample.reference), "raised": bad}) + "\\n")
    if bad:
        raise RuntimeError(f"no reward for {sample.reference!r}")
    return 1.0
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def flaky(tmp_path) -> str:
    (tmp_path / "flaky_reward.py").write_text(FLAKY_PY)
    return f"{tmp_path / 'flaky_reward.py'}:flaky"


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning", REWARD_LOG=str(tmp_path / "reward_log.jsonl"))
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(cmd: list[str], tmp_path: Path, timeout: float = 420) -> None:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"


def _read(tmp_path: Path, name: str) -> tuple[list[dict], dict, list[dict]]:
    d = tmp_path / name
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    log = [json.loads(x) for x in (tmp_path / "reward_log.jsonl").read_text().splitlines()]
    return rows, json.loads((d / "summary.json").read_text()), log


def _check_failed_counted(rows: list[dict], summary: dict, group_size: int) -> None:
    """Some groups failed and some trained; the failed ones are counted whole, the same in the rows and summary."""
    failed = summary["samples_failed_reward"]
    assert failed > 0 and summary["samples_trained"] > 0, summary
    assert failed == summary["groups_failed_reward"] * group_size  # whole groups, never part of one
    assert summary["reward_failures"] >= failed  # every sample of a failed group failed (a retry may count too)
    assert [r["samples_failed_reward"] for r in rows] == sorted(r["samples_failed_reward"] for r in rows)
    assert rows[-1]["samples_failed_reward"] <= failed


def _check_trained_rewards(rows: list[dict]) -> None:
    """Every step that trained a sample trained rewards of 1.0 only: no failed sample's placeholder 0.0."""
    before = 0
    for r in rows:
        if r["samples_trained"] > before:
            assert r["reward"] == 1.0, r
        before = r["samples_trained"]


# ------------------------------------------------------------------------------------------------ the batch
class BigramPolicy(nn.Module):
    """``logp[b, t] = log_softmax(W[input_ids[b, t]])[labels[b, t]]`` (0 on ignored labels), in float64."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(vocab, vocab, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask, labels):
        lp = self.w[input_ids[:, :-1]].log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return torch.where(labels != -100, lp, 0.0)


def _group(uid: str, seed: int, rewards: list[float], failed: bool = False) -> dict:
    from plumbing import group_record

    from rlblocks.rollout import Generation

    g = torch.Generator().manual_seed(seed)
    gens = []
    for k, _ in enumerate(rewards):
        n = int(torch.randint(1, 5, (1,), generator=g))
        out = torch.randint(1, 8, (n,), generator=g).tolist()
        gens.append(Generation(f"{uid}/{k}", [1, 2], out, (-torch.rand(n, generator=g)).tolist(), [0] * n, "stop"))
    rec = group_record(uid, uid, [1, 2], gens, rewards, 0)
    if failed:
        rec["reward_failed"] = True
    return rec


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_failed_group_in_the_batch_trains_as_the_batch_without_it(agg):
    from grpo import grpo_step
    from plumbing import batch_tensors

    cfg = SimpleNamespace(loss="ppo", eps_low=None, eps_high=None, rollout_weight_cap=None, correction="none",
                          correction_cap=None, ppo_epochs=1, mini_batches=1, agg=agg, kl_coef=0.0, grad_clip=1e9,
                          seed=3)
    ok_a, ok_b = _group("a", 1, [1.0, 0.0, 0.0, 1.0]), _group("c", 3, [0.0, 1.0, 1.0, 1.0])
    # the failed group's rewards vary, so training it (failed or not) would change the update
    bad = _group("b", 2, [1.0, 0.0, 1.0, 0.0], failed=True)

    def step(groups: list[dict]) -> tuple[torch.Tensor, dict]:
        policy = BigramPolicy(8)
        bt = batch_tensors(groups, 0, torch.device("cpu"))
        grpo_step(cfg, policy, torch.optim.SGD(policy.parameters(), lr=1.0), bt)
        return policy.w.detach().clone(), bt

    w_masked, bt = step([ok_a, bad, ok_b])
    w_without, _ = step([ok_a, ok_b])
    assert bt["trained"].tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert not bt["mask"][4:8].any() and bt["mask"][:4].any() and bt["mask"][8:].any()
    assert torch.allclose(w_masked, w_without, rtol=0, atol=1e-12)
    w_trained, _ = step([ok_a, {**bad, "reward_failed": False}, ok_b])  # the same group, trained: another update
    assert not torch.allclose(w_trained, w_without, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the loops
@pytest.mark.slow
def test_grpo_sync_fails_a_group_whole(tiny_hf_dir, tmp_path, flaky):
    _run([sys.executable, "cookbook/grpo_sync.py", "--model", tiny_hf_dir, "--runs-dir", str(tmp_path), "--name",
          "s", "--steps", "3", "--prompts-per-step", str(B), "--group-size", str(K), "--reward", flaky,
          "--eval-reward", "verifier", "--eval-every", "0", "--quiet"], tmp_path)
    rows, summary, log = _read(tmp_path, "s")
    _check_failed_counted(rows, summary, K)
    _check_trained_rewards(rows)
    assert summary["samples_generated"] == 3 * B * K
    assert summary["samples_trained"] + summary["samples_failed_reward"] == summary["samples_generated"]
    assert summary["samples_trained"] == sum(not c["raised"] for c in log)  # each trained sample scored once
    assert rows[-1]["samples_failed_reward"] == summary["samples_failed_reward"]


@pytest.mark.slow
def test_grpo_async_fails_a_group_whole_and_frees_its_slot(tiny_hf_dir, tmp_path, flaky):
    # η = 0 leaves B slots: a failed group that held its slot would stall the run after B failures
    steps = 3
    _run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_port()), "cookbook/grpo_async.py", "--model",
          tiny_hf_dir, "--runs-dir", str(tmp_path), "--name", "a", "--steps", str(steps), "--prompts-per-step",
          str(B), "--group-size", str(K), "--max-staleness", "0", "--reward", flaky, "--eval-reward", "verifier",
          "--eval-every", "0", "--quiet"], tmp_path)
    rows, summary, log = _read(tmp_path, "a")
    _check_failed_counted(rows, summary, K)
    _check_trained_rewards(rows)
    assert summary["samples_trained"] == steps * B * K  # full batches: failed groups took no batch place
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped_stale"]
                                            + summary["samples_failed_reward"] + summary["samples_lost_in_crash"]
                                            + summary["samples_left_in_queue"])
    ro = summary["rollout"]
    assert ro["groups_failed_reward"] == summary["groups_failed_reward"]
    assert ro["samples_failed_reward"] == summary["samples_failed_reward"]
    # the rollout rank generated every sample the trainer received, and the groups cancelled at the stop
    assert ro["samples_generated"] == summary["samples_generated"]
    assert sum(not c["raised"] for c in log) >= summary["samples_generated"] - summary["samples_failed_reward"]


@pytest.mark.slow
def test_ppo_fails_a_group_whole(tiny_hf_dir, tmp_path, flaky):
    _run([sys.executable, "cookbook/ppo.py", "--model", tiny_hf_dir, "--runs-dir", str(tmp_path), "--name", "p",
          "--steps", "2", "--prompts-per-step", str(B), "--group-size", "2", "--reward", flaky, "--eval-reward",
          "verifier", "--eval-every", "0", "--quiet"], tmp_path)
    rows, summary, log = _read(tmp_path, "p")
    _check_failed_counted(rows, summary, 2)
    assert summary["samples_trained"] + summary["samples_failed_reward"] == summary["samples_generated"] == 2 * B * 2
    assert summary["samples_trained"] == sum(not c["raised"] for c in log)


@pytest.mark.slow
def test_agent_async_fails_a_group_whole(bpe_chat_dir, tmp_path, flaky):
    _run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(_port()), "cookbook/agent_async.py", "--model",
          bpe_chat_dir, "--runs-dir", str(tmp_path), "--name", "g", "--prompts", str(GSM8K), "--prompt-field",
          "question", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--time-limit", "0",
          "--max-turns", "2", "--turn-tokens", "16", "--tools", "rlblocks.rollout.agents:calculator_tool", "--reward",
          flaky, "--eval-reward", "verifier", "--eval-every", "0", "--quiet"], tmp_path)
    rows, summary, log = _read(tmp_path, "g")
    _check_failed_counted(rows, summary, 2)
    assert {c["raised"] for c in log} == {True, False}
    assert summary["samples_trained"] == 2 * 2 * 2
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_without_trajectory"]
                                            + summary["samples_dropped_stale"] + summary["samples_failed_reward"]
                                            + summary["samples_lost_in_crash"] + summary["samples_left_in_queue"])
    assert summary["rollout"]["groups_failed_reward"] == summary["groups_failed_reward"]


@pytest.mark.slow
def test_agent_gateway_fails_a_group_whole(bpe_chat_dir, tmp_path, flaky, monkeypatch):
    import agent_gateway

    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "reward_log.jsonl"))
    threads = torch.get_num_threads()
    try:
        agent_gateway.main(["--model", bpe_chat_dir, "--runs-dir", str(tmp_path), "--name", "w", "--prompts",
                            str(GSM8K), "--prompt-field", "question", "--steps", "3", "--prompts-per-step", str(B),
                            "--group-size", "2", "--heldout", "4", "--reward", flaky, "--eval-reward", "verifier"])
    finally:
        torch.set_num_threads(threads)
    rows, summary, log = _read(tmp_path, "w")
    _check_failed_counted(rows, summary, 2)
    assert summary["samples_generated"] == 3 * B * 2
    assert summary["samples_trained"] + summary["samples_failed_reward"] == summary["samples_generated"]
    # an episode is scored on its final answer: one cut at the turn limit has no call, and trains its 0
    assert sum(not c["raised"] for c in log) <= summary["samples_trained"]
    assert rows[-1]["samples_failed_reward"] == summary["samples_failed_reward"]
