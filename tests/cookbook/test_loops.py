"""Short end-to-end runs of the cookbook loops (torchrun subprocesses, tiny step counts, the tiny test model).

Each run uses ``--model`` = the shared tiny random Llama checkpoint (no warm start) and checks the run files
against what the flags imply: steps, version advance, the staleness bound on trained tokens, sample accounting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
B, K = 4, 4  # prompt groups per step, samples per group

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Process ids started (transitively) by ``pid``, read from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _env() -> dict:
    # a deprecated rlblocks name anywhere in a loop is an error (the loops use the library as it is now)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning")
    env.pop("TRITON_INTERPRET", None)
    return env


def _async_cmd(nproc: int, model: str, runs: Path, name: str, *extra: str) -> list[str]:
    return [*TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(_port()),
            str(ROOT / "cookbook" / "grpo_async.py"), "--model", model, "--runs-dir", str(runs), "--name", name,
            "--prompts-per-step", str(B), "--group-size", str(K), "--eval-every", "1", "--quiet", *extra]


# What an engine left running at exit prints: asyncio's report of a task destroyed while pending (an engine loop
# nobody closed), an exception raised in a finaliser, or a TypeError from calling a method the engine lacks.
UNCLEAN_EXIT = ("Task was destroyed but it is pending", "Exception ignored", "TypeError")


def _run(cmd: list[str], timeout: float = 240) -> None:
    """Run a loop; it must exit 0 and cleanly: every engine closed inside its event loop (no message of
    ``UNCLEAN_EXIT`` on stderr)."""
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"
    unclean = [m for m in UNCLEAN_EXIT if m in p.stderr]
    assert not unclean, f"{' '.join(cmd)}: {unclean} on stderr\n{p.stderr[-6000:]}"


def _read(runs: Path, name: str) -> tuple[list[dict], dict]:
    d = runs / name
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((d / "summary.json").read_text())


def _check_common(rows: list[dict], summary: dict, steps: int, eta: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))  # one new policy version per step
    for key in ("accuracy_before", "accuracy_after", "wall_seconds", "steps", "max_staleness", "max_staleness_seen",
                "samples_generated", "samples_trained", "samples_dropped_stale"):
        assert key in summary, key
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["steps"] == steps and summary["max_staleness"] == eta
    assert summary["samples_trained"] == steps * B * K  # every step trains a full batch
    for r in rows:
        ages = [int(a) for a in r["staleness_hist"]]
        assert ages and 0 <= min(ages) and max(ages) <= eta, r["staleness_hist"]
        assert sum(r["staleness_hist"].values()) == r["tokens_trained"]
        for key in ("reward", "heldout_acc", "kl_k3", "clipfrac_low", "clipfrac_high", "tokens_per_s",
                    "sync_seconds", "queue_wait_seconds", "zero_variance_groups", "zero_variance_step"):
            assert key in r, key
    assert 0 <= summary["max_staleness_seen"] <= eta
    assert summary["max_staleness_seen"] == max(max(int(a) for a in r["staleness_hist"]) for r in rows)


def _sync_cmd(model: str, runs: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "cookbook" / "grpo_sync.py"), "--model", model, "--runs-dir", str(runs),
            "--name", name, "--prompts-per-step", str(B), "--group-size", str(K), "--eval-every", "1", "--quiet",
            *extra]


def _check_generated(rows: list[dict], summary: dict) -> None:
    """Synchronous loop: nothing is filtered or dropped, so the samples and tokens the engine generated (counted
    at the rollout) are exactly those trained (counted from the batch tensors)."""
    ro = summary["rollout"]
    assert ro["samples_generated"] == summary["samples_generated"] == summary["samples_trained"]
    assert ro["tokens_generated"] == sum(r["tokens_trained"] for r in rows) > 0
    assert [r["samples_generated"] for r in rows] == [B * K * (i + 1) for i in range(len(rows))]


def test_sync_loop_short(tiny_hf_dir, tmp_path):
    _run(_sync_cmd(tiny_hf_dir, tmp_path, "s", "--steps", "3"))
    rows, summary = _read(tmp_path, "s")
    _check_common(rows, summary, 3, 0)
    _check_generated(rows, summary)
    for r in rows:  # one on-policy update per batch: every ratio is 1, nothing clips
        assert r["ppo_updates"] == 1 and r["clipfrac_low"] == 0.0 and r["clipfrac_high"] == 0.0
    assert (ROOT / "cookbook" / "plot.py").exists()
    p = subprocess.run([sys.executable, str(ROOT / "cookbook" / "plot.py"), str(tmp_path / "s")], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "s" / "curves.png").stat().st_size > 1000


def test_sync_ppo_epochs_clip(demo_model_dir, tmp_path):
    # π_old is fixed before the first of 2 epochs × 2 mini-batches: the later updates see ratios ≠ 1 and clip
    _run(_sync_cmd(demo_model_dir, tmp_path, "p", "--steps", "3", "--ppo-epochs", "2", "--mini-batches", "2",
                   "--lr", "3e-3"))
    rows, summary = _read(tmp_path, "p")
    _check_common(rows, summary, 3, 0)
    _check_generated(rows, summary)
    assert all(r["ppo_updates"] == 4 for r in rows)
    assert any(r["reward"] > 0 for r in rows)  # the demo model answers some sums: advantages are not all zero
    assert max(r["clipfrac_low"] + r["clipfrac_high"] for r in rows) > 0


# what differs between two runs of one seed: the clock (``seconds``: the reward pool's wall time)
TIMING = ("step_seconds", "generate_seconds", "train_seconds", "sync_seconds", "reward_seconds", "queue_wait_seconds",
          "tokens_per_s", "wall_seconds", "cpu_seconds", "rl_seconds_this_run", "config", "memory_bytes_per_rank",
          "seconds")


def untimed(x):
    """``x`` (a metrics row or a summary) without its wall-clock figures and run settings."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if k not in TIMING}
    return x


def test_sync_loop_repeats_for_a_seed_and_evaluates_before_and_after_with_eval_every_zero(demo_model_dir,
                                                                                          tmp_path):
    # the synchronous loop is deterministic on CPU: two runs of one seed log the same numbers to the last bit
    # (rewards, losses, grad norms, clip fractions, held-out accuracy), a third with another seed does not;
    # --eval-every 0 evaluates before the first step and after the last, never in between
    flags = ["--steps", "3", "--ppo-epochs", "2", "--mini-batches", "2", "--lr", "3e-3", "--eval-every", "0"]
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        _run(_sync_cmd(demo_model_dir, tmp_path, name, *flags, "--seed", seed))
    (ra, sa), (rb, sb), (rc, _) = (_read(tmp_path, n) for n in "abc")
    _check_common(ra, sa, 3, 0)
    assert [r["heldout_acc"] is not None for r in ra] == [False, False, True]
    assert sa["accuracy_after"] == ra[-1]["heldout_acc"]
    assert [untimed(r) for r in ra] == [untimed(r) for r in rb] and untimed(sa) == untimed(sb)
    assert any(r["reward"] > 0 for r in ra)  # advantages are not all zero: the updates moved the weights
    assert [untimed(r) for r in ra] != [untimed(r) for r in rc]


@pytest.mark.parametrize(
    ("eta", "flags"),
    [
        (0, ["--sync", "delta", "--correction", "tis"]),
        (1, ["--sync", "lora", "--correction", "mis", "--loss", "cispo", "--no-partial-rollout"]),
    ],
)
def test_async_loop_two_procs(tiny_hf_dir, tmp_path, eta, flags):
    _run(_async_cmd(2, tiny_hf_dir, tmp_path, "a", "--steps", "3", "--max-staleness", str(eta), *flags))
    rows, summary = _read(tmp_path, "a")
    _check_common(rows, summary, 3, eta)
    # nothing lost: every group received is trained, found stale, or still queued at the end
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped_stale"]
                                            + summary["samples_failed_reward"] + summary["samples_left_in_queue"])


ROLLOUT_PARTS = ("decode", "prefill", "reprefill", "engine_other", "weight_load", "idle")


def test_async_loop_time_breakdown_adds_up(tiny_hf_dir, tmp_path):
    """Where each rank's time goes, per step: the trainer's parts (queue wait, train, sync, evaluation: timed one by
    one) add up to its step time, and each rollout interval's phases (decode / prefill / re-prefill forwards timed
    by hooks inside the busy time, weight load, idle) add up to the interval, within 10 %. (Whether requests are in
    flight across an update depends on the machine's speed; the re-prefill accounting is checked event by event in
    test_timing.py.)"""
    steps = 4
    _run(_async_cmd(2, tiny_hf_dir, tmp_path, "t", "--steps", str(steps), "--max-staleness", "2",
                    "--length-tail", "12", "--eval-every", "3"))
    rows, summary = _read(tmp_path, "t")
    _check_common(rows, summary, steps, 2)
    reports = 0
    for r in rows:
        parts = r["queue_wait_seconds"] + r["train_seconds"] + r["sync_seconds"] + r["eval_seconds"]
        assert abs(parts - r["step_seconds"]) <= 0.1 * r["step_seconds"], r
        if r["rollout_seconds"] is None:  # this step's interval arrived with the next step's line
            assert all(r[f"rollout_{p}_seconds"] is None for p in ROLLOUT_PARTS)
            continue
        reports += 1
        interval = r["rollout_seconds"]
        seconds = {p: r[f"rollout_{p}_seconds"] for p in ROLLOUT_PARTS}
        assert abs(sum(seconds.values()) - interval) <= 0.1 * interval, (seconds, interval)
        # the forwards ran inside the busy time: what is left of it for the engine's own work is not negative
        assert seconds["engine_other"] >= -0.1 * interval, seconds
        assert all(v >= 0 for p, v in seconds.items() if p != "engine_other"), seconds
        assert 0 < r["decode_batch_max"] <= (2 + 1) * B * K if r["decode_batch_max"] else r["decode_batch_mean"] is None
        assert r["reprefill_tokens"] >= 0
    assert reports >= steps // 2
    assert sum(r["rollout_decode_seconds"] or 0 for r in rows) > 0  # the hooks timed the decode forwards
    assert any(r["eval_seconds"] > 0 for r in rows)  # steps 3 and 4 evaluate
    p = subprocess.run([sys.executable, str(ROOT / "cookbook" / "plot.py"), str(tmp_path / "t")], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_async_dynamic_sampling_is_bounded(tiny_hf_dir, tmp_path):
    # the random tiny model scores 0 on every sample: every group has zero variance, so unbounded dynamic sampling
    # would wait forever; with the bound each batch discards rounds·B groups, then proceeds with the next B
    rounds = 1
    _run(_async_cmd(2, tiny_hf_dir, tmp_path, "d", "--steps", "2", "--max-staleness", "0", "--dynamic-sampling",
                    "--dynamic-max-rounds", str(rounds)))
    rows, summary = _read(tmp_path, "d")
    _check_common(rows, summary, 2, 0)
    ro = summary["rollout"]
    for r in rows:
        assert r["reward"] == 0.0
        assert r["groups_filled_unfiltered"] == B  # every trained group was shipped past the bound, and marked
    assert ro["groups_filtered"] >= 2 * rounds * B  # both batches discarded their rounds·B groups first
    assert ro["groups_filled_unfiltered"] >= 2 * B
    # nothing dropped silently: every generated sample was received by the trainer or counted as filtered
    assert ro["samples_generated"] == summary["samples_generated"] + ro["groups_filtered"] * K


def test_async_fsdp2_two_trainers_one_rollout(demo_model_dir, tmp_path):
    # 2 trainer ranks (FSDP2) each split their shard into 2 mini-batches for 2 epochs: the same number of
    # collectives on both ranks, the normalisers of each mini-batch summed over both
    # 3 steps: 12 groups, so that some group has reward variance (non-zero advantages, ratios that clip)
    _run(_async_cmd(3, demo_model_dir, tmp_path, "f", "--steps", "3", "--max-staleness", "1", "--loss", "decoupled",
                    "--ppo-epochs", "2", "--mini-batches", "2", "--lr", "3e-3"))
    rows, summary = _read(tmp_path, "f")
    _check_common(rows, summary, 3, 1)
    assert all(r["ppo_updates"] == 4 for r in rows)
    assert max(r["clipfrac_low"] + r["clipfrac_high"] for r in rows) > 0


def test_async_resume_after_kill(tiny_hf_dir, tmp_path):
    cmd = _async_cmd(2, tiny_hf_dir, tmp_path, "r", "--steps", "40", "--save-every", "2", "--max-staleness", "1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    ckpt = tmp_path / "r" / "ckpt.pt"
    deadline = time.monotonic() + 600  # a hang guard only: the run is killed once its first checkpoint exists
    while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(0.5)  # let it run on a little past the checkpoint (the test holds whether it did or not)
    for pid in [*_descendants(proc.pid), proc.pid]:  # torchrun and the workers it started: a hard kill, no cleanup
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    assert ckpt.exists(), proc.stderr.read()[-4000:]
    from rlblocks.checkpoint import load_checkpoint

    state = load_checkpoint(ckpt)
    saved_step = state["step"]
    queued_uids = {item["uid"] for item, _, _ in state["queue"]["items"]}
    total = saved_step + 3
    _run(_async_cmd(2, tiny_hf_dir, tmp_path, "r", "--steps", str(total), "--save-every", "2", "--max-staleness",
                    "1", "--resume"))
    rows, summary = _read(tmp_path, "r")
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert summary["steps"] == total
    assert summary["samples_trained"] == total * B * K
    assert summary["accuracy_before"] == state["accuracy_before"]
    trained_after = {u for r in rows if r["step"] > saved_step for u in r["trained_uids"]}
    stale = set(summary.get("stale_uids", []))
    left = set(summary.get("left_uids", []))
    assert queued_uids <= trained_after | stale | left  # every sample queued at the checkpoint survived the kill
    # the rows logged after the checkpoint by the killed run were dropped (those steps were done again), and every
    # sample received is accounted for over both runs
    assert summary["restarts"] == 1 and summary["resumed_from_steps"] == [saved_step]
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped_stale"]
                                            + summary["samples_failed_reward"] + summary["samples_lost_in_crash"]
                                            + summary["samples_left_in_queue"])
    trained = [u for r in rows for u in r["trained_uids"]]
    assert len(trained) == len(set(trained))


@pytest.mark.slow
@pytest.mark.vllm
def test_async_vllm_engine_on_the_demo_model(demo_model_dir, tmp_path):
    # the demo model has 64 positions: the engine's max_model_len comes from the model (vLLM refuses more)
    pytest.importorskip("vllm")
    _run(_async_cmd(2, demo_model_dir, tmp_path, "v", "--steps", "3", "--engine", "vllm", "--max-staleness", "1"),
         timeout=600)
    rows, summary = _read(tmp_path, "v")
    _check_common(rows, summary, 3, 1)
    assert summary["samples_generated"] == (summary["samples_trained"] + summary["samples_dropped_stale"]
                                            + summary["samples_failed_reward"] + summary["samples_left_in_queue"])


@pytest.mark.slow
@pytest.mark.vllm
def test_sync_vllm_engine_on_the_demo_model(demo_model_dir, tmp_path):
    pytest.importorskip("vllm")
    _run(_sync_cmd(demo_model_dir, tmp_path, "sv", "--steps", "3", "--engine", "vllm"), timeout=600)
    rows, summary = _read(tmp_path, "sv")
    _check_common(rows, summary, 3, 0)
    _check_generated(rows, summary)
