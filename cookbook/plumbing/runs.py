"""Run files and progress: ``runs/<name>/`` (metrics to every sink, summary, checkpoint, held-out results), the
per-step metric means, the progress bar (or line)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlblocks.checkpoint import Checkpoint

from .tracking import MetricsSink


class RunFiles:
    """``runs/<name>/``: ``metrics.jsonl`` (one JSON object per step, appended; also to TensorBoard / W&B with
    ``sinks``, see :mod:`.tracking`), ``summary.json``, ``ckpt.pt`` (the latest run checkpoint, with ``ckpt.prev.pt``
    the one before: ``rlblocks.checkpoint.Checkpoint``), ``journal.jsonl`` (the run's starts and, in the async loops,
    every group the trainer received: see :mod:`.checkpoints`) and ``eval/step_<N>.jsonl`` (the per-prompt results of
    each held-out evaluation). ``config``: the run's flags (W&B's run config)."""

    def __init__(self, root: str, name: str, *, sinks: tuple[str, ...] = ("jsonl",), config: Any = None) -> None:
        self.dir = Path(root) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self.dir / "metrics.jsonl"
        self.summary = self.dir / "summary.json"
        self.ckpt = self.dir / "ckpt.pt"
        self.checkpoint = Checkpoint(self.ckpt)
        self.journal = self.dir / "journal.jsonl"
        self.evals = self.dir / "eval"
        if dataclasses.is_dataclass(config):
            config = dataclasses.asdict(config)
        self.sink = MetricsSink(self.metrics, self.dir, sinks, config=config, name=name)

    def fresh(self) -> None:
        """A new run: every file of an earlier run of this name goes (``--resume`` keeps them)."""
        for p in (self.metrics, self.summary, self.journal):
            p.unlink(missing_ok=True)
        self.checkpoint.remove()
        if self.evals.exists():
            shutil.rmtree(self.evals)
        self.sink.fresh()

    def log(self, record: dict) -> None:
        """One step's metrics (every key of :data:`.tracking.COMMON_KEYS` present) to every sink."""
        self.sink.log(record, _jsonable(record))

    def write_eval(self, step: int, result: Any) -> Path:
        """The per-prompt results of a held-out evaluation (an ``rlblocks.reward.EvalResult``) at ``step``:
        ``eval/step_<step>.jsonl``, one line per prompt, then a last line with the totals (``"totals": true``)."""
        self.evals.mkdir(exist_ok=True)
        path = self.evals / f"step_{step:06d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for p in result.prompts:
                f.write(json.dumps(_jsonable(p.record())) + "\n")
            f.write(json.dumps({"totals": True, "step": step, "k": result.k, "n": result.n,
                                **_jsonable(result.metrics())}) + "\n")
        os.replace(tmp, path)
        return path

    def metrics_rows(self) -> list[dict]:
        """The rows of ``metrics.jsonl`` (a torn last line, from a crash while it was written, is left out)."""
        if not self.metrics.exists():
            return []
        rows = []
        for line in self.metrics.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
        return rows

    def keep_metrics_until(self, step: int) -> int:
        """Drop the rows logged after ``step`` (a resumed run redoes those steps); returns the last step logged
        before (0 for none). Rewritten atomically."""
        rows = self.metrics_rows()
        last = max((int(r.get("step", 0)) for r in rows), default=0)
        tmp = self.metrics.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows if int(r.get("step", 0)) <= step))
        os.replace(tmp, self.metrics)
        return last

    def write_summary(self, summary: dict) -> None:
        tmp = self.summary.with_suffix(".tmp")
        tmp.write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
        os.replace(tmp, self.summary)
        self.sink.summary(_jsonable(summary))

    def close(self) -> None:
        """Flush and close the TensorBoard / W&B writers (idempotent)."""
        self.sink.close()

    def save(self, state: dict) -> None:
        """Write the run checkpoint (atomic and checked; the one before it is kept as ``ckpt.prev.pt``)."""
        self.checkpoint.save(state, meta={"step": int(state.get("step", 0))})

    def load(self, required: tuple[str, ...] = ()) -> dict | None:
        """The newest run checkpoint that passes every check (``None`` when there is none; a damaged latest one
        falls back to the previous, listed in ``self.checkpoint.skipped``)."""
        if not self.checkpoint.exists():
            return None
        return self.checkpoint.load(required=required)[0]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Progress:
    """Progress of a run: a bar on a terminal, a line every ``every`` seconds elsewhere.

    On a terminal (``stream.isatty()``): a tqdm bar when tqdm is installed, else a one-line text bar redrawn with
    a carriage return. Elsewhere (CI, a batch job's log file) a carriage return would pile up into one huge line,
    so a plain line ``desc: step n/total (x%) k=v ... elapsed s`` is printed at most every ``every`` seconds, and
    at the last step. ``clock`` (seconds, monotonic) and ``stream`` (default ``sys.stderr``) are injectable.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "grpo", *,
                 every: float = 5.0, stream=None, clock=time.monotonic) -> None:
        self.enabled = enabled
        self.total, self.n, self.desc, self.every = total, initial, desc, every
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.t0 = self.last = clock()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc, file=self.stream)
            except ImportError:
                self.bar = None

    def update(self, postfix: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.n += 1
        tail = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
        if self.bar is not None:
            self.bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
            self.bar.update(1)
        elif self.tty:
            done = int(30 * self.n / max(self.total, 1))
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} {tail}", end="", file=self.stream,
                  flush=True)
        else:
            now = self.clock()
            if now - self.last >= self.every or self.n >= self.total:
                self.last = now
                pct = 100.0 * self.n / max(self.total, 1)
                print(f"{self.desc}: step {self.n}/{self.total} ({pct:.0f}%) {tail} {now - self.t0:.0f} s",
                      file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            print(file=self.stream)


def mean_metrics(records: list[dict[str, Tensor]]) -> dict[str, float]:
    """Mean of each metric over the optimizer updates of one step (one host sync per metric, after the step)."""
    keys = {k for r in records for k in r}
    return {k: float(torch.stack([torch.as_tensor(r[k], dtype=torch.float64) for r in records if k in r]).mean())
            for k in sorted(keys)}
