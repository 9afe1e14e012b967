"""cookbook/plumbing/checkpoints.py in one process (no model, no loop): a fresh start, a resume that restores
weights, optimizer and RNG exactly, a checkpoint of other flags or a damaged one refused by name, the fallback to
the previous checkpoint, the metric rows after the checkpoint dropped, the journal's counts."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass

import pytest
import torch
from plumbing import (
    COMMON_KEYS,
    Journal,
    RunFiles,
    load_model_state,
    load_optim_state,
    model_state,
    optim_state,
    restore_rng,
    resume_run,
    save_run_checkpoint,
)

from rlblocks.errors import ArgumentError, CheckpointError


@dataclass
class Cfg:
    name: str = "r"
    steps: int = 10
    lr: float = 1e-3
    seed: int = 0
    resume: bool = False


def _model_and_optim(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, opt


def _train(m, opt, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(5, 4)).square().sum().backward()
        opt.step()


def _save(files, cfg, m, opt, step, data):
    save_run_checkpoint(files, cfg, {"step": step, "model": model_state(m, 1), "optim": optim_state(m, opt, 1)},
                        rank=0, world=1, generators={"data": data})


def test_fresh_start_then_resume_restores_weights_optimizer_and_rng_exactly(tmp_path):
    files = RunFiles(str(tmp_path), "r")
    (files.dir / "stale.txt").write_text("kept")  # not a run file
    files.metrics.write_text('{"step": 99}\n')  # an earlier run's rows: a fresh start removes them
    cfg = Cfg()
    rec = resume_run(files, cfg, rank=0, world=1)
    assert rec.state is None and not files.metrics.exists() and rec.summary()["restarts"] == 0
    m, opt = _model_and_optim()
    data = random.Random(3)
    _train(m, opt, 2)
    for step in (1, 2, 3):  # every key a loop logs (MetricsSink refuses a record without them)
        files.log({**dict.fromkeys(COMMON_KEYS), "step": step})
    _save(files, cfg, m, opt, 2, data)
    # what an uninterrupted run draws and trains next
    want_draw, want_data = torch.rand(4), data.random()
    _train(m, opt, 3)
    want = {k: v.clone() for k, v in m.state_dict().items()}

    cfg2 = dataclasses.replace(cfg, steps=20, resume=True)  # --steps may change on a resume
    rec = resume_run(files, cfg2, rank=0, world=1)
    assert rec.step == 2 and rec.steps_redone == 1  # step 3 was logged after the checkpoint: done again
    assert [json.loads(x)["step"] for x in files.metrics.read_text().splitlines()] == [1, 2]
    m2, opt2 = _model_and_optim(seed=5)  # other initial weights: every value must come from the checkpoint
    load_model_state(m2, rec.state["model"])
    load_optim_state(m2, opt2, rec.state["optim"], 1)
    data2 = random.Random(0)
    torch.rand(7)  # set-up draws before the restore do not matter
    restore_rng(rec, 0, {"data": data2})
    assert torch.equal(torch.rand(4), want_draw) and data2.random() == want_data
    _train(m2, opt2, 3)
    assert all(torch.equal(m2.state_dict()[k], want[k]) for k in want)
    assert rec.summary() == {"restarts": 1, "resumed_from_steps": [2], "steps_redone": 1, "checkpoints_skipped": []}
    assert (files.dir / "stale.txt").read_text() == "kept"


def test_a_checkpoint_of_other_flags_or_ranks_is_refused_naming_the_flag(tmp_path):
    files = RunFiles(str(tmp_path), "r")
    cfg = Cfg()
    resume_run(files, cfg, rank=0, world=1)
    m, opt = _model_and_optim()
    _save(files, cfg, m, opt, 1, random.Random(0))
    with pytest.raises(ArgumentError, match=r"--resume: .*ckpt\.pt was written with --lr 0\.001, this run has 0\.01"):
        resume_run(files, dataclasses.replace(cfg, lr=1e-2, resume=True), rank=0, world=1)
    with pytest.raises(ArgumentError, match=r"written by 1 rank\(s\), this run has 2"):
        resume_run(files, dataclasses.replace(cfg, resume=True), rank=0, world=2)


def test_a_model_that_does_not_fit_is_refused_before_any_weight_changes():
    m, _ = _model_and_optim()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    bad = {k: v.clone() + 1 for k, v in m.state_dict().items()}
    bad["1.weight"] = torch.zeros(5, 5)  # the last tensor is the wrong shape: nothing may be loaded
    with pytest.raises(CheckpointError, match=r"mismatched \['1\.weight: \(5, 5\)"):
        load_model_state(m, bad)
    del bad["1.weight"]
    with pytest.raises(CheckpointError, match=r"missing \['1\.weight'\]"):
        load_model_state(m, bad)
    assert all(torch.equal(m.state_dict()[k], before[k]) for k in before)


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path):
    files = RunFiles(str(tmp_path), "r")
    cfg = Cfg()
    resume_run(files, cfg, rank=0, world=1)
    m, opt = _model_and_optim()
    _save(files, cfg, m, opt, 1, random.Random(0))
    _save(files, cfg, m, opt, 2, random.Random(0))
    raw = files.ckpt.read_bytes()
    files.ckpt.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # one flipped bit
    rec = resume_run(files, dataclasses.replace(cfg, resume=True), rank=0, world=1)
    assert rec.step == 1 and len(rec.skipped) == 1 and "SHA-256" in rec.skipped[0][1]
    assert "SHA-256" in rec.summary()["checkpoints_skipped"][0]
    files.checkpoint.prev.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        resume_run(files, dataclasses.replace(cfg, resume=True), rank=0, world=1)


def test_a_restart_before_the_first_checkpoint_starts_at_zero_and_keeps_the_journal(tmp_path):
    files = RunFiles(str(tmp_path), "r")
    resume_run(files, Cfg(), rank=0, world=1)
    Journal(files.journal).append({"event": "recv", "uid": "r1-0-0", "samples": 4})
    with open(files.journal, "a") as f:
        f.write('{"event": "recv", "uid": "r1-0-1", "sam')  # torn by the crash: not counted
    rec = resume_run(files, Cfg(resume=True), rank=0, world=1)
    assert rec.state is None and rec.step == 0 and rec.received == 4
    assert rec.summary()["restarts"] == 1 and len(rec.journal.starts()) == 2  # the new start survived the torn line
