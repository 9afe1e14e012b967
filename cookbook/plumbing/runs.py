"""Run files and progress: ``runs/<name>/`` (metrics, summary, checkpoint), the per-step metric means, the
progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlblocks.checkpoint import Checkpoint


class RunFiles:
    """``runs/<name>/``: ``metrics.jsonl`` (one JSON object per step, appended), ``summary.json``, ``ckpt.pt`` (the
    latest run checkpoint, with ``ckpt.prev.pt`` the one before: ``rlblocks.checkpoint.Checkpoint``) and
    ``journal.jsonl`` (the run's starts and, in the async loops, every group the trainer received: see
    :mod:`.checkpoints`)."""

    def __init__(self, root: str, name: str) -> None:
        self.dir = Path(root) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self.dir / "metrics.jsonl"
        self.summary = self.dir / "summary.json"
        self.ckpt = self.dir / "ckpt.pt"
        self.checkpoint = Checkpoint(self.ckpt)
        self.journal = self.dir / "journal.jsonl"

    def fresh(self) -> None:
        """A new run: every file of an earlier run of this name goes."""
        for p in (self.metrics, self.summary, self.journal):
            p.unlink(missing_ok=True)
        self.checkpoint.remove()

    def log(self, record: dict) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")

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
    """tqdm progress bar when installed, else a one-line text bar on stderr."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "grpo") -> None:
        self.enabled = enabled
        self.total, self.n, self.t0 = total, initial, time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc)
            except ImportError:
                self.bar = None

    def update(self, postfix: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                 refresh=False)
            self.bar.update(1)
        else:
            done = int(30 * self.n / max(self.total, 1))
            tail = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items())
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} {tail}", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def mean_metrics(records: list[dict[str, Tensor]]) -> dict[str, float]:
    """Mean of each metric over the optimizer updates of one step (one host sync per metric, after the step)."""
    keys = {k for r in records for k in r}
    return {k: float(torch.stack([torch.as_tensor(r[k], dtype=torch.float64) for r in records if k in r]).mean())
            for k in sorted(keys)}
