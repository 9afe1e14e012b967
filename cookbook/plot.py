"""Plot a run's curves: ``python cookbook/plot.py runs/<name>`` writes ``runs/<name>/curves.png`` and prints its path.

Panels: mean reward and held-out accuracy per step; trained tokens/s; staleness (max and mean token age); seconds per
step split into queue wait, train and weight sync. Reads ``metrics.jsonl`` (and ``summary.json`` for the title).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"run_dir: {run_dir}/metrics.jsonl has no rows")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return rows, summary


def plot(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows, summary = load(run_dir)
    step = [r["step"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    a = ax[0, 0]
    a.plot(step, [r["reward"] for r in rows], label="train reward (mean)", alpha=0.6)
    ev = [(r["step"], r["heldout_acc"]) for r in rows if r.get("heldout_acc") is not None]
    if summary.get("accuracy_before") is not None:
        ev = [(0, summary["accuracy_before"]), *ev]
    if ev:
        a.plot(*zip(*ev), "o-", label="held-out accuracy (greedy)")
    a.set_xlabel("step")
    a.set_ylim(0, 1)
    a.legend()
    a = ax[0, 1]
    a.plot(step, [r.get("tokens_per_s", 0) for r in rows])
    a.set_xlabel("step")
    a.set_ylabel("trained tokens / s")
    a = ax[1, 0]
    ages = []
    for r in rows:
        h = {int(k): v for k, v in (r.get("staleness_hist") or {}).items()}
        n = sum(h.values()) or 1
        ages.append((max(h) if h else 0, sum(k * v for k, v in h.items()) / n))
    a.plot(step, [x[0] for x in ages], label="max token age")
    a.plot(step, [x[1] for x in ages], label="mean token age")
    a.set_xlabel("step")
    a.set_ylabel("versions")
    a.legend()
    a = ax[1, 1]
    for key in ("queue_wait_seconds", "train_seconds", "sync_seconds", "generate_seconds"):
        if any(key in r for r in rows):
            a.plot(step, [r.get(key, 0) for r in rows], label=key.removesuffix("_seconds"))
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.legend()
    title = run_dir.name
    if summary:
        title += (f": held-out {summary.get('accuracy_before', 0):.2f} → {summary.get('accuracy_after', 0):.2f} in "
                  f"{summary.get('wall_seconds', 0):.0f} s, η={summary.get('max_staleness')}")
    fig.suptitle(title)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plot a run's curves into <run_dir>/curves.png (and print its path).")
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl (e.g. runs/demo)")
    print(plot(ap.parse_args(argv).run_dir))


if __name__ == "__main__":
    main()
