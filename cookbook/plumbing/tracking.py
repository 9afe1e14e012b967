"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and W&B when asked (``--log-to``).

``--log-to jsonl,tensorboard,wandb`` (comma-separated, any order):

- ``jsonl``: ``runs/<name>/metrics.jsonl``, one JSON object per step (the run's record, which ``plot.py`` reads).
  Always written, named or not.
- ``tensorboard``: event files under ``runs/<name>/tensorboard/`` through ``torch.utils.tensorboard`` (needs the
  ``tensorboard`` package); ``tensorboard --logdir runs`` shows every run.
- ``wandb``: a W&B run in OFFLINE mode under ``runs/<name>/wandb/`` (needs ``wandb``). Nothing is sent anywhere:
  ``WANDB_MODE=offline`` is forced for the run and error reporting is off; ``wandb sync runs/<name>/wandb/offline-*``
  uploads it later, from a machine that may.

TensorBoard and W&B get every number of a step's record under the same key as the JSON line (a dict of numbers,
such as ``staleness_hist``, as ``key/sub``); lists (``trained_uids``) and ``None`` (not measured this step) stay in
the JSON line only. The step is the record's ``step``. The summary's numbers go to W&B's run summary.

Every loop logs at least :data:`COMMON_KEYS` on every step (``None`` where a loop does not measure one, e.g.
``generate_seconds`` of a trainer that does not generate); :class:`MetricsSink` refuses a record without them, so
the keys cannot drift apart between loops. What each means is listed once, in the cookbook's documentation
(``docs/cookbook/index.md``, "Metrics").
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlblocks.errors import ArgumentError

from .flags import opt

SINKS = ("jsonl", "tensorboard", "wandb")

COMMON_KEYS = (
    "step", "version", "reward", "reward_failures", "heldout_acc", "heldout_pass_at_k", "loss", "grad_norm", "lr",
    "tokens_trained", "tokens_per_s", "samples_generated", "samples_trained", "samples_failed_reward",
    "staleness_hist", "step_seconds", "generate_seconds", "train_seconds", "sync_seconds", "queue_wait_seconds",
    "wall_seconds",
)


@dataclass
class LogFlags:
    """The tracking flag every loop shares (a loop's ``Config`` inherits it)."""

    # not "--log": torchrun's own parser reads any option after the script too, and refuses "--log" as an ambiguous
    # abbreviation of its --log-dir / --logs-specs
    log_to: str = opt("jsonl", "metric sinks, comma-separated: jsonl (always written), tensorboard (runs/<name>/"
                               "tensorboard), wandb (offline, runs/<name>/wandb)")


def parse_log_flag(value: str, flag: str = "--log-to") -> tuple[str, ...]:
    """``--log-to``: the sinks named (``jsonl`` added when missing: it is always written), each installed.

    Raises :class:`ArgumentError` naming ``flag`` for an unknown sink or one whose package is not installed."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ArgumentError(f"{flag}: expected a comma-separated list of {'|'.join(SINKS)}, got {value!r} "
                            f"(unknown: {', '.join(unknown)})")
    needs = {"tensorboard": "tensorboard", "wandb": "wandb"}
    import importlib.util

    for n in names:
        if n in needs and importlib.util.find_spec(needs[n]) is None:
            raise ArgumentError(f"{flag}: {n} needs the {needs[n]!r} package (pip install {needs[n]}), which is "
                                f"not installed")
    return tuple(dict.fromkeys(["jsonl", *names]))


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record for TensorBoard / W&B: ints, floats and bools as floats, a dict of numbers as
    ``key/sub``; ``None``, NaN/inf, strings and lists are left out (they stay in the JSON line)."""
    out: dict[str, float] = {}

    def put(key: str, v: Any) -> None:
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[key] = float(v)

    for k, v in record.items():
        if isinstance(v, dict):
            for sub, x in v.items():
                put(f"{k}/{sub}", x)
        else:
            put(k, v)
    return out


class MetricsSink:
    """One run's metric writers: ``log(record)`` once per step, ``summary(dict)`` at the end, ``close()``.

    ``metrics``: the JSONL file; ``run_dir``: where the TensorBoard and W&B files go; ``sinks``: from
    :func:`parse_log_flag`; ``config``: the run's flags (W&B's run config); ``name``: the run's name. The
    TensorBoard writer and the W&B run are opened on the first record, so only the process that logs opens them.
    ``jsonl`` writes go through :func:`write_line`, one line per record, appended.
    """

    def __init__(self, metrics: Path, run_dir: Path, sinks: tuple[str, ...] = ("jsonl",), *,
                 config: dict[str, Any] | None = None, name: str = "run", check_keys: bool = True) -> None:
        self.metrics, self.run_dir, self.sinks = Path(metrics), Path(run_dir), tuple(sinks)
        self.config, self.name, self.check_keys = dict(config or {}), name, check_keys
        self._tb = None
        self._wandb = None

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.run_dir / "wandb"

    def fresh(self) -> None:
        """Remove earlier TensorBoard and W&B files of this run directory (a fresh run, not a resumed one)."""
        for d in (self.tensorboard_dir, self.wandb_dir):
            if d.exists():
                shutil.rmtree(d)

    def log(self, record: dict[str, Any], jsonable: dict[str, Any]) -> None:
        """One step: ``jsonable`` (the record made JSON-friendly) to the JSONL file, its numbers to the others."""
        if self.check_keys:
            missing = [k for k in COMMON_KEYS if k not in record]
            if missing:
                raise ArgumentError(f"record: every loop logs {COMMON_KEYS} (None where not measured), got a "
                                    f"record without {missing}")
        write_line(self.metrics, jsonable)
        step = int(record["step"]) if "step" in record else None
        nums = scalars(jsonable)
        if "tensorboard" in self.sinks:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.tensorboard_dir))
            for k, v in nums.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        if "wandb" in self.sinks:
            self._wandb_run().log(nums, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        """The run's summary numbers into W&B's run summary (TensorBoard has none; the JSON file has them all)."""
        if "wandb" in self.sinks:
            self._wandb_run().summary.update(scalars(summary))

    def _wandb_run(self):
        if self._wandb is None:
            # offline, always: a run never reaches the network (no upload, no error reporting, no version check)
            os.environ["WANDB_MODE"] = "offline"
            os.environ["WANDB_ERROR_REPORTING"] = "false"
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                mode="offline", dir=str(self.run_dir), project="rlblocks", name=self.name, config=self.config,
                settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False,
                                        x_disable_stats=True),
            )
        return self._wandb

    def close(self) -> None:
        """Flush and close the TensorBoard writer and finish the W&B run (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def write_line(path: Path, obj: dict[str, Any]) -> None:
    """Append ``obj`` to the JSONL file ``path`` as one line."""
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
