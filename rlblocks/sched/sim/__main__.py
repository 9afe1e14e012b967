"""The sizing CLI: ``python -m rlblocks.sched.sim --help``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from rlblocks.errors import ArgumentError

from .costs import Hardware, cpu_like, gpu_like
from .loops import simulate
from .workload import Lengths, Schedule, Workload

__all__ = ["main"]


def _ints(flag: str, words: list[str]) -> list[int]:
    try:
        return [int(w) for w in words]
    except ValueError:
        raise ArgumentError(f"{flag}: expected integers, got {' '.join(words)[:80]!r}") from None


def _size(args: argparse.Namespace) -> None:
    hw = gpu_like(args.model, devices_per_engine=args.tp) if args.hardware == "gpu" else cpu_like()
    if args.hardware_json:
        with open(args.hardware_json) as f:
            hw = Hardware.from_dict(json.load(f))
    if args.lengths_file:
        with open(args.lengths_file) as f:
            lengths = Lengths.empirical(_ints("--lengths-file", f.read().split()))
    else:
        lengths = Lengths.lognormal(args.median, args.p99, maximum=args.max_len)
    work = Workload(lengths=lengths, prompt_lengths=Lengths.fixed(args.prompt_len), batch_groups=args.batch,
                    group_size=args.group_size, zero_variance_p=args.zero_variance_p, seed=args.seed)
    total = args.devices
    tp = hw.devices_per_engine
    if args.splits:
        splits = _ints("--splits", args.splits.split(","))
    else:  # eighths of the devices, rounded to whole engines
        splits = sorted({max(tp, min(total - 1, round(total * i / 8 / tp) * tp)) for i in range(1, 8)})
    for r in splits:
        if not 0 < r < total or r % tp:
            raise ArgumentError(f"splits: expected rollout device counts in (0, {total}) that are multiples of "
                                f"--tp={tp}, got {r}")
    etas = _ints("--etas", args.etas.split(","))
    print(f"{hw.name}; {total} devices; B={args.batch} groups × K={args.group_size}; lengths {lengths.describe()}; "
          f"{args.steps} steps ({args.warmup} warm-up)", flush=True)
    base = Schedule(steps=args.steps, warmup_steps=args.warmup, dynamic_sampling=args.dynamic_sampling)
    colo = simulate(hw, work, replace(base, mode="sync-colocated"), rollout_devices=total // 2,
                    train_devices=total - total // 2)
    rows = [("sync-colocated", total, total, None, colo)]
    print(f"  {'sync-colocated':<19} all {total} devices: {colo.steady_tokens_per_s:>12,.0f} tok/s", flush=True)
    best = None
    for partial in ([True, False] if args.both_partial else [True]):
        for eta in etas:
            for r in splits:
                res = simulate(hw, work, replace(base, mode="async", max_staleness=eta, partial_rollout=partial),
                               rollout_devices=r, train_devices=total - r)
                rows.append(("async", r, total - r, eta, res))
                gain = res.steady_tokens_per_s / colo.steady_tokens_per_s
                print(f"  async η={eta} partial={int(partial)} rollout {r:>4} / train {total - r:>4}: "
                      f"{res.steady_tokens_per_s:>12,.0f} tok/s  ({gain:.2f}× colocated, rollout busy "
                      f"{res.utilisation['rollout_busy']:.2f}, train busy {res.utilisation['train_busy']:.2f}, "
                      f"dropped {res.samples['dropped']})", flush=True)
                if best is None or res.steady_tokens_per_s > best[-1].steady_tokens_per_s:
                    best = ("async", r, total - r, eta, res)
    _, r, t, eta, res = best
    print(f"best: η={eta}, {r} rollout + {t} training devices, partial rollout={res.partial_rollout}: "
          f"{res.steady_tokens_per_s:,.0f} trained tok/s = {res.steady_tokens_per_s / colo.steady_tokens_per_s:.2f}× "
          f"synchronous colocated; staleness histogram {res.staleness_histogram}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"mode": m, "rollout": a, "train": b, "eta": e, **asdict(x)} for m, a, b, e, x in rows], f,
                      indent=1, default=str)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m rlblocks.sched.sim",
        description="Size an RL deployment: simulate synchronous colocated RL and bounded-async RL for every "
                    "rollout/training split and staleness bound η, print trained tokens/s, and the best η and split.",
        epilog="Costs are a model (see rlblocks.sched.sim.gpu_like for the defaults and their sources); measure "
               "yours and pass --hardware-json. Example: python -m rlblocks.sched.sim --model 7b --devices 128 "
               "--median 2048 --p99 32768",
    )
    ap.add_argument("--model", default="7b", help="preset shapes: 1.5b, 7b, 14b, 32b (Qwen2.5)")
    ap.add_argument("--hardware", choices=("gpu", "cpu"), default="gpu", help="gpu-like or cpu-like cost model")
    ap.add_argument("--hardware-json", default="",
                    help="a Hardware JSON (e.g. written by benchmarks/sim/measure_cpu_costs.py)")
    ap.add_argument("--tp", type=int, default=1, help="devices per rollout engine (tensor parallel)")
    ap.add_argument("--devices", type=int, default=128, help="total devices to split between rollout and training")
    ap.add_argument("--splits", default="", help="rollout device counts to try (default: eighths of --devices)")
    ap.add_argument("--etas", default="0,1,2,4", help="staleness bounds to try")
    ap.add_argument("--both-partial", action="store_true", help="also try without partial rollout")
    ap.add_argument("--dynamic-sampling", action="store_true", help="filter zero-variance groups (max_rounds 4)")
    ap.add_argument("--zero-variance-p", type=float, default=0.0, help="probability that a group's rewards are equal")
    ap.add_argument("--median", type=float, default=2048, help="median response length (tokens)")
    ap.add_argument("--p99", type=float, default=32768, help="99th percentile response length")
    ap.add_argument("--max-len", type=int, default=32768, help="response budget (lengths are clamped to it)")
    ap.add_argument("--lengths-file", default="", help="whitespace-separated observed lengths (replaces the lognormal)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="prompt groups per optimizer step (B)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (K)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write every simulated configuration here")
    args = ap.parse_args(argv)
    try:
        _size(args)
    except ArgumentError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
