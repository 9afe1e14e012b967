"""Combinators: weighted sums keep every component; the overlong penalty is the one formula of rlblocks.losses."""

import asyncio
import math

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.losses.masks import overlong_penalty
from rlblocks.reward import FormatReward, OverlongPenalty, RewardPool, RewardResult, Sample, WeightedReward

R1 = r"<think>.*?</think>\s*<answer>.*?</answer>"


async def const(sample):
    return RewardResult(0.25, {"inner": 7.0})


async def length(sample):
    return float(len(sample.response))


async def broken(sample):
    raise ConnectionError("reward server down")


def score(fn, sample):
    return asyncio.run(fn(sample))


def overlong_reference(n: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment written out in float64 from the paper, independent of rlblocks."""
    if n <= max_len - buffer:
        return 0.0
    if n >= max_len:
        return -penalty
    return -penalty * (n - (max_len - buffer)) / buffer


@pytest.mark.parametrize("max_len, buffer, penalty", [(20, 8, 1.0), (20, 20, 0.5), (7, 1, 2.0)])
def test_overlong_penalty_agrees_with_the_loss_module_and_the_paper(max_len, buffer, penalty):
    fn = OverlongPenalty(max_len=max_len, buffer=buffer, penalty=penalty)
    lengths = list(range(0, max_len + 6))
    batch = overlong_penalty(torch.tensor(lengths, dtype=torch.float64), max_len=max_len, buffer=buffer,
                             penalty=penalty).tolist()
    for n, b in zip(lengths, batch):
        r = score(fn, Sample("x", response_len=n))
        assert r.score == b  # the very same formula: exactly equal
        assert r.score == pytest.approx(overlong_reference(n, max_len, buffer, penalty), abs=1e-15)
        assert r.components == {"overlong": r.score}
        assert math.copysign(1.0, r.score) == (1.0 if r.score == 0 else -1.0)  # no -0.0


def test_overlong_penalty_needs_a_length_and_valid_arguments():
    r = score(OverlongPenalty(max_len=10, buffer=4), Sample("x"))
    assert not r.ok and "response_len" in r.error
    with pytest.raises(ArgumentError, match="buffer"):
        OverlongPenalty(max_len=10, buffer=11)
    with pytest.raises(ArgumentError, match="penalty"):
        OverlongPenalty(max_len=10, buffer=4, penalty=-1.0)


def test_format_reward():
    fmt = FormatReward(R1)
    good = "<think>a\nb</think>\n<answer>42</answer>"
    assert score(fmt, Sample(good)).score == 1.0
    assert score(fmt, Sample(good + " trailing")).score == 0.0  # fullmatch: nothing after the answer
    assert score(FormatReward(R1, match="search"), Sample("x " + good + " y")).score == 1.0
    r = score(FormatReward(r"\\boxed\{.+\}", match="search", score=0.5, otherwise=-0.5), Sample("no box"))
    assert r.score == -0.5 and r.components == {"format": 0.0}
    with pytest.raises(ArgumentError, match="pattern"):
        FormatReward("(unclosed")
    with pytest.raises(ArgumentError, match="match"):
        FormatReward("a", match="prefix")


def test_weighted_sum_keeps_every_component():
    fn = WeightedReward(
        {"format": FormatReward(R1), "len": length, "const": const,
         "overlong": OverlongPenalty(max_len=40, buffer=10)},
        weights={"format": 0.5, "len": -0.01, "overlong": 2.0},  # const gets the default weight 1.0
    )
    text = "<think>x</think><answer>1</answer>"  # 34 characters
    r = score(fn, Sample(text, response_len=35))
    pen = overlong_reference(35, 40, 10, 1.0)
    assert r.ok
    assert r.score == math.fsum([0.5 * 1.0, -0.01 * 34, 1.0 * 0.25, 2.0 * pen])
    assert r.components == {"format": 1.0, "format/format": 1.0, "len": 34.0, "const": 0.25, "const/inner": 7.0,
                            "overlong": pen, "overlong/overlong": pen}


def test_weighted_sum_fails_loudly_and_keeps_what_succeeded():
    fn = WeightedReward({"const": const, "down": broken, "overlong": OverlongPenalty(max_len=10, buffer=2)})
    r = score(fn, Sample("x"))  # no response_len: the overlong term fails too
    assert not r.ok and r.score is None
    assert "down: ConnectionError: reward server down" in r.error and "overlong: response_len" in r.error
    assert r.components == {"const": 0.25, "const/inner": 7.0}


def test_weighted_sum_in_a_pool_and_argument_checks():
    fn = WeightedReward({"a": const, "b": const}, weights={"b": 3.0})
    with RewardPool(fn, max_concurrency=4, timeout=5) as pool:
        assert [r.score for r in pool.score([Sample("x")] * 5)] == [1.0] * 5
    with pytest.raises(ArgumentError, match="weights"):
        WeightedReward({"a": const}, weights={"b": 1.0})
    with pytest.raises(ArgumentError, match="weights"):
        WeightedReward({"a": const}, weights={"a": float("nan")})
    with pytest.raises(ArgumentError, match="async"):
        WeightedReward({"a": lambda s: 1.0})
    with pytest.raises(ArgumentError, match="names"):
        WeightedReward({"a/b": const})
    with pytest.raises(ArgumentError, match="rewards"):
        WeightedReward({})
