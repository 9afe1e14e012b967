"""Plot a run's curves: ``python cookbook/plot.py runs/<name>`` writes ``runs/<name>/curves.png`` and prints its path.

Panels: mean reward and held-out accuracy per step; trained tokens/s; staleness (max and mean token age); seconds per
step split into queue wait, train and weight sync; and, for a disaggregated loop that logs them, where the rollout
ranks' time goes per weight version (decode, prefill, re-prefill after interrupts, the engine's other work, weight
load, idle: stacked) and the decode batch size with the tokens re-prefilled per update. Reads ``metrics.jsonl``
(and ``summary.json`` for the title).

Per-step series are drawn twice: the raw values faint, and over them the smoothed curve of :func:`smooth` (the
exponential moving average TensorBoard draws, debiased so that it starts at the first value), whose weight grows
with the run's length (:func:`smoothing_weight`), so a 1200-step run's throughput and timing panels show trends
instead of noise. Held-out accuracy (a few evaluations) is drawn as measured.
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


def smoothing_weight(n: int) -> float:
    """The EMA weight for a series of ``n`` points: 0 (no smoothing) up to 25 points, then ``1 − 25/n`` (an
    effective window of about ``n/25`` points), at most 0.98."""
    return 0.0 if n <= 25 else min(0.98, 1.0 - 25.0 / n)


def smooth(values: list[float | None], weight: float) -> list[float | None]:
    """Debiased exponential moving average: ``m_t = w·m_{t−1} + (1 − w)·x_t``, ``s_t = m_t / (1 − w^k)`` after
    ``k`` values (so ``s`` starts at the first value instead of near 0). ``None`` (a step without the metric) is
    skipped and stays ``None``; ``w = 0`` returns the values."""
    out: list[float | None] = []
    m, k = 0.0, 0
    for x in values:
        if x is None:
            out.append(None)
            continue
        m, k = weight * m + (1.0 - weight) * x, k + 1
        out.append(m / (1.0 - weight**k) if weight > 0 else x)
    return out


def _curve(ax, step: list[int], values: list[float | None], label: str, color: str) -> None:
    """``values`` faint and their smoothed curve over them, in one colour, one legend entry."""
    pts = [(s, v) for s, v in zip(step, values) if v is not None]
    if not pts:
        return
    xs, ys = zip(*pts)
    w = smoothing_weight(len(ys))
    if w > 0:
        ax.plot(xs, ys, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(xs, smooth(list(ys), w), color=color, label=f"{label} (smoothed)")
    else:
        ax.plot(xs, ys, color=color, label=label)


def plot(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows, summary = load(run_dir)
    step = [r["step"] for r in rows]
    rollout = [r for r in rows if r.get("rollout_seconds") is not None]
    fig, ax = plt.subplots(3 if rollout else 2, 2, figsize=(11, 10.5 if rollout else 7))
    colors = [f"C{i}" for i in range(10)]
    a = ax[0, 0]
    _curve(a, step, [r["reward"] for r in rows], "train reward (mean)", colors[0])
    ev = [(r["step"], r["heldout_acc"]) for r in rows if r.get("heldout_acc") is not None]
    if summary.get("accuracy_before") is not None:
        ev = [(0, summary["accuracy_before"]), *ev]
    if ev:
        a.plot(*zip(*ev), "o-", color=colors[1], label="held-out accuracy")
    a.set_xlabel("step")
    a.set_ylim(0, 1)
    a.legend()
    a = ax[0, 1]
    _curve(a, step, [r.get("tokens_per_s") for r in rows], "trained tokens / s", colors[0])
    a.set_xlabel("step")
    a.set_ylabel("trained tokens / s")
    a = ax[1, 0]
    ages = []
    for r in rows:
        h = {int(k): v for k, v in (r.get("staleness_hist") or {}).items()}
        n = sum(h.values()) or 1
        ages.append((max(h) if h else 0, sum(k * v for k, v in h.items()) / n))
    a.plot(step, [x[0] for x in ages], color=colors[0], label="max token age")
    _curve(a, step, [x[1] for x in ages], "mean token age", colors[1])
    a.set_xlabel("step")
    a.set_ylabel("versions")
    a.legend()
    a = ax[1, 1]
    for i, key in enumerate(("queue_wait_seconds", "train_seconds", "sync_seconds", "generate_seconds")):
        if any(r.get(key) is not None for r in rows):
            _curve(a, step, [r.get(key) for r in rows], key.removesuffix("_seconds"), colors[i])
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.legend()
    if rollout:
        _rollout_panels(ax[2, 0], ax[2, 1], rollout)
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


ROLLOUT_PARTS = ("decode", "prefill", "reprefill", "engine_other", "weight_load", "idle")


def _rollout_panels(a, b, rows: list[dict]) -> None:
    """The rollout ranks' seconds per part (stacked, per line: each line's intervals, mean over the ranks), and the
    mean and max decode batch with the tokens re-prefilled after interrupts (right axis)."""
    step = [r["step"] for r in rows]
    a.stackplot(step, *[[r[f"rollout_{p}_seconds"] for r in rows] for p in ROLLOUT_PARTS],
                labels=[p.replace("_", " ") for p in ROLLOUT_PARTS], alpha=0.8)
    a.plot(step, [r["step_seconds"] for r in rows], color="k", linewidth=0.8, label="trainer step")
    a.set_xlabel("step")
    a.set_ylabel("rollout seconds")
    a.legend(fontsize=7, ncol=2)
    b.plot(step, [r["decode_batch_mean"] for r in rows], color="C0", label="decode batch (mean)")
    b.plot(step, [r["decode_batch_max"] for r in rows], color="C0", alpha=0.4, label="decode batch (max)")
    b.set_xlabel("step")
    b.set_ylabel("sequences per decode step")
    b.legend(loc="upper left", fontsize=7)
    c = b.twinx()
    c.plot(step, [r["reprefill_tokens"] for r in rows], color="C3", label="tokens re-prefilled")
    c.set_ylabel("tokens re-prefilled", color="C3")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plot a run's curves into <run_dir>/curves.png (and print its path).")
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl (e.g. runs/demo)")
    print(plot(ap.parse_args(argv).run_dir))


if __name__ == "__main__":
    main()
