"""Short runs of the two agent cookbook loops on a random tiny model (no warm start): the bounded-async loop under
torchrun (2 processes) and the gateway loop driven by openai-client agents. Their run files are checked against what
the flags imply: steps, versions, the staleness bound, episode accounting, the summary's agent fields."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "cookbook"))
B, K, STEPS = 2, 2, 3


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory) -> str:
    import agent_task as task

    path = tmp_path_factory.mktemp("agent_random")
    tok = task.build_tokenizer()
    task.build_model(tok, seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_agent_async_short_run(random_ckpt, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_port()), str(ROOT / "cookbook" / "agent_async.py"), "--model", random_ckpt,
           "--runs-dir", str(tmp_path), "--name", "t", "--steps", str(STEPS), "--prompts-per-step", str(B),
           "--group-size", str(K), "--eval-every", "2", "--heldout", "8", "--quiet"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["version"] for r in rows] == [1, 2, 3]
    assert [r["heldout_acc"] is not None for r in rows] == [False, True, True]  # every 2 steps and at the end
    for r in rows:
        ages = [int(a) for a in r["staleness_hist"]]
        assert ages and 0 <= min(ages) and max(ages) <= 1, r["staleness_hist"]
    for key in ("accuracy_before", "accuracy_after", "wall_seconds", "steps", "max_staleness", "max_staleness_seen",
                "samples_generated", "samples_trained", "samples_dropped_stale", "turns_mean", "tool_calls",
                "env_errors", "prefix_mismatches"):
        assert key in summary, key
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * B * K
    assert summary["samples_generated"] >= summary["samples_trained"]
    assert 1.0 <= summary["turns_mean"] <= 3.0 and summary["env_errors"] == 0
    # every episode run is accounted for: shipped to the trainer, or finished in a group cancelled at Stop
    assert sum(summary["finish_reasons"].values()) == summary["episodes_run_this_start"]
    assert summary["episodes_run_this_start"] == summary["samples_generated"] + summary["episodes_cancelled_at_stop"]
    assert summary["episodes_cancelled_at_stop"] <= summary["rollout"]["groups_cancelled_at_stop"] * K
    assert (tmp_path / "t" / "policy" / "config.json").exists()


@pytest.mark.slow
def test_agent_gateway_short_run(random_ckpt, tmp_path):
    import agent_gateway

    summary = agent_gateway.main(["--model", random_ckpt, "--runs-dir", str(tmp_path), "--name", "g", "--steps", "2",
                                  "--prompts-per-step", str(B), "--group-size", str(K), "--heldout", "8"])
    rows = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    gw = summary["gateway"]
    assert gw["sessions_finished"] == 2 * B * K and gw["sessions_open"] == 0
    assert gw["requests POST /v1/sessions"] == 2 * B * K  # one reward per session
    assert gw.get("errors_4xx", 0) == 0 and gw.get("errors_5xx", 0) == 0
    assert 0.0 <= summary["accuracy_after"] <= 1.0
