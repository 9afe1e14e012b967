"""The benchmark module runs (tiny sizes) and its rows compare like with like."""

from rlblocks.reward.bench import main


def test_bench_runs_and_reports_ratios():
    rows = main(["--rows", "pool,code", "--n", "50", "--code-n", "1", "--repeats", "1"])
    assert [r["row"] for r in rows] == ["pool", "code (1 test)"]
    for r in rows:
        assert r["rlblocks"] > 0 and r["plain"] > 0 and r["ratio"] > 0
