"""Does the simulator, given the CPU costs measured here, predict the measured async/sync ratios? Side by side.

    .venv/bin/python benchmarks/sim/calibrate.py --run 4 [--steps 160]     # measure and benchmark, interleaved
    .venv/bin/python benchmarks/sim/calibrate.py --costs C1.json,C2.json --measured M1.json,M2.json
    .venv/bin/python benchmarks/sim/calibrate.py --quick    # CI: the whole pipeline, tiny, no ratio judged

``--run R`` repeats R times: measure the cost model (``measure_cpu_costs.py``, one pass over every configuration),
then run every variant of ``benchmarks/cookbook/async_vs_sync.py`` once. Cost measurement and benchmark are
interleaved because the load of a small CPU machine drifts over minutes: each repetition's prediction uses
the costs measured just before its runs, each ratio (measured and predicted) is taken within one repetition, and the
medians over repetitions are compared. Expect noise; the min–max over repetitions and each variant's spread are
printed. The ratios need a quiet machine: the cores other work used during every benchmark run (the machine's busy
CPU time from ``/proc/stat`` minus the run's own) are printed, and when other work shared the cores
(``--max-other``) the script says so and reports no ratio.

Each variant is simulated on the layout it ran on (a "device" is one process with its torch threads):

- ``sync-1p``     → ``sync-colocated`` on 1 device with the 2-thread costs;
- ``sync-2p``     → ``sync-colocated`` on 2 devices (2 engines, training split over 2 devices), 1-thread costs;
- ``sync-disagg`` → ``sync-disaggregated``, 1 rollout + 1 training device, 1-thread costs;
- ``async<η>``    → ``async`` with that η and partial rollout, 1 + 1 devices, 1-thread costs,

all with the measured host contention, and the benchmark's workload: B groups × K samples, one length per group
drawn as the cookbook's ``--length-tail`` does (lognormal median M, σ = 0.99, at least ``max_new_tokens`` = 6, at
most 200, cut at the tiny model's 64 positions), the demo's prompt lengths, and throughput over the same steps
(3 .. N-1). It reports the largest error of a predicted async/sync ratio against ``--tolerance`` (15 %).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlblocks.sched.sim import Hardware, Lengths, Schedule, Workload, simulate  # noqa: E402

MODEL_POSITIONS = 64
BASELINES = ("sync-1p", "sync-2p", "sync-disagg")


def cookbook_lengths(median: float, n: int, seed: int) -> list[int]:
    """The cookbook's ``length_budget``: ``max(6, min(round(lognormvariate(ln M, 0.99)), 200))``, then cut at the
    positions the tiny model has left after the most common prompt (7 tokens: BOS and ``"ab+cd="``)."""
    rng = random.Random(seed)
    cap = MODEL_POSITIONS - 7
    return [min(cap, max(6, min(round(rng.lognormvariate(math.log(median), 0.99)), 200))) for _ in range(n)]


def demo_prompt_lengths() -> list[int]:
    """BOS + the characters of ``"a+b="`` for every demo pair (a, b in [0, 100))."""
    return [1 + len(f"{a}+{b}=") for a in range(100) for b in range(100)]


def layout(variant: str) -> tuple[str, Schedule, int, int]:
    if variant == "sync-1p":
        return "2", Schedule(mode="sync-colocated"), 1, 0
    if variant == "sync-2p":
        return "1", Schedule(mode="sync-colocated"), 1, 1
    if variant == "sync-disagg":
        return "1", Schedule(mode="sync-disaggregated"), 1, 1
    eta = int(variant.removeprefix("async"))
    return "1", Schedule(mode="async", max_staleness=eta, partial_rollout=True), 1, 1


def predict(costs: dict, cfg: dict, variants: list[str]) -> dict[str, tuple[float, object]]:
    hardware = {t: Hardware.from_dict(h) for t, h in costs["hardware"].items()}
    work = Workload(lengths=Lengths.empirical(cookbook_lengths(cfg["median_len"], 20_000, seed=1)),
                    prompt_lengths=Lengths.empirical(demo_prompt_lengths()), batch_groups=cfg["prompts_per_step"],
                    group_size=cfg["group_size"], per_group_length=True)
    out = {}
    for v in variants:
        threads, sched, r, t = layout(v)
        if threads not in hardware:
            continue
        sched = Schedule(**{**sched.__dict__, "steps": cfg["steps"] - 1, "warmup_steps": 2})
        res = simulate(hardware[threads], work, sched, rollout_devices=r, train_devices=t)
        out[v] = (res.steady_tokens_per_s, res)
    return out


def run_interleaved(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    out = Path(args.runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    model: list[str] = []
    if args.quick:  # a warm start of a few steps: the pipeline runs, the model's quality does not matter here
        sys.path.insert(0, str(ROOT / "cookbook"))
        import toy

        model = ["--model", toy.warm_start(out / "warmstart", toy.WarmStart(max_steps=10), log=lambda s: None)]
    costs, measured = [], []
    for rep in range(args.run):
        c, m = out / f"costs-r{rep}.json", out / f"avs-r{rep}.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks/sim/measure_cpu_costs.py"), "--reps", "2",
                        "--contention-reps", "6", "--runs-dir", args.runs_dir, "--out", str(c), *model,
                        *(["--quick"] if args.quick else [])], check=True, env=env, cwd=ROOT)
        subprocess.run([sys.executable, str(ROOT / "benchmarks/cookbook/async_vs_sync.py"), "--reps", "1",
                        "--steps", str(args.steps), "--runs-dir", args.runs_dir, "--out", str(m), *model,
                        *(["--variants", args.variants] if args.variants else [])], check=True,
                       env=env, cwd=ROOT)
        costs.append(str(c))
        measured.append(str(m))
        print(f"repetition {rep + 1}/{args.run} done", flush=True)
    return costs, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--run", type=int, default=0, help="measure and benchmark this many interleaved repetitions")
    ap.add_argument("--steps", type=int, default=160, help="steps per benchmark run (with --run)")
    ap.add_argument("--max-load", type=float, default=1.0,
                    help="quiet box: 1-minute load average at most this before each run and this + 2 (the run's own "
                         "two processes) after it; otherwise no ratio is reported")
    ap.add_argument("--max-other", type=float, default=0.15,
                    help="quiet box: other work used at most this many cores on average during every run (measured "
                         "from /proc/stat minus the run's own CPU; runs recorded without it fall back to --max-load)")
    ap.add_argument("--variants", default="", help="async_vs_sync.py --variants (default: all of them)")
    ap.add_argument("--runs-dir", default="runs/sim", help="where --run writes (and the warm start is cached)")
    ap.add_argument("--costs", default="", help="comma-separated cost files (measure_cpu_costs.py), one per rep")
    ap.add_argument("--measured", default="", help="comma-separated async_vs_sync.py results, one per rep")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--per-rep-contention", action="store_true",
                    help="use each repetition's own contention estimate instead of the pooled median")
    ap.add_argument("--quick", action="store_true",
                    help="CI: a 10-step warm start, one repetition of quick costs and 6-step runs of sync-disagg and "
                         "async1; checks that every variant is measured and simulated, never the error")
    args = ap.parse_args()
    if args.quick:
        args.run, args.steps, args.variants = 1, 6, args.variants or "sync-disagg,async1"
    if args.run:
        costs_files, measured_files = run_interleaved(args)
    else:
        costs_files, measured_files = args.costs.split(","), args.measured.split(",")
        if not costs_files[0] or not measured_files[0]:
            ap.error("give --run R, or --costs and --measured")
    # one (costs, measured-rep) pair per repetition; a single cost file serves every repetition of a measured file
    pairs, loads = [], []
    for i, mf in enumerate(measured_files):
        m = json.loads(Path(mf).read_text())
        c = json.loads(Path(costs_files[min(i, len(costs_files) - 1)]).read_text())
        for rep in range(len(next(iter(m["variants"].values()))["runs"])):
            pairs.append((c, m["config"], {v: d["runs"][rep]["tokens_per_s"] for v, d in m["variants"].items()}))
            loads += [(v, d["runs"][rep].get("loadavg"), d["runs"][rep].get("other_cores"))
                      for v, d in m["variants"].items()]
    # Host contention is a property of the machine's load over the whole experiment, and one alone/together pair is
    # very noisy (load bursts are sub-second), so every pair of every repetition is pooled into one median.
    all_ratios = [r for c, _, _ in pairs for r in c.get("contention_ratios", [])]
    pooled_c = max(0.0, statistics.median(all_ratios) - 1.0) if all_ratios else 0.0
    if not args.per_rep_contention:
        for c, _, _ in pairs:
            for h in c["hardware"].values():
                h["host_contention"] = pooled_c
    cfg = pairs[0][1]
    variants = list(pairs[0][2])
    meas_tps: dict[str, list[float]] = {v: [] for v in variants}
    pred_tps: dict[str, list[float]] = {v: [] for v in variants}
    meas_ratio: dict[tuple[str, str], list[float]] = {}
    pred_ratio: dict[tuple[str, str], list[float]] = {}
    contention = []
    last = {}
    for c, pcfg, meas in pairs:
        pred = predict(c, pcfg, variants)
        contention.append(c["hardware"]["1"].get("host_contention", 0.0))
        for v in variants:
            meas_tps[v].append(meas[v])
            if v in pred:
                pred_tps[v].append(pred[v][0])
                last[v] = pred[v][1]
            for b in BASELINES:
                if b in meas and b in pred and v in pred:
                    meas_ratio.setdefault((v, b), []).append(meas[v] / meas[b])
                    pred_ratio.setdefault((v, b), []).append(pred[v][0] / pred[b][0])
    bases = [b for b in BASELINES if b in variants]
    med = statistics.median
    print(f"workload: B={cfg['prompts_per_step']} × K={cfg['group_size']}, cookbook lengths (median "
          f"{cfg['median_len']:g}), {cfg['steps']} steps per run; {len(pairs)} interleaved repetitions; host "
          f"contention c = {med(contention):.2f} (pooled median over {len(all_ratios)} alone/together pairs, "
          f"whose ratios range {min(all_ratios, default=1):.2f}–{max(all_ratios, default=1):.2f})")
    quiet, load_text = box_state(loads, args.max_load, args.max_other)
    print(f"other work during the benchmark runs: {load_text}")
    print(f"{'variant':<12}{'tok/s measured':>22}{'spread':>8}{'simulated':>11}" + "".join(
        f"{'÷ ' + b + ': measured':>28}{'simulated':>11}{'error':>7}" for b in bases))
    worst = 0.0
    worst_by: dict[str, float] = {}
    table = []
    for v in variants:
        mt = meas_tps[v]
        spread = f"{(max(mt) - min(mt)) / min(mt):.0%}" if len(mt) > 1 else "n/a"  # one repetition: unknown
        line = f"{v:<12}{med(mt):>9.0f} [{min(mt):>4.0f}–{max(mt):>4.0f}]{spread:>8}"
        line += f"{med(pred_tps[v]):>11.0f}" if pred_tps[v] else f"{'-':>11}"
        row = {"variant": v, "measured_tokens_per_s": med(mt), "simulated_tokens_per_s":
               med(pred_tps[v]) if pred_tps[v] else None}
        for b in bases:
            if (v, b) not in meas_ratio or not quiet:  # a loaded box: no ratio
                line += f"{'-':>28}{'-':>11}{'':>7}"
                continue
            mr, pr = meas_ratio[(v, b)], pred_ratio[(v, b)]
            err = med(pr) / med(mr) - 1
            if v.startswith("async"):
                worst = max(worst, abs(err))
                worst_by[b] = max(worst_by.get(b, 0.0), abs(err))
            line += f"{med(mr):>13.2f} [{min(mr):.2f}–{max(mr):.2f}]{med(pr):>11.2f}{err:>+7.0%}"
            row[f"ratio_vs_{b}"] = {"measured": med(mr), "simulated": med(pr), "error": err}
        table.append(row)
        print(line)
    if not quiet:
        print("the box was loaded (other work shared the cores during a run): no ratio reported. The "
              f"within-{args.tolerance:.0%} check needs a quiet box; the tokens/s above are what this box measured.")
    else:
        for base, e in worst_by.items():
            print(f"largest error of a predicted async/{base} ratio: {e:.0%} (tolerance {args.tolerance:.0%}) -> "
                  f"{'within' if e <= args.tolerance else 'NOT within'}")
        print(f"largest error of a predicted async/sync ratio over every baseline: {worst:.0%} -> "
              f"{'within' if worst <= args.tolerance else 'NOT within'}")
    for v, res in last.items():
        print(f"  {v:<12} simulated: rollout busy {res.utilisation['rollout_busy']:.2f}, train busy "
              f"{res.utilisation['train_busy']:.2f}, token ages {res.staleness_histogram}")
    if args.quick:
        missing = [v for v in variants if not (pred_tps[v] and all(x > 0 for x in pred_tps[v] + meas_tps[v]))]
        if missing:
            raise SystemExit(f"quick: no positive measured and simulated tokens/s for {missing}")
        print("quick: ok")
    if args.run:
        Path(args.runs_dir, "calibration.json").write_text(json.dumps({"quiet": quiet, "loadavg": loads,
                                                                        "table": table}, indent=1))


def box_state(loads: list[tuple[str, list[float] | None, float | None]], max_load: float,
              max_other: float) -> tuple[bool, str]:
    """Quiet when other work used at most ``max_other`` cores on average during every benchmark run (the machine's
    busy CPU time minus the run's own: exact, and blind to the run's own processes, which the load average counts
    for a minute after they end). Runs recorded without it fall back to the load average: quiet when every run
    started at a 1-minute load average ≤ ``max_load`` and ended ≤ ``max_load`` + 2 (its own two busy processes
    raise the average by up to 2). Runs without either (results written before they were recorded) count as
    loaded. Returns ``(quiet, a line describing the box)``."""
    others = [o for *_, o in loads if o is not None]
    if loads and len(others) == len(loads):
        quiet = max(others) <= max_other
        return quiet, (f"{min(others):.2f}–{max(others):.2f} cores over {len(others)} runs (at most {max_other:g} "
                       f"for a quiet box) -> {'quiet' if quiet else 'LOADED'}")
    known = [x for _, x, _ in loads if x]
    if not known:
        return False, "not recorded (the results predate it): treated as loaded"
    before, after = [x[0] for x in known], [x[1] for x in known]
    quiet = len(known) == len(loads) and max(before) <= max_load and max(after) <= max_load + 2
    return quiet, (f"not recorded; 1-minute load average before {min(before):.2f}–{max(before):.2f}, after "
                   f"{min(after):.2f}–{max(after):.2f} over {len(known)} runs -> {'quiet' if quiet else 'LOADED'}")


if __name__ == "__main__":
    main()
