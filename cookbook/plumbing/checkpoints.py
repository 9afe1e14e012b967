"""``--resume``: the run checkpoint every loop writes and the steps by which a loop continues from it.

A loop saves with :func:`save_run_checkpoint` (every ``--save-every`` steps and at the end) and starts with
:func:`resume_run`, which decides between a fresh run and a resumed one. A run resumes when ``--resume`` is given
or when ``torchrun --max-restarts N`` restarted the process group after a rank died (``TORCHELASTIC_RESTART_COUNT``
> 0): the loops resume from their last checkpoint on their own.

The checkpoint (``runs/<name>/ckpt.pt``, ``rlblocks.checkpoint``: atomic, checksummed, the previous one kept as
``ckpt.prev.pt``) holds what the loop puts in it plus, from here: ``rng`` (every rank's Python, torch and named
generators: :func:`rlblocks.checkpoint.rng_state`, gathered over the ranks) and ``config`` (the flags). A resume
refuses a checkpoint written with other flags than the ones given (except the flags of :data:`FREE_FLAGS`, which
do not change what a step computes), naming the flag.

``runs/<name>/journal.jsonl`` is the run's append-only history, which the checkpoint cannot hold because it is
about what happened after the checkpoint: one ``start`` line per start of the run (fresh, resumed or restarted)
and, in the async loops, one ``recv`` line per group the trainer received (written in the same critical section
that counts it, see ``Inbox``), so that a resume knows how many samples arrived after its checkpoint and died with
the crashed process (``samples_lost_in_crash``). Its lines are written with one ``write`` each and flushed: they
survive a killed process (the operating system holds them); a machine crash can lose the last ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlblocks.checkpoint import rng_state, set_rng_state
from rlblocks.errors import ArgumentError, CheckpointError

from .runs import RunFiles

FREE_FLAGS = frozenset({"name", "runs_dir", "steps", "time_limit", "eval_every", "save_every", "resume", "quiet",
                        "sync_port", "log_to"})
"""Flags a resumed run may change: they decide how long it runs and what it logs, not what a step computes."""


def restart_count() -> int:
    """How many times ``torchrun`` restarted this process group (``TORCHELASTIC_RESTART_COUNT``; 0 otherwise)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Journal:
    """``runs/<name>/journal.jsonl``: see the module docstring. Thread-safe appends."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._whole = False  # the file ends with a whole line (checked before this object's first append)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock, open(self.path, "a+b") as f:
            if not self._whole:  # a line torn by a crash stays alone on its line, never glued to this one
                if f.seek(0, os.SEEK_END) > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                    line = "\n" + line
                self._whole = True
            f.write(line.encode())
            f.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every complete line (a line torn by a crash while it was written is left out)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def starts(self) -> list[dict[str, Any]]:
        """The ``start`` lines, oldest first."""
        return [r for r in self.read() if r.get("event") == "start"]

    def received(self) -> int:
        """Samples of every group the trainer ever received in this run (all starts)."""
        return sum(int(r["samples"]) for r in self.read() if r.get("event") == "recv")


@dataclass
class Recovery:
    """What :func:`resume_run` found: ``state`` (the checkpoint, ``None`` for a fresh start), the run's earlier
    ``starts`` (journal lines), ``steps_redone`` (steps logged after the checkpoint by the run that crashed, done
    again now), ``skipped`` (checkpoint files that failed their checks, with why), ``received`` (samples the
    journal says the trainer had received before this start)."""

    state: dict[str, Any] | None
    journal: Journal
    starts: list[dict[str, Any]] = field(default_factory=list)
    steps_redone: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    received: int = 0

    @property
    def step(self) -> int:
        return int(self.state["step"]) if self.state is not None else 0

    def summary(self) -> dict[str, Any]:
        """The fault-tolerance figures of ``summary.json``: ``restarts`` (starts of this run after the first),
        ``resumed_from_steps``, ``steps_redone`` (over every restart), ``checkpoints_skipped``."""
        later = self.starts[1:]
        return {"restarts": len(later), "resumed_from_steps": [int(s.get("step", 0)) for s in later],
                "steps_redone": sum(int(s.get("redone", 0)) for s in later),
                "checkpoints_skipped": [m for s in later for m in s.get("skipped", [])]}


def resume_run(files: RunFiles, cfg: Any, *, rank: int, world: int, group=None, resume: bool | None = None,
               required: tuple[str, ...] = ("step", "model", "rng", "config")) -> Recovery:
    """Start of a loop: a fresh run (rank 0 deletes the files of an earlier run of this name) or a resumed one.

    It resumes when ``resume`` (default: ``cfg.resume or restart_count() > 0``). Every rank then loads the newest
    checkpoint that passes its checks (a damaged latest one falls back to ``ckpt.prev.pt``, reported); none there
    (a crash before the first save) means starting from step 0 with the run's journal kept. The checkpoint must
    hold ``required`` and have been written with these flags (:data:`FREE_FLAGS` aside) and this world size;
    rank 0 drops the metric rows logged after the checkpoint (those steps are done again) and appends this start
    to the journal. Call it on the ranks that save (the trainer ranks: ``world`` of them, process group ``group``),
    collectively.
    """
    journal = Journal(files.journal)
    resume = (bool(getattr(cfg, "resume", False)) or restart_count() > 0) if resume is None else resume
    if not resume:
        if rank == 0:
            files.fresh()
            journal.append({"event": "start", "time": time.time(), "step": 0, "restart": restart_count()})
        _barrier(world, group)
        return Recovery(None, journal, starts=journal.starts())
    state = files.load(required=required)
    skipped = list(files.checkpoint.skipped)
    if state is not None:
        _check_config(files, cfg, state)
        if len(state["rng"]) != world:
            raise ArgumentError(f"--resume: {files.ckpt} was written by {len(state['rng'])} rank(s), this run has "
                                f"{world}")
    rec = Recovery(state, journal, skipped=skipped)
    _barrier(world, group)  # every rank has read the files before rank 0 rewrites the metrics and the journal
    if rank == 0:
        last = files.keep_metrics_until(rec.step)
        rec.steps_redone = max(0, last - rec.step)
        rec.received = journal.received()
        journal.append({"event": "start", "time": time.time(), "step": rec.step, "restart": restart_count(),
                        "redone": rec.steps_redone, "skipped": [m for _, m in skipped]})
        where = f"step {rec.step} ({files.ckpt})" if state is not None else "step 0 (no checkpoint yet)"
        print(f"resuming from {where}; {rec.steps_redone} step(s) done again"
              + "".join(f"\n  skipped {p}: {m}" for p, m in skipped), flush=True)
    rec.starts = journal.starts()
    return rec


def _barrier(world: int, group=None) -> None:
    if world > 1 and dist.is_initialized():
        dist.barrier(group)


def _check_config(files: RunFiles, cfg: Any, state: dict) -> None:
    saved = state["config"]
    for k, v in dataclasses.asdict(cfg).items():
        if k in FREE_FLAGS or k not in saved:
            continue
        if saved[k] != v:
            flag = "--" + k.replace("_", "-")
            raise ArgumentError(f"--resume: {files.ckpt} was written with {flag} {saved[k]!r}, this run has {v!r} "
                                f"(resume with the same {flag}, or start a fresh run under another --name)")


def restore_rng(rec: Recovery, rank: int, generators: dict[str, random.Random | torch.Generator] | None = None,
                *, index: int | None = None) -> None:
    """Give this rank the RNG states it had at the checkpoint (``index``: its position among the saving ranks,
    default ``rank``). Call it last, right before the first step, so that nothing drawn during set-up (a
    held-out evaluation, the engine's start) shifts them."""
    if rec.state is not None:
        set_rng_state(rec.state["rng"][rank if index is None else index], generators)


def save_run_checkpoint(files: RunFiles, cfg: Any, state: dict[str, Any], *, rank: int, world: int,
                        generators: dict[str, random.Random | torch.Generator] | None = None,
                        group=None) -> None:
    """Write the run checkpoint: ``state`` (what the loop holds; rank 0's is written) plus ``rng`` (every saving
    rank's RNG states, gathered over ``group``, ``world`` ranks) and ``config``. Collective over those ranks."""
    mine = rng_state(generators)
    rngs = [mine]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, mine, group=group)
    if rank == 0:
        files.save({**state, "rng": rngs, "config": dataclasses.asdict(cfg)})


# ------------------------------------------------------------------------------------------------ model and optimizer
def model_state(module: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The full (unsharded, CPU) state dict of ``module``; under FSDP2 a collective of every rank."""
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def optim_state(module: nn.Module, optim: torch.optim.Optimizer, world: int) -> dict[str, Any]:
    """The full optimizer state of ``optim`` (over ``module``); under FSDP2 a collective of every rank."""
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(module, optim,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optim.state_dict()


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor], *, what: str = "model") -> None:
    """Load ``state`` into the (not yet sharded) ``module`` after checking every name, shape and dtype first, so
    that a checkpoint that does not fit raises :class:`CheckpointError` before any weight changes (a plain
    ``load_state_dict`` copies tensor by tensor and stops half-way)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k}: {tuple(state[k].shape)} {state[k].dtype}, expected {tuple(v.shape)} {v.dtype}"
             for k, v in own.items() if k in state and (state[k].shape != v.shape or state[k].dtype != v.dtype)]
    if missing or unexpected or wrong:
        raise CheckpointError(f"--resume: the checkpoint's {what} does not fit this model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, mismatched {wrong[:5]}")
    module.load_state_dict(state, strict=True)


def load_optim_state(module: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], world: int) -> None:
    """Load a full optimizer state (:func:`optim_state`) into ``optim``; under FSDP2 each rank keeps its shard."""
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(module, optim, state, options=StateDictOptions(full_state_dict=True))
    else:
        optim.load_state_dict(state)
