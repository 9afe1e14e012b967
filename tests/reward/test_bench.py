"""The reward benchmark (``benchmarks/reward/bench.py``) runs (tiny sizes) and its rows compare like with like."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "reward" / "bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("reward_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_runs_and_reports_ratios():
    rows = _bench().main(["--rows", "pool,code", "--n", "50", "--code-n", "1", "--repeats", "1"])
    assert [r["row"] for r in rows] == ["pool", "code (1 test)"]
    for r in rows:
        assert r["rlblocks"] > 0 and r["plain"] > 0 and r["ratio"] > 0
