"""Bad arguments to rlblocks.reward raise ArgumentError naming the argument: never a raw TypeError from inside, never
a silent reinterpretation (an unknown comparison read as "exact", a truthy string read as True)."""

from __future__ import annotations

import asyncio
import math

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.reward import (
    CodeReward,
    CodeTest,
    MathReward,
    ProcessWorkers,
    RewardPool,
    RewardResult,
    Sample,
    check_math,
    outputs_match,
)
from rlblocks.reward.pool import as_result


async def instant(sample):
    return 1.0


BAD = [
    # code rewards
    ("compare", lambda: outputs_match("1", "1 ", "bogus")),  # fell through to "exact"
    ("got", lambda: outputs_match(1, "1")),
    ("expected", lambda: outputs_match("1", None)),
    ("stdin", lambda: CodeTest(stdin=None, stdout="x")),
    ("stdin", lambda: CodeTest.of({"input": "1", "stdin": "2", "output": "x"})),  # which one was meant?
    ("stdout", lambda: CodeTest.of({"output": "1", "stdout": "2"})),
    ("assertion", lambda: CodeTest.of({"assert": "assert 1", "assertion": "assert 2"})),
    ("extract", lambda: CodeReward(extract="no")),  # truthy: would have extracted
    ("concurrency", lambda: CodeReward(concurrency=2.0)),
    ("python", lambda: CodeReward(python=3)),
    # the pool
    ("samples", lambda: RewardPool(instant).score(Sample("x"))),  # not a list of samples
    ("samples", lambda: RewardPool(instant).score(None)),
    ("samples", lambda: RewardPool(instant).score(5)),
    ("timeout", lambda: RewardPool(instant, timeout=math.inf)),
    ("max_concurrency", lambda: RewardPool(instant, max_concurrency=1.5)),
    # math
    ("strict", lambda: MathReward(strict="no")),  # truthy: would have meant strict
    ("float_rounding", lambda: check_math("5", "5", float_rounding=True)),
    ("numeric_precision", lambda: check_math("5", "5", numeric_precision=0)),
    ("timeout", lambda: MathReward(timeout=math.nan)),
    # worker processes: an infinite deadline overflowed select() in the worker thread
    ("start_timeout", lambda: ProcessWorkers(1, start_timeout=math.inf)),
    ("timeout", lambda: ProcessWorkers(1).run(print, timeout=math.inf)),
    ("python", lambda: ProcessWorkers(1, python=5)),
    ("response_len", lambda: Sample("x", response_len=3.0)),
]


@pytest.mark.parametrize(("arg", "call"), BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_refused_and_named(arg, call):
    with pytest.raises(ArgumentError, match=arg):
        call()


def test_integer_and_real_types_callers_really_pass_are_accepted():
    np = pytest.importorskip("numpy")
    assert Sample("x", response_len=np.int64(3)).response_len == 3
    assert type(Sample("x", response_len=np.int64(3)).response_len) is int
    assert as_result(np.float32(0.5)) == RewardResult(0.5)  # a numpy score is a score, not an invalid return
    with pytest.raises(ArgumentError):
        as_result(np.bool_(True))
    assert RewardPool(instant, max_concurrency=np.int64(2)).max_concurrency == 2
    assert CodeTest.of({"input": None, "output": "x"}).stdin == ""  # a null input in a dataset: no input


def test_one_unencodable_sample_fails_alone_in_its_batch(tiny_rm_dir):
    """An empty text (no token) used to fail every concurrent sample batched with it."""
    pytest.importorskip("transformers")
    from rlblocks.reward import RewardModel

    rm = RewardModel.from_pretrained(tiny_rm_dir, batch_size=8, max_wait=0.05)
    samples = [Sample("5", prompt="2+3="), Sample("", prompt=""), Sample("42", prompt="6*7=")]
    with pytest.raises(ArgumentError, match="at least one token"):  # this tokenizer adds no BOS: no token at all
        rm.encode([""], [""])

    async def main():
        return await asyncio.gather(*(rm(s) for s in samples))

    good1, bad, good2 = asyncio.run(main())
    assert not bad.ok and "at least one token" in bad.error
    ref = rm.score(["2+3=", "6*7="], ["5", "42"])
    assert good1.ok and good2.ok
    assert good1.score == pytest.approx(float(ref[0]), abs=1e-5) and good2.score == pytest.approx(float(ref[1]),
                                                                                                  abs=1e-5)
