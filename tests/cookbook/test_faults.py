"""Loops that survive faults, end to end (subprocesses killed by pid with SIGKILL, never by name).

- ``grpo_sync.py`` and ``ppo.py`` killed after a checkpoint and resumed end with the weights and optimizer states of
  an uninterrupted run of the same seed, bit for bit (CPU, TorchEngine), and log the same metrics;
- ``grpo_async.py`` under ``torchrun --max-restarts`` with its trainer rank killed mid-run reaches its step count on
  its own: every sample received is trained, dropped as stale, lost in the crash or left in the queue (each
  counted in summary.json), none is trained twice, and no trained token is older than η.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlblocks.checkpoint import load_checkpoint, read_checkpoint_meta
from rlblocks.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
B, K = 4, 4

pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

TIMING = ("step_seconds", "generate_seconds", "train_seconds", "sync_seconds", "reward_seconds", "queue_wait_seconds",
          "tokens_per_s", "wall_seconds", "cpu_seconds", "rl_seconds_this_run", "config", "restarts",
          "resumed_from_steps", "steps_redone", "checkpoints_skipped", "seconds")  # seconds: the reward pool's time


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning")
    env.pop("TRITON_INTERPRET", None)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the loops handle a restart on one node themselves
    return env


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"
    return p


def _saved_step(ckpt: Path) -> int:
    try:
        return int(read_checkpoint_meta(ckpt)["meta"]["step"])
    except CheckpointError:  # not written yet
        return -1


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


def _start_and_wait_for(cmd: list[str], ckpt: Path, step: int) -> subprocess.Popen:
    """Start ``cmd`` and return once it has saved a checkpoint of ``step`` or later (an event: the file's header)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 600  # a hang guard only
    while _saved_step(ckpt) < step:
        assert proc.poll() is None, f"the run ended before its checkpoint of step {step}: {proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.02)
    return proc


def _untimed(x):
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in TIMING}
    return x


def _rows(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kill_and_resume_sync(script: str, flags: list[str], model: str, tmp_path: Path, steps: int) -> tuple:
    base = [sys.executable, f"cookbook/{script}", "--model", model, "--runs-dir", str(tmp_path), "--steps",
            str(steps), "--save-every", "1", "--eval-every", "0", "--quiet", *flags]
    _run([*base, "--name", "whole"])
    proc = _start_and_wait_for([*base, "--name", "cut"], tmp_path / "cut" / "ckpt.pt", 2)
    os.kill(proc.pid, signal.SIGKILL)  # a hard kill, after step 2 (or a little later), no clean-up
    assert proc.wait(timeout=60) == -signal.SIGKILL
    at_kill = load_checkpoint(tmp_path / "cut" / "ckpt.pt")
    assert 2 <= at_kill["step"] < steps, at_kill["step"]  # killed mid-run: the resume has steps left to do
    _run([*base, "--name", "cut", "--resume"])
    whole, cut = (load_checkpoint(tmp_path / n / "ckpt.pt") for n in ("whole", "cut"))
    assert whole["step"] == cut["step"] == steps
    assert not _same(at_kill["model"], cut["model"])  # the resumed run trained: the weights moved after the kill
    return whole, cut, at_kill


def test_grpo_sync_killed_and_resumed_ends_bit_identical(demo_model_dir, tmp_path):
    flags = ["--prompts-per-step", str(B), "--group-size", str(K), "--ppo-epochs", "2", "--mini-batches", "2"]
    whole, cut, _ = _kill_and_resume_sync("grpo_sync.py", flags, demo_model_dir, tmp_path, 6)
    assert _same(whole["model"], cut["model"])
    sw, sc = whole["optim"]["state"], cut["optim"]["state"]
    assert sw.keys() == sc.keys() and all(_same(sw[i], sc[i]) for i in sw)
    assert [_untimed(r) for r in _rows(tmp_path / "whole")] == [_untimed(r) for r in _rows(tmp_path / "cut")]
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert _untimed(summary) == _untimed(json.loads((tmp_path / "whole" / "summary.json").read_text()))
    assert summary["restarts"] == 1 and summary["resumed_from_steps"][0] >= 2


def test_ppo_killed_and_resumed_ends_bit_identical(demo_model_dir, tmp_path):
    flags = ["--reward", "verifier", "--prompts-per-step", str(B), "--group-size", str(K)]
    whole, cut, _ = _kill_and_resume_sync("ppo.py", flags, demo_model_dir, tmp_path, 5)
    for role in ("model", "critic"):
        assert _same(whole[role], cut[role]), role
    for opt in ("actor_optim", "critic_optim"):
        sw, sc = whole[opt]["state"], cut[opt]["state"]
        assert sw.keys() == sc.keys() and all(_same(sw[i], sc[i]) for i in sw), opt
    assert [_untimed(r) for r in _rows(tmp_path / "whole")] == [_untimed(r) for r in _rows(tmp_path / "cut")]
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["restarts"] == 1


def check_async_accounting(run: Path, steps: int, eta: int) -> dict:
    """What every async run must show, whatever died during it (benchmarks/faults/chaos.py checks the same)."""
    summary = json.loads((run / "summary.json").read_text())
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and summary["steps"] == steps
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped_stale"]
                                            + summary["samples_failed_reward"] + summary["samples_lost_in_crash"]
                                            + summary["samples_left_in_queue"])
    assert summary["samples_trained"] == steps * B * K
    trained = [u for r in rows for u in r["trained_uids"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert not set(trained) & set(summary["left_uids"]) and not set(trained) & set(summary["stale_uids"])
    for r in rows:  # the staleness bound, before and after every restart
        assert max(int(a) for a in r["staleness_hist"]) <= eta, r["staleness_hist"]
    assert summary["max_staleness_seen"] <= eta
    journal = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    assert summary["samples_generated"] == sum(j["samples"] for j in journal if j["event"] == "recv")
    return summary


def test_grpo_async_survives_a_killed_trainer_rank_under_torchrun_max_restarts(tiny_hf_dir, tmp_path):
    steps, eta = 8, 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "3",
           "--standalone", "cookbook/grpo_async.py",
           "--model", tiny_hf_dir, "--runs-dir", str(tmp_path), "--name", "chaos", "--prompts-per-step", str(B),
           "--group-size", str(K), "--steps", str(steps), "--save-every", "2", "--eval-every", "0",
           "--max-staleness", str(eta), "--quiet"]
    proc = _start_and_wait_for(cmd, tmp_path / "chaos" / "ckpt.pt", 2)
    victims = [c for c in _children(proc.pid) if _rank_of(c) == 0]  # the trainer: its queue and counters die
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-6000:]
    summary = check_async_accounting(tmp_path / "chaos", steps, eta)
    assert summary["restarts"] == 1 and summary["resumed_from_steps"][0] >= 2
    assert summary["samples_lost_in_crash"] >= 0
