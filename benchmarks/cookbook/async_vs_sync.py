"""Trained tokens/s of synchronous vs bounded-async GRPO on the same hardware and the same long-tailed lengths.

    .venv/bin/python benchmarks/cookbook/async_vs_sync.py [--steps 160] [--reps 3] [--median-len 5] [--model DIR]

Both loops run the CPU demo task with ``--length-tail M``: every prompt group gets a response budget drawn from a
lognormal with median M and σ = 0.99 (p99/p50 ≈ 10) and no stop token, so each sample is exactly that long (the
reward still reads the answer up to the first EOS).

Processes and threads (a fair comparison gives every loop the same ones; the historical baseline did not):

- ``sync-1p``: ``grpo_sync.py`` in ONE process with 2 torch threads (generate, then train, then push weights) —
  a baseline that gives sync fewer processes than async;
- ``sync-2p``: ``torchrun --nproc_per_node 2 grpo_sync.py``, 2 processes × 1 thread, colocated (each rank generates
  half the groups with its own engine, then both train one FSDP2 step) — same processes and threads as async;
- ``sync-disagg``: ``torchrun --nproc_per_node 2 grpo_async.py --max-staleness 0``, 2 processes × 1 thread
  (1 trainer + 1 rollout rank), η = 0 is synchronous RL on the disaggregated layout — same code, processes and
  threads as async;
- ``async1`` / ``async2`` / ``async4``: the same with η = 1, 2, 4.

Thread counts are pinned with ``OMP_NUM_THREADS`` (``grpo_async.py`` also sets ``cpu_count // world`` = 1 itself).

Repetitions are interleaved (``sync-1p, sync-2p, …, async4`` then again), because the load of a small CPU machine
drifts: adjacent runs see similar load, so each ratio is computed within one repetition and the median over
repetitions is reported (with the min–max range). Trained tokens/s = Σ tokens_trained / Σ step_seconds over the
steps after the first two (warm-up) and before the last (whose time includes the held-out evaluation).

Stability: each variant's spread ``(max − min) / min`` over its repetitions is printed with the ratios; under 10 %
the variant is stable. 40-step runs (11–26 s) are too short for that on a 2-core CPU (one η = 4 run measured twice
the tokens/s of the next), hence the default of 160 steps. The 1-minute load average before and after every run and the
cores that other work used during it (the machine's busy CPU seconds from ``/proc/stat`` minus the run's own, per
wall second) are printed and stored: a ratio measured while other work shares the cores is not a property of the
loops.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ("sync-1p", "sync-2p", "sync-disagg")


def variant_command(name: str, common: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and thread environment of one variant (see the module docstring)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if name == "sync-1p":
        return [sys.executable, str(ROOT / "cookbook" / "grpo_sync.py"), *common], {"OMP_NUM_THREADS": "2",
                                                                                      "MKL_NUM_THREADS": "2"}
    if name == "sync-2p":
        return [*torchrun, str(ROOT / "cookbook" / "grpo_sync.py"), *common], one
    eta = 0 if name == "sync-disagg" else int(name.removeprefix("async"))
    return [*torchrun, str(ROOT / "cookbook" / "grpo_async.py"), "--max-staleness", str(eta), "--save-every", "0",
            *common], one


def busy_cpu_seconds() -> float | None:
    """CPU seconds every core of the machine has been busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq, steal); None where there is no ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children (and theirs: torchrun waits for its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str], threads: dict[str, str]) -> tuple[float, list[float], float | None]:
    """Run one loop; returns its wall seconds, the 1-minute load average before and after it, and the cores that
    OTHER work used meanwhile: (CPU seconds the machine was busy − the loop's own processes') / wall seconds. The
    load average lags by a minute and counts the previous run's processes; this does not."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    before = os.getloadavg()[0]
    busy0, own0 = busy_cpu_seconds(), children_cpu_seconds()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    busy1, own1 = busy_cpu_seconds(), children_cpu_seconds()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-4000:]}")
    other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return wall, [before, os.getloadavg()[0]], other


def measure(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[2:-1]
    if not timed:
        raise RuntimeError(f"{run_dir}: need at least 4 steps (2 warm-up, 1 timed, 1 with the evaluation)")
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens = sum(r["tokens_trained"] for r in timed)
    seconds = sum(r["step_seconds"] for r in timed)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "steps": len(timed),
            "accuracy_after": summary["accuracy_after"], "staleness": _hist(timed),
            "samples_generated": summary.get("samples_generated"), "samples_trained": summary.get("samples_trained")}


STABLE = 0.10  # a variant's repetitions agree within this: (max − min) / min


def spread(values: list[float]) -> float:
    """``(max − min) / min`` of a variant's tokens/s over its repetitions (NaN for fewer than two: unknown)."""
    return (max(values) - min(values)) / min(values) if len(values) > 1 and min(values) > 0 else float("nan")


def _hist(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("staleness_hist", {}).items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--steps", type=int, default=160, help="steps per run (40-step runs, 11–26 s, move by 2× "
                    "between repetitions on a 2-core CPU)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every variant")
    ap.add_argument("--median-len", type=float, default=5.0)  # p99 ≈ 50 tokens: fits the tiny model (64 positions)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)  # the figures in docs/benchmarks.md were measured with 8
    ap.add_argument("--variants", default="sync-1p,sync-2p,sync-disagg,async1,async2,async4",
                    help="comma-separated subset of: sync-1p, sync-2p, sync-disagg, async<η>")
    ap.add_argument("--model", default="", help="HF checkpoint dir (default: the cached warm start)")
    ap.add_argument("--runs-dir", default="runs/bench")
    ap.add_argument("--out", default="", help="results JSON (default: <runs-dir>/async_vs_sync.json)")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in BASELINES and not (v.startswith("async") and v.removeprefix("async").isdigit()):
            ap.error(f"--variants: unknown variant {v!r}")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        for v in variants:
            name = f"{v}-r{rep}"
            # one optimizer update per batch in every loop (the demo defaults to 2 epochs x 2 mini-batches), so
            # the ratio compares the loops' scheduling, not different amounts of training work
            common = ["--name", name, "--ppo-epochs", "1", "--mini-batches", "1",
                      "--steps", str(args.steps), "--length-tail", str(args.median_len),
                      "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
                      "--runs-dir", args.runs_dir, "--time-limit", "0", "--eval-every", str(args.steps), "--quiet",
                      *(["--model", args.model] if args.model else [])]
            cmd, threads = variant_command(v, common)
            wall, load, other = run(cmd, threads)
            m = measure(Path(args.runs_dir) / name)
            m["wall_s"], m["threads"], m["loadavg"], m["other_cores"] = wall, threads["OMP_NUM_THREADS"], load, other
            results[v].append(m)
            print(f"rep {rep} {v:<12} {m['tokens_per_s']:8.1f} tokens/s  ({wall:.0f} s wall, load average "
                  f"{load[0]:.1f} before, {load[1]:.1f} after; other work: "
                  f"{'unknown' if other is None else f'{other:.2f} cores'})", flush=True)
    bases = [b for b in BASELINES if b in results]
    header = f"{'loop':<12}{'procs×thr':>10}{'tokens/s (median [min–max])':>32}{'spread':>8}" + "".join(
        f"{'vs ' + b:>16}" for b in bases) + f"{'held-out acc':>14}"
    print(f"\n{args.reps} interleaved repetitions, {args.steps} steps each (timed: steps 3..{args.steps - 1})")
    print(header)
    summary: dict[str, dict] = {}
    for v, ms in results.items():
        tps = [m["tokens_per_s"] for m in ms]
        procs = "1×2" if v == "sync-1p" else "2×1"
        ratios = {b: statistics.median(m["tokens_per_s"] / results[b][i]["tokens_per_s"] for i, m in enumerate(ms))
                  for b in bases}
        acc = statistics.median(m["accuracy_after"] for m in ms)
        line = f"{v:<12}{procs:>10}{statistics.median(tps):>14.1f} [{min(tps):7.1f} – {max(tps):7.1f}]"
        line += f"{spread(tps):>8.0%}" if len(tps) > 1 else f"{'n/a':>8}"
        line += "".join(f"{ratios[b]:>15.2f}x" for b in bases) + f"{acc:>14.3f}"
        print(line)
        summary[v] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s": tps, "spread": spread(tps),
                      "ratio_median": ratios, "accuracy_after_median": acc, "runs": ms}
    worst = max(spread([m["tokens_per_s"] for m in ms]) for ms in results.values())
    loads = [x for ms in results.values() for m in ms for x in m["loadavg"]]
    stable = "one repetition: unknown" if args.reps < 2 else f"{worst:.0%} ({'' if worst < STABLE else 'NOT '}stable)"
    others = [m["other_cores"] for ms in results.values() for m in ms if m["other_cores"] is not None]
    print(f"largest spread between repetitions of one variant: {stable}, goal < {STABLE:.0%}; load average "
          f"{min(loads):.1f}–{max(loads):.1f} over the runs; other work "
          + (f"{max(others):.2f} cores at most" if others else "unknown"))
    out = Path(args.out or Path(args.runs_dir) / "async_vs_sync.json")
    out.write_text(json.dumps({"config": vars(args), "variants": summary}, indent=2))
    print(out)


if __name__ == "__main__":
    main()
