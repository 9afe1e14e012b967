"""Padding fraction of packing vs plain padding on long-tailed lengths, and DP balance of Karmarkar–Karp vs greedy.

Run: .venv/bin/python benchmarks/sched/bench_packing.py [--n 1024 --max-tokens 16384 --seeds 5]
Lengths: lognormal with sigma 0.99 (p99/p50 ~ 10), median ~400 tokens, clipped to [1, 8192].
Padding fraction = 1 - real tokens / allocated token slots (rows x padded length, or bins x max_tokens).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rlblocks.sched import balance_partitions, pack_sequences, token_budget_microbatches


def lengths_for(n, seed):
    rng = random.Random(seed)
    return [min(8192, max(1, round(rng.lognormvariate(6.0, 0.99)))) for _ in range(n)]


def padded_cost(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def greedy_sums(lengths, k):
    sums = [0] * k
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        b = min(range(k), key=lambda j: sums[j])
        sums[b] += lengths[i]
    return sums


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--dp", type=int, default=8)
    args = ap.parse_args()
    T = args.max_tokens
    acc: dict[str, list[tuple[float, int]]] = {}
    ratios, kk_ratio, gr_ratio, t_pack, t_kk = [], [], [], [], []

    def add(name, real, slots, n_mb):
        acc.setdefault(name, []).append((1 - real / slots, n_mb))

    for seed in range(args.seeds):
        lens = lengths_for(args.n, seed)
        s = sorted(lens)
        ratios.append(s[int(0.99 * len(s))] / s[len(s) // 2])
        real = sum(lens)
        # plain padding: fixed-count micro-batches in arrival order, each padded to its longest sequence, with the
        # count chosen so the average micro-batch holds about max_tokens real tokens
        per_mb = max(1, round(T / statistics.mean(lens)))
        fixed = [list(range(i, min(i + per_mb, len(lens)))) for i in range(0, len(lens), per_mb)]
        add("plain padding, fixed count ~ max_tokens/mean", real, padded_cost(lens, fixed), len(fixed))
        add("pad whole batch to the global max", real, len(lens) * max(lens), 1)
        mbs = token_budget_microbatches(lens, max_tokens=T, padded=True)
        add("token_budget_microbatches(padded=True)", real, padded_cost(lens, mbs), len(mbs))
        order = sorted(range(len(lens)), key=lambda i: lens[i])
        srt = token_budget_microbatches([lens[i] for i in order], max_tokens=T, padded=True)
        add("  same, lengths sorted first", real, padded_cost([lens[i] for i in order], srt), len(srt))
        mbs = token_budget_microbatches(lens, max_tokens=T)
        add("token_budget_microbatches (packed)", real, len(mbs) * T, len(mbs))
        t0 = time.perf_counter()
        bins = pack_sequences(lens, max_tokens=T)
        t_pack.append(time.perf_counter() - t0)
        add("pack_sequences FFD (packed)", real, len(bins) * T, len(bins))
        t0 = time.perf_counter()
        parts = balance_partitions(lens, args.dp)
        t_kk.append(time.perf_counter() - t0)
        sums = [sum(lens[i] for i in p) for p in parts]
        kk_ratio.append(max(sums) / min(sums))
        g = greedy_sums(lens, args.dp)
        gr_ratio.append(max(g) / min(g))

    print(f"n={args.n} sequences, max_tokens={T}, {args.seeds} seeds; p99/p50 = {statistics.mean(ratios):.1f}")
    width = max(len(k) for k in acc)
    print(f"{'layout':<{width}}  padding fraction   micro-batches (mean)")
    for name, vals in acc.items():
        frac, count = statistics.mean(v[0] for v in vals), statistics.mean(v[1] for v in vals)
        print(f"{name:<{width}}  {frac:16.3f}   {count:8.1f}")
    print(f"pack_sequences time: {statistics.mean(t_pack) * 1e3:.2f} ms for {args.n} sequences")
    print(
        f"balance_partitions into {args.dp}: max/min = {statistics.mean(kk_ratio):.5f} (KK) vs "
        f"{statistics.mean(gr_ratio):.5f} (LPT greedy); worst KK {max(kk_ratio):.5f}; "
        f"{statistics.mean(t_kk) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
