"""What the reward machinery costs, measured side by side in one run: ``python benchmarks/reward/bench.py``.

Rows (each against the plain way of doing the same work, in the same process, interleaved ``--repeats`` times;
the median is reported):

- ``pool``: :class:`~rlblocks.reward.RewardPool` over ``--n`` calls of an async reward that returns at once,
  against ``asyncio.gather`` of the same calls (no bound, no timeout, no accounting): µs per sample, ratio.
- ``math``: :data:`~rlblocks.reward.math_reward`-style checks (GSM8K-like and LaTeX answers) through a
  :class:`~rlblocks.reward.MathReward` with ``--workers`` worker processes (started and warmed before timing),
  against :func:`~rlblocks.reward.check_math` in this process, one after another: checks per second, ratio.
- ``code``: one sandboxed test of :data:`~rlblocks.reward.code_reward` (a fresh limited interpreter), against
  ``subprocess.run([python, "-I", "-c", program])`` with no limits: ms per test, ratio.

Figures depend on the machine and its load; the ratios are the comparable part.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from rlblocks.reward import CodeReward, CodeTest, MathReward, RewardPool, Sample, check_math

_MATH = [
    ("so she has 48 + 24 = 72 clips", "#### 72"),
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{5\\text{ cm}}", "5"),
    ("\\boxed{4}", "3"),
    ("\\boxed{(1, 2)}", "(1,2)"),
]


async def _instant(sample: Sample) -> float:
    return 1.0


def bench_pool(n: int, repeats: int) -> dict:
    samples = [Sample("x")] * n
    pool = RewardPool(_instant, max_concurrency=64, timeout=60)

    async def plain() -> None:
        await asyncio.gather(*(_instant(s) for s in samples))

    t_pool, t_plain = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        asyncio.run(pool.ascore(samples))
        t_pool.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        asyncio.run(plain())
        t_plain.append(time.perf_counter() - t0)
    a, b = statistics.median(t_pool), statistics.median(t_plain)
    return {"row": "pool", "unit": "us/sample", "rlblocks": 1e6 * a / n, "plain": 1e6 * b / n, "ratio": a / b}


def bench_math(n: int, workers: int, repeats: int) -> dict:
    samples = [Sample(r, ref) for r, ref in (_MATH * (n // len(_MATH) + 1))[:n]]
    rw = MathReward(timeout=60, workers=workers)

    async def run_all():
        return await asyncio.gather(*(rw(s) for s in samples))

    asyncio.run(run_all())  # start and warm every worker
    for s in samples[: len(_MATH)]:
        check_math(s.response, s.reference)  # warm this process's caches too
    t_rw, t_local = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = asyncio.run(run_all())
        t_rw.append(time.perf_counter() - t0)
        assert all(r.ok for r in out)
        t0 = time.perf_counter()
        for s in samples:
            check_math(s.response, s.reference)
        t_local.append(time.perf_counter() - t0)
    rw.close()
    a, b = statistics.median(t_rw), statistics.median(t_local)
    return {"row": f"math ({workers} workers)", "unit": "checks/s", "rlblocks": n / a, "plain": n / b,
            "ratio": b / a}


def bench_code(n: int, repeats: int) -> dict:
    program = "a, b = map(int, input().split())\nprint(a + b)"
    reward = CodeReward()
    sample = Sample(program, [CodeTest(stdin="2 3", stdout="5")] * n)
    t_rw, t_plain = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = asyncio.run(reward(sample))
        t_rw.append(time.perf_counter() - t0)
        assert r.score == 1.0, r
        t0 = time.perf_counter()
        for _ in range(n):
            subprocess.run([sys.executable, "-I", "-c", program], input="2 3", capture_output=True, text=True,
                           check=True)
        t_plain.append(time.perf_counter() - t0)
    a, b = statistics.median(t_rw), statistics.median(t_plain)
    return {"row": "code (1 test)", "unit": "ms/test", "rlblocks": 1e3 * a / n, "plain": 1e3 * b / n,
            "ratio": a / b}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="samples of the pool row (default 2000)")
    ap.add_argument("--math-n", type=int, default=120, help="checks of the math row (default 120)")
    ap.add_argument("--code-n", type=int, default=10, help="tests of the code row (default 10)")
    ap.add_argument("--workers", type=int, default=2, help="math worker processes (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the median is kept (default 3)")
    ap.add_argument("--rows", default="pool,math,code", help="comma-separated subset of pool,math,code")
    args = ap.parse_args(argv)
    rows = []
    wanted = set(args.rows.split(","))
    if "pool" in wanted:
        rows.append(bench_pool(args.n, args.repeats))
    if "math" in wanted:
        rows.append(bench_math(args.math_n, args.workers, args.repeats))
    if "code" in wanted:
        rows.append(bench_code(args.code_n, args.repeats))
    print(f"{'row':<18} {'unit':<10} {'rlblocks':>10} {'plain':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['row']:<18} {r['unit']:<10} {r['rlblocks']:>10.1f} {r['plain']:>10.1f} {r['ratio']:>7.2f}")
    return rows


if __name__ == "__main__":
    main()
