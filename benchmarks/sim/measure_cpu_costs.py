"""Measure the simulator's CPU cost model from the real TorchEngine and the cookbook's trainer step on this machine.

    .venv/bin/python benchmarks/sim/measure_cpu_costs.py [--reps 5] [--threads 1,2] [--out runs/sim/cpu_costs.json]
    .venv/bin/python benchmarks/sim/measure_cpu_costs.py --quick    # CI: a few configurations, the fit, a simulation

What is timed (with the cookbook's tiny warm-start model, the model the async/sync benchmark runs):

- rollout: ``TorchEngine.generate`` of ``b`` concurrent requests of the demo prompts with exactly ``L`` new tokens
  (no stop token), for ``b`` in 1..128 and ``L`` in 6..56. The engine prefills all ``b`` in its first step (which
  samples token 1) and decodes ``L - 1`` steps; a least-squares fit (non-negative) of the wall time gives the
  decode step ``overhead + per_seq·b + per_ctx·C`` (:class:`rlblocks.sched.sim.DecodeCost` with no memory terms: a
  CPU is compute/overhead bound).
- prefill: one-token ``generate`` calls of ``b`` requests whose prompts have ``g`` distinct lengths spread over
  7..57 tokens (what re-prefilling interrupted requests looks like: prompt + output so far), for ``b`` in 8..256
  and ``g`` in 1..32; fit ``overhead·F + per_token·Σ_f rows_f·max_f`` over the engine's ``F`` left-padded forwards
  (:class:`rlblocks.sched.sim.PrefillCost` with ``padded=True`` and the engine's token budget: identical prompts
  once, sorted by length, cut at the budget).
- trainer: the cookbook's step (``batch_tensors``, then ``grpo_step`` with one optimizer update per batch:
  advantages, log-probs, loss, global normalisers, backward, grad clip, AdamW) on batches of ``G`` groups × 8
  samples of length ``L``; fit ``overhead + per_token·S·W + per_seq·S`` with ``W`` the padded width (the batch is
  right-padded), i.e. ``TrainCost(padded=True)``.
- weight sync: ``full_tensors`` + ``TorchEngine.update_weights`` (the tiny model's bytes are negligible: latency).
- host contention: the same generate call timed alone and while a second process runs trainer steps non-stop
  (both 1 thread), alternately, with one child process toggled between busy and idle so that each pair is
  measured seconds apart; ``host_contention = median(together / alone) − 1``
  (:attr:`rlblocks.sched.sim.Hardware.host_contention`: on a small machine that also runs other work, two
  busy processes slow each other even with a core each).

Each thread count in ``--threads`` (torch intra-op threads; the cookbook's async loop runs 1 per process) gives one
:class:`rlblocks.sched.sim.Hardware`. The engine's costs and the trainer's are measured in separate processes, one
per thread count, as the loops run them (a process that only trains, one that only generates). Timings on a small
CPU machine are noisy: every configuration is measured ``--reps`` times, interleaved (all of a process's
configurations once, in a shuffled order, then again), and the median is fitted, so a burst of load from other
processes spreads over all configurations instead of biasing one. The fit residuals are printed; the JSON holds the
raw timings too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# the cookbook's modules import each other by name (their folder is sys.path[0] when a loop runs as a script)
sys.path.insert(0, str(ROOT / "cookbook"))

import toy  # noqa: E402
from grpo import grpo_step  # noqa: E402
from plumbing import PolicyLogprobs, batch_tensors, group_record, load_hf  # noqa: E402

from rlblocks.rollout import Generation, GenerationRequest, SamplingParams  # noqa: E402
from rlblocks.rollout.engines import TorchEngine  # noqa: E402
from rlblocks.rollout.engines.torch_compute import PREFILL_TOKEN_BUDGET  # noqa: E402
from rlblocks.sched.sim import DecodeCost, Hardware, PrefillCost, SyncCost, TrainCost  # noqa: E402
from rlblocks.sync import full_tensors  # noqa: E402

GEN_B = (1, 8, 32, 64, 128)
GEN_L = (6, 24, 56)
PREFILL_B = (8, 64, 256)
PREFILL_G = (1, 8, 32)
TRAIN_G = (4, 8, 16, 24)
TRAIN_L = (6, 24, 50)
K = 8


def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with non-negative coefficients (drop a negative one, refit, until none is negative)."""
    n = len(rows[0])
    active = list(range(n))
    while True:
        a = torch.tensor([[r[j] for j in active] for r in rows], dtype=torch.float64)
        sol = torch.linalg.lstsq(a, torch.tensor(y, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1).tolist()
        neg = [j for j, c in zip(active, sol) if c < 0]
        if not neg:
            out = [0.0] * n
            for j, c in zip(active, sol):
                out[j] = c
            return out
        active.remove(min(neg, key=lambda j: sol[active.index(j)]))


class Bench:
    def __init__(self, path: str) -> None:
        self.tok, lm = load_hf(path, torch.device("cpu"))
        self.engine = TorchEngine(load_hf(path, torch.device("cpu"))[1], max_batch_size=1024)
        self.policy = PolicyLogprobs(lm.train(), 1.0)
        self.optim = torch.optim.AdamW(self.policy.parameters(), lr=1e-6)
        self.pairs = toy.split_pairs()["rl"]
        self.loop = asyncio.new_event_loop()
        self.version = 0
        from grpo_async import Config

        # one optimizer update per batch (the cost model's unit); the engine samples with the trainer's weights and
        # dtype, so no train/rollout correction (what ``check_engine_flags`` resolves ``auto`` to here)
        self.cfg = Config(ppo_epochs=1, mini_batches=1, correction="none")
        self.prompt_lens: list[int] = []

    def generate(self, b: int, length: int, rng: random.Random) -> tuple[float, int]:
        prompts = [toy.encode_prompt(self.tok, *rng.choice(self.pairs)) for _ in range(b)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=length, stop_token_ids=())

        async def go():
            reqs = [GenerationRequest(f"m{time.monotonic_ns()}-{i}", p, sp) for i, p in enumerate(prompts)]
            return await asyncio.gather(*[self.engine.generate(r) for r in reqs])

        t0 = time.perf_counter()
        gens = self.loop.run_until_complete(go())
        dt = time.perf_counter() - t0
        assert all(len(g.output_ids) == length for g in gens), "a generation stopped early"
        return dt, sum(len(p) for p in prompts)

    def prefill(self, b: int, g: int, rng: random.Random) -> tuple[float, list[tuple[int, int]]]:
        """One-token generation of ``b`` requests whose prompts (a demo prompt, then random token ids) have ``g``
        distinct lengths in 7..57: the engine's first step prefills them all and samples their only token. Returns
        the seconds and ``(rows, longest)`` of each padded forward the engine ran (identical prompts once)."""
        lengths = [7 + (50 * (i % g)) // max(1, g - 1) for i in range(b)]
        prompts = []
        for n in lengths:
            p = toy.encode_prompt(self.tok, *rng.choice(self.pairs))[:n]
            prompts.append(p + [rng.randrange(4, 16) for _ in range(n - len(p))])
        sp = SamplingParams(temperature=1.0, max_new_tokens=1, stop_token_ids=())

        async def go():
            reqs = [GenerationRequest(f"p{time.monotonic_ns()}-{i}", p, sp) for i, p in enumerate(prompts)]
            return await asyncio.gather(*[self.engine.generate(r) for r in reqs])

        t0 = time.perf_counter()
        self.loop.run_until_complete(go())
        unique = [len(p) for p in {tuple(p): None for p in prompts}]
        return time.perf_counter() - t0, PrefillCost(padded=True, token_budget=PREFILL_TOKEN_BUDGET).forwards(unique)

    def train(self, groups: int, length: int, rng: random.Random) -> tuple[float, int, int]:
        recs = []
        for gi in range(groups):
            pair = rng.choice(self.pairs)
            prompt = toy.encode_prompt(self.tok, *pair)
            gens = [Generation(f"t{gi}/{k}", prompt, [rng.randrange(4, 16) for _ in range(length)],
                               [-1.0] * length, [0] * length, "length") for k in range(K)]
            recs.append(group_record(f"g{gi}", pair, prompt, gens, [float(rng.random() < 0.5) for _ in range(K)], 0))
        t0 = time.perf_counter()
        bt = batch_tensors(recs, self.tok.pad_token_id, torch.device("cpu"))
        grpo_step(self.cfg, self.policy, self.optim, bt)
        dt = time.perf_counter() - t0
        return dt, bt["input_ids"].shape[0], bt["input_ids"].shape[1]

    def close(self) -> None:
        """Stop the engine's step task on its own loop (else it is destroyed pending at exit)."""
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()

    def sync(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        tensors = [(n.removeprefix("lm."), t) for n, t in full_tensors(self.policy)]
        self.version += 1
        self.loop.run_until_complete(self.engine.update_weights(tensors, version=self.version))
        return time.perf_counter() - t0, float(sum(t.numel() * t.element_size() for _, t in tensors))


def _busy_trainer(path: str, ready, go, busy, stop) -> None:
    """Child process: while ``go`` is set, trainer steps back to back (the load of an async trainer); ``busy``
    mirrors whether it is working, so the parent times "alone" and "together" only once the child has settled."""
    torch.set_num_threads(1)
    bench = Bench(path)
    rng = random.Random(1)
    bench.train(8, 24, rng)
    ready.set()
    while not stop.is_set():
        if go.wait(0.05):
            busy.set()
            bench.train(16, 24, rng)
        else:
            busy.clear()
    bench.close()


def measure_contention(bench: Bench, path: str, reps: int, rng: random.Random) -> tuple[float, list[float]]:
    """``median(together / alone) − 1`` for a 1-thread generate call, alone vs beside a busy trainer process,
    alternating ``reps`` times with the same child process (so each pair is measured seconds apart)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    torch.set_num_threads(1)
    ready, go, busy, stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=_busy_trainer, args=(path, ready, go, busy, stop), daemon=True)
    child.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the busy trainer process did not start")
        ratios = []
        for _ in range(reps):
            go.clear()
            while busy.is_set():
                time.sleep(0.01)
            alone = sum(bench.generate(64, 24, rng)[0] for _ in range(5))  # ~1 s: averages sub-second load bursts
            go.set()
            busy.wait(60)
            time.sleep(0.05)
            together = sum(bench.generate(64, 24, rng)[0] for _ in range(5))
            ratios.append(together / alone)
    finally:
        stop.set()
        go.set()
        child.join(60)
        if child.is_alive():
            child.kill()
    return max(0.0, statistics.median(ratios) - 1.0), ratios


def fit(samples: dict, prompt_len: float) -> dict:
    """Fit the engine and trainer coefficients of one thread count from median timings."""
    gen_rows, gen_y = [], []
    for (b, length), ts in samples["gen"].items():
        p = prompt_len
        steps = length - 1
        ctx = sum(b * (p + 1 + j) for j in range(steps))  # step j attends to b·(prompt + 1 + j) tokens
        gen_rows.append([1.0, b * p, steps, b * steps, ctx])
        gen_y.append(statistics.median(ts))
    _p0, _p1, a, c_seq, c_ctx = nnls(gen_rows, gen_y)  # the first two: the prompts' prefill (fitted below)
    pre_rows, pre_y = [], []
    for vals in samples["prefill"].values():  # reps differ only in which prompts repeat (rarely): medians
        pre_rows.append([statistics.median(len(v[1]) for v in vals),
                         statistics.median(sum(r * m for r, m in v[1]) for v in vals)])
        pre_y.append(statistics.median(v[0] for v in vals))
    p0, p1 = nnls(pre_rows, pre_y)
    train_rows, train_y = [], []
    for (_, _), vals in samples["train"].items():
        ts = [v[0] for v in vals]
        s, w = vals[0][1], vals[0][2]
        train_rows.append([1.0, s * w, s])
        train_y.append(statistics.median(ts))
    o, c_tok, c_s = nnls(train_rows, train_y)
    sync_s = statistics.median(samples["sync"])

    def resid(rows, y, coef):
        return [(sum(r * c for r, c in zip(row, coef)) - t) / t for row, t in zip(rows, y)]

    return {
        "decode": DecodeCost(overhead_s=a, host_per_seq_s=c_seq, compute_per_token_s=c_ctx),
        "prefill": PrefillCost(overhead_s=p0, per_token_s=p1, padded=True, token_budget=PREFILL_TOKEN_BUDGET),
        "train": TrainCost(overhead_s=o, per_token_s=c_tok, per_seq_s=c_s, padded=True),
        "sync": SyncCost(latency_s=sync_s),
        "gen_residuals": resid(gen_rows, gen_y, [_p0, _p1, a, c_seq, c_ctx]),
        "prefill_residuals": resid(pre_rows, pre_y, [p0, p1]),
        "train_residuals": resid(train_rows, train_y, [o, c_tok, c_s]),
    }


ROLES = ("engine", "train")  # the jobs of a rollout process and of a trainer process


def measure(path: str, threads: int, role: str, reps: int, seed: int) -> dict:
    """Timings of one role's configurations at one thread count, ``reps`` times each in a shuffled order (a load
    burst spreads over all configurations instead of biasing one)."""
    torch.set_num_threads(threads)
    bench = Bench(path)
    rng = random.Random(seed)
    samples: dict = {"gen": {}, "prefill": {}, "train": {}, "sync": []}
    if role == "engine":
        jobs = [("gen", b, n) for b in GEN_B for n in GEN_L] + [("prefill", b, g) for b in PREFILL_B
                                                                 for g in PREFILL_G if g <= b] + [("sync", 0, 0)]
        bench.generate(8, 6, rng)  # warm-up: first calls allocate and build the kernels' dispatch paths
        bench.sync()
    else:
        jobs = [("train", g, n) for g in TRAIN_G for n in TRAIN_L]
        bench.train(4, 6, rng)
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    for rep in range(reps):
        order = list(jobs)
        rng.shuffle(order)
        for kind, x, n in order:
            if kind == "gen":
                samples["gen"].setdefault((x, n), []).append(bench.generate(x, n, rng)[0])
            elif kind == "prefill":
                samples["prefill"].setdefault((x, n), []).append(bench.prefill(x, n, rng))
            elif kind == "train":
                samples["train"].setdefault((x, n), []).append(bench.train(x, n, rng))
            else:
                samples["sync"].append(bench.sync()[0])
        print(f"{role} ({threads} thread{'s' if threads > 1 else ''}): rep {rep + 1}/{reps} done "
              f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    bench.close()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every configuration")
    ap.add_argument("--threads", default="1,2", help="torch thread counts to measure (one Hardware each)")
    ap.add_argument("--runs-dir", default="runs/bench", help="where the cookbook's warm start is cached")
    ap.add_argument("--model", default="", help="HF checkpoint dir to measure (default: the cached warm start)")
    ap.add_argument("--out", default="runs/sim/cpu_costs.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contention-reps", type=int, default=8, help="alone/together pairs (0: assume none)")
    ap.add_argument("--role", choices=ROLES, default=None, help=argparse.SUPPRESS)  # a child process's part
    ap.add_argument("--quick", action="store_true",
                    help="CI: one rep of a few configurations, 1 thread, no contention pairs; checks that the fit "
                         "gives a Hardware the simulator runs, never the costs' values")
    args = ap.parse_args()
    global GEN_B, GEN_L, PREFILL_B, PREFILL_G, TRAIN_G, TRAIN_L
    if args.quick:
        args.reps, args.threads, args.contention_reps = 1, "1", 0
        GEN_B, GEN_L, PREFILL_B, PREFILL_G, TRAIN_G, TRAIN_L = (1, 8, 32), (6, 12), (8, 32), (1, 8), (2, 4), (6, 12)
    threads = [int(x) for x in args.threads.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = args.model or toy.warm_start(os.path.join(args.runs_dir, "warmstart"))
    if args.role:  # a child: one thread count, one role, its timings to --out
        samples = measure(path, threads[0], args.role, args.reps, args.seed)
        Path(args.out).write_text(json.dumps({k: [[list(c), v] for c, v in d.items()] if isinstance(d, dict) else d
                                              for k, d in samples.items()}))
        return
    # each (thread count, role) in a process of its own, as the loops run them: a trainer process only trains, a
    # rollout process only generates, at a fixed thread count (one process timing both, switching its thread count,
    # measured the trainer step ~20 % slower than a trainer process runs it)
    samples = {t: {"gen": {}, "prefill": {}, "train": {}, "sync": []} for t in threads}
    with tempfile.TemporaryDirectory() as tmp:
        for t in threads:
            for role in ROLES:
                part = Path(tmp, f"{role}-{t}.json")
                env = dict(os.environ, OMP_NUM_THREADS=str(t), MKL_NUM_THREADS=str(t))
                subprocess.run([sys.executable, __file__, "--role", role, "--threads", str(t), "--reps",
                                str(args.reps), "--runs-dir", args.runs_dir, "--seed", str(args.seed), "--out",
                                str(part), "--model", path, *(["--quick"] if args.quick else [])], check=True,
                               env=env)
                for kind, d in json.loads(part.read_text()).items():
                    if kind == "sync":
                        samples[t]["sync"] += d
                    else:
                        samples[t][kind].update({tuple(c): v for c, v in d})
    bench = Bench(path)
    rng = random.Random(args.seed)
    prompt_len = statistics.mean(len(toy.encode_prompt(bench.tok, *p)) for p in bench.pairs)
    contention, ratios = (measure_contention(bench, path, args.contention_reps, rng) if args.contention_reps
                          else (0.0, []))
    bench.close()
    print(f"host contention: together/alone = {' '.join(f'{r:.2f}' for r in ratios)} -> c = {contention:.2f}")
    out: dict = {"prompt_len_mean": prompt_len, "reps": args.reps, "hardware": {}, "raw": {},
                 "contention_ratios": ratios, "loadavg": os.getloadavg()}
    for t in threads:
        f = fit(samples[t], prompt_len)
        hw = Hardware(name=f"cpu measured ({t} torch thread{'s' if t > 1 else ''}, tiny demo model)",
                      decode=f["decode"], prefill=f["prefill"], train=f["train"], sync=f["sync"],
                      sync_colocated=f["sync"], weight_bytes=0.0, kv_capacity_tokens=1 << 30, max_batch=1024,
                      host_contention=contention,
                      notes=(f"measured by benchmarks/sim/measure_cpu_costs.py, {args.reps} reps",))
        out["hardware"][str(t)] = hw.to_dict()
        out["raw"][str(t)] = {"gen": {f"{b}x{n}": v for (b, n), v in samples[t]["gen"].items()},
                              "train": {f"{g}x{n}": v for (g, n), v in samples[t]["train"].items()},
                              "prefill": {f"{b}x{g}": v for (b, g), v in samples[t]["prefill"].items()},
                              "sync": samples[t]["sync"]}
        d, p, tr = f["decode"], f["prefill"], f["train"]
        print(f"\n{t} thread(s):")
        print(f"  decode step = {d.overhead_s * 1e3:.3f} ms + {d.host_per_seq_s * 1e6:.2f} us·b "
              f"+ {d.compute_per_token_s * 1e9:.2f} ns·context")
        print(f"  prefill     = {p.overhead_s * 1e3:.3f} ms·forward + {p.per_token_s * 1e6:.2f} us·padded token "
              f"(forwards of at most {p.token_budget} padded tokens, identical prompts once)")
        print(f"  train step  = {tr.overhead_s * 1e3:.1f} ms + {tr.per_token_s * 1e6:.2f} us·padded token "
              f"+ {tr.per_seq_s * 1e6:.1f} us·sequence")
        print(f"  weight sync = {f['sync'].latency_s * 1e3:.2f} ms")
        print("  relative residuals: generate " + " ".join(f"{r:+.2f}" for r in f["gen_residuals"]))
        print("                      prefill  " + " ".join(f"{r:+.2f}" for r in f["prefill_residuals"]))
        print("                      train    " + " ".join(f"{r:+.2f}" for r in f["train_residuals"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(args.out)
    if args.quick:
        check_round_trip(out)
        print("quick: ok")


def check_round_trip(out: dict) -> None:
    """The written costs load back as the same :class:`Hardware` and drive a short asynchronous simulation that
    trains every sample it generates (the pipeline ``calibrate.py`` relies on)."""
    from rlblocks.sched.sim import Lengths, Schedule, Workload, simulate

    for t, d in out["hardware"].items():
        hw = Hardware.from_dict(json.loads(json.dumps(d)))
        if hw.to_dict() != d:
            raise SystemExit(f"quick: the {t}-thread Hardware does not round-trip through JSON")
        res = simulate(hw, Workload(lengths=Lengths.cycle([6, 30]), prompt_lengths=Lengths.fixed(7), batch_groups=2,
                                    group_size=K), Schedule(mode="async", max_staleness=1, steps=4, warmup_steps=1),
                       rollout_devices=1, train_devices=1)
        if not res.steady_tokens_per_s > 0:
            raise SystemExit(f"quick: the simulation with the measured {t}-thread costs trained nothing: {res}")


if __name__ == "__main__":
    main()
