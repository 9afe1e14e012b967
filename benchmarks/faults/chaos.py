"""Chaos run of bounded-async GRPO: kill ranks of a ``grpo_async.py`` run at random times and measure what survives.

    .venv/bin/python benchmarks/faults/chaos.py [--kills 4] [--steps 150] [--save-every 5] [--seed 0] [--model DIR]

The loop runs under ``torchrun --standalone --nproc_per_node 2 --max-restarts K`` (1 trainer rank, 1 rollout
rank). The benchmark kills, with SIGKILL and by pid (the worker whose ``RANK`` is the victim's), the rollout rank,
then the trainer rank, then the rollout rank, ... each at a random step between one and two checkpoint intervals
after the run last resumed. torchrun restarts the group, and the loop resumes from its last checkpoint by itself.

Printed (and written to ``<runs-dir>/<name>/chaos.json``):

- **restarts survived**: kills, and restarts the run reports (``summary.json``);
- **samples lost**: ``samples_lost_in_crash`` (groups the trainer had received after its last checkpoint), next to
  generated / trained / dropped stale / failed reward / left in the queue; the conservation ``generated = trained +
  dropped stale + failed reward + lost + left`` and "no group trained twice" are checked, as is the staleness
  bound η on every trained token;
- **steps redone**: steps trained after the last checkpoint by a run that was then killed;
- **time to recover**, per kill: to the restarted run's start (its journal line) and to its first trained step
  (its first new row of ``metrics.jsonl``), from the kill.

Without ``--model`` the loop warm-starts the demo model (cached under ``runs/warmstart``, built on the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def last_step(run: Path) -> int:
    rows = read_lines(run / "metrics.jsonl")
    return rows[-1]["step"] if rows else 0


def starts(run: Path) -> list[dict]:
    return [r for r in read_lines(run / "journal.jsonl") if r.get("event") == "start"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--kills", type=int, default=4, help="ranks killed, alternately the rollout and the trainer rank")
    ap.add_argument("--steps", type=int, default=150, help="trainer steps of the run")
    ap.add_argument("--save-every", type=int, default=5, help="checkpoint interval in steps (grpo_async --save-every)")
    ap.add_argument("--max-staleness", type=int, default=1, help="η of the run (grpo_async --max-staleness)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (and of the run)")
    ap.add_argument("--model", default="", help="HF model directory (default: the demo model)")
    ap.add_argument("--runs-dir", default=str(ROOT / "runs"), help="directory of run folders")
    ap.add_argument("--name", default="chaos", help="run name: outputs in <runs-dir>/<name>/")
    ap.add_argument("--extra", default="", help="more flags for grpo_async.py, one string")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    run = Path(args.runs_dir) / args.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(args.kills + 1), str(ROOT / "cookbook" / "grpo_async.py"), "--name", args.name,
           "--runs-dir", args.runs_dir, "--steps", str(args.steps), "--save-every", str(args.save_every),
           "--max-staleness", str(args.max_staleness), "--seed", str(args.seed), "--eval-every", "0", "--quiet",
           *(["--model", args.model] if args.model else []), *args.extra.split()]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    run.mkdir(parents=True, exist_ok=True)
    for old in ("metrics.jsonl", "journal.jsonl", "summary.json"):  # an earlier run's: not this one's progress
        (run / old).unlink(missing_ok=True)
    log = open(run / "chaos.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    kills: list[dict] = []
    resumed_at = 0
    for k in range(args.kills):
        victim_rank = 1 if k % 2 == 0 else 0  # the rollout rank, then the trainer rank, alternately
        target = resumed_at + rng.randint(args.save_every, 2 * args.save_every)
        if target >= args.steps:
            break
        while proc.poll() is None and last_step(run) < target:
            time.sleep(0.05)
        victims = [c for c in children(proc.pid) if rank_of(c) == victim_rank]
        if proc.poll() is not None or not victims:
            break
        n_starts = len(starts(run))
        os.kill(victims[0], signal.SIGKILL)
        t_kill = time.time()
        at = last_step(run)
        while proc.poll() is None and len(starts(run)) == n_starts:  # the restarted run's start line
            time.sleep(0.05)
        if proc.poll() is not None:
            break
        start = starts(run)[-1]
        resumed_at = int(start["step"])
        while proc.poll() is None and last_step(run) <= resumed_at:  # its first trained step
            time.sleep(0.05)
        t_step = time.time()
        kills.append({"rank": victim_rank, "at_step": at, "resumed_from": resumed_at,
                      "restart_seconds": start["time"] - t_kill, "recover_seconds": t_step - t_kill})
        print(f"kill {k + 1}: rank {victim_rank} at step {at}; resumed from step {resumed_at}, "
              f"{start['time'] - t_kill:.1f} s to the restart, {t_step - t_kill:.1f} s to the next trained step",
              flush=True)
    rc = proc.wait()
    if rc != 0:
        sys.exit(f"the run failed (exit status {rc}); see {log.name}")
    s = json.loads((run / "summary.json").read_text())
    rows = read_lines(run / "metrics.jsonl")
    trained = [u for r in rows for u in r["trained_uids"]]
    checks = {
        "steps": [r["step"] for r in rows] == list(range(1, args.steps + 1)),
        "conservation": s["samples_generated"] == (s["samples_trained"] + s["samples_dropped_stale"]
                                                   + s["samples_failed_reward"] + s["samples_lost_in_crash"]
                                                   + s["samples_left_in_queue"]),
        "no_group_trained_twice": len(trained) == len(set(trained)),
        "staleness_bound": s["max_staleness_seen"] <= args.max_staleness
        and all(max(int(a) for a in r["staleness_hist"]) <= args.max_staleness for r in rows),
        "restarts_reported": s["restarts"] == len(kills),
    }
    out = {
        "kills": len(kills), "restarts": s["restarts"], "steps": s["steps"], "wall_seconds": time.time() - t0,
        **{k: s[k] for k in ("samples_generated", "samples_trained", "samples_dropped_stale",
                             "samples_failed_reward", "samples_lost_in_crash", "samples_left_in_queue", "steps_redone",
                             "max_staleness_seen")},
        "lost_fraction": s["samples_lost_in_crash"] / max(s["samples_generated"], 1),
        "restart_seconds_median": statistics.median([k["restart_seconds"] for k in kills]) if kills else None,
        "recover_seconds_median": statistics.median([k["recover_seconds"] for k in kills]) if kills else None,
        "recover_seconds_max": max((k["recover_seconds"] for k in kills), default=None),
        "per_kill": kills, "checks": checks, "accuracy_before": s["accuracy_before"],
        "accuracy_after": s["accuracy_after"],
    }
    (run / "chaos.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"restarts survived: {s['restarts']} of {len(kills)} kills; steps {s['steps']}/{args.steps}")
    print(f"samples: generated {s['samples_generated']} = trained {s['samples_trained']} + dropped stale "
          f"{s['samples_dropped_stale']} + failed reward {s['samples_failed_reward']} + lost in crashes "
          f"{s['samples_lost_in_crash']} "
          f"({100 * out['lost_fraction']:.1f} %) + left in queue {s['samples_left_in_queue']}; "
          f"steps redone {s['steps_redone']}")
    if kills:
        print(f"time to recover: {out['restart_seconds_median']:.1f} s to the restart, "
              f"{out['recover_seconds_median']:.1f} s to the next trained step (median; max "
              f"{out['recover_seconds_max']:.1f} s)")
    print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
