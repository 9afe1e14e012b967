"""Trained tokens/s of synchronous vs bounded-async GRPO on the same hardware and the same long-tailed lengths.

    .venv/bin/python benchmarks/cookbook/async_vs_sync.py [--steps 30] [--median-len 5] [--model DIR]

Both loops run the CPU demo task with ``--length-tail M``: every prompt group gets a response budget drawn from a
lognormal with median M and σ = 0.99 (p99/p50 ≈ 10) and no stop token, so each sample is exactly that long (the
reward still reads the answer up to the first EOS). Runs, one after another on this machine:

- sync: ``grpo_sync.py`` in one process (generate, then train, then push weights);
- async η = 1, 2, 4: ``torchrun --nproc_per_node 2 grpo_async.py`` (1 trainer rank + 1 rollout rank).

Reported per run: trained tokens/s = Σ tokens_trained / Σ step_seconds over the steps after the first two (warm-up
excluded), the ratio to sync, and the final held-out accuracy. Goal: async ≥ 2× sync at η ≤ 2, accuracy no worse.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-4000:]}")


def tokens_per_s(run_dir: Path) -> tuple[float, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return sum(r["tokens_trained"] for r in rows) / sum(r["step_seconds"] for r in rows), summary["accuracy_after"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--median-len", type=float, default=5.0)  # p99 ≈ 50 tokens: fits the tiny model (64 positions)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)  # the figures in the README were measured with 8
    ap.add_argument("--model", default="", help="HF checkpoint dir (default: the cached warm start)")
    ap.add_argument("--runs-dir", default="runs/bench")
    args = ap.parse_args()
    # one optimizer update per batch in both loops (the async demo defaults to 2 epochs × 2 mini-batches), so the
    # ratio compares the loops' scheduling, not different amounts of training work
    common = ["--ppo-epochs", "1", "--mini-batches", "1", "--steps", str(args.steps), "--length-tail",
              str(args.median_len), "--prompts-per-step", str(args.prompts_per_step), "--group-size",
              str(args.group_size), "--runs-dir", args.runs_dir, "--time-limit", "0", "--eval-every",
              str(args.steps), "--quiet", *(["--model", args.model] if args.model else [])]
    results = {}
    run([sys.executable, str(ROOT / "cookbook" / "grpo_sync.py"), "--name", "sync", *common])
    results["sync"] = tokens_per_s(Path(args.runs_dir) / "sync")
    for eta in (1, 2, 4):
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(ROOT / "cookbook" / "grpo_async.py"), "--name", f"async{eta}", "--max-staleness", str(eta),
             "--save-every", "0", *common])
        results[f"async η={eta}"] = tokens_per_s(Path(args.runs_dir) / f"async{eta}")
    base = results["sync"][0]
    print(f"{'loop':<12}{'tokens/s':>12}{'vs sync':>10}{'held-out acc':>15}")
    for k, (tps, acc) in results.items():
        print(f"{k:<12}{tps:>12.1f}{tps / base:>9.2f}x{acc:>15.3f}")
    out = Path(args.runs_dir) / "async_vs_sync.json"
    out.write_text(json.dumps({k: {"tokens_per_s": v[0], "ratio": v[0] / base, "accuracy_after": v[1]}
                               for k, v in results.items()}, indent=2))
    print(out)


if __name__ == "__main__":
    main()
