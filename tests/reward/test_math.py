"""math_reward: answer extraction and verification on a table of (response, reference, expected), LaTeX and
malformed answers included; the timeout really stops pathological input (a worker process is killed)."""

import asyncio
import time

import pytest

pytest.importorskip("math_verify")

from rlblocks.errors import ArgumentError
from rlblocks.reward import MathReward, RewardPool, Sample, check_math, extract_answer

# (response, reference, expected score). Each expectation is the mathematics, not a recording of the output.
TABLE = [
    # LaTeX fractions and equivalent forms
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("So $x = \\boxed{3/4}$", "0.75", 1.0),
    ("\\boxed{\\frac{\\sqrt3}{2}}", "so it is $\\boxed{\\frac{\\sqrt{3}}{2}}$", 1.0),  # MATH-style solution
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{0.333333}", "1/3", 1.0),  # equal after rounding to 6 decimals
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),  # sets
    ("\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
    ("\\boxed{2, 3}", "3, 2", 1.0),
    ("\\boxed{x = 2}", "2", 1.0),
    ("\\boxed{2}", "x=2", 1.0),
    ("\\boxed{\\text{(B)}}", "B", 1.0),
    # units, currency, percent, degrees, thousands separators
    ("Total: \\boxed{\\$18}", "18", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("$1,234.5$ dollars", "1234.5", 1.0),
    # which answer is taken: the last box, else the last number (GSM8K style)
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
    ("\\boxed{4}. Check: 3", "3", 0.0),  # a box wins over a later number
    ("\\fbox{9}", "9", 1.0),
    ("\\boxed 7", "7", 1.0),
    ("She has 72 apples left.", "#### 72", 1.0),
    ("48/2 = 24 clips in May, 48+24 = 72 clips.", "She sold 48+24=72\n#### 72", 1.0),
    ("The result is -3.", "-3", 1.0),
    ("x=-3", "-3", 1.0),
    ("5-3 = 2", "2", 1.0),
    ("5 - 3", "-3", 0.0),  # a subtraction, not a negative number
    ("72", 72, 1.0),  # numeric references
    # LaTeX without a box: the last math span or bare fraction, read as an expression, not as its digits
    ("The answer is $\\frac12$", "1/2", 1.0),
    ("$x = \\frac{1}{2}$", 0.5, 1.0),
    ("$\\frac{3}{4}$", 0.75, 1.0),
    ("The answer is $\\frac12$", "12", 0.0),  # one half, not twelve
    ("so the answer is \\dfrac{3}{4}.", "0.75", 1.0),
    ("so the answer is -\\tfrac{1}{2}", "-0.5", 1.0),
    ("Half of 10 is $\\frac{10}{2}$.", "5", 1.0),
    ("\\(y = 2\\sqrt{3}\\)", "2\\sqrt3", 1.0),
    ("\\[\\frac{5}{2}\\]", "2.5", 1.0),
    ("$$\\frac{7}{8}$$", "0.875", 1.0),
    ("We get $3x = 6$, so the answer is 2.", "2", 1.0),  # a later plain number wins over an earlier span
    ("We get $3x = 6$, so the answer is 2.", "6", 0.0),
    ("He paid $5 and $13 in all.", "13", 1.0),  # dollar signs around prose are money, not math
    ("$\\frac{1}{3}$ of 12 is 4", "4", 1.0),
    ("\\boxed{1/2}", 0.5, 1.0),
    # wrong answers
    ("\\boxed{4}", "3", 0.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("\\boxed{12.001}", "12", 0.0),
    ("\\boxed{0.3333}", "\\frac13", 0.0),
    ("\\boxed{[1,2)}", "[1,2]", 0.0),
    # malformed answers score 0 (a wrong response, not a failure)
    ("\\boxed{\\frac{1}{2}", "2", 0.0),  # unclosed box: not rescued by the number 2 inside it
    ("}}}{{{ \\boxed{{{", "1", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("no numbers here", "5", 0.0),
    ("", "5", 0.0),
    ("\\boxed{\\frac{}{}}", "1", 0.0),
    ("\\boxed{five}", "5", 0.0),
    ("\\boxed{1/0}", "1", 0.0),
]


@pytest.mark.parametrize("response, reference, expected", TABLE)
def test_verifier_table(response, reference, expected):
    r = check_math(response, reference)
    assert r.ok, r.error
    assert r.score == expected, (response, reference, r.details)
    assert r.components == {"correct": expected}


@pytest.mark.parametrize(
    "text, answer, source",
    [
        ("a \\boxed{1} b \\boxed{\\frac{2}{3}} c", "\\frac{2}{3}", "boxed"),
        ("\\boxed{\\{a\\}}", "\\{a\\}", "boxed"),  # escaped braces do not close the box
        ("\\boxed{ 12 }", "12", "boxed"),
        ("\\boxedx{3} 4", "4", "last_number"),  # another command, not a box
        ("costs 1,234,567.25 in total", "1234567.25", "last_number"),
        ("1,2,3", "3", "last_number"),  # not a thousands separator
        ("ratio 3/4", "3/4", "last_number"),
        ("(-2)", "-2", "last_number"),
        ("f(x)-2", "2", "last_number"),
        ("The answer is $\\frac12$.", "\\frac12", "latex"),
        ("$x = \\frac{1}{2}$.", "x = \\frac{1}{2}", "latex"),
        ("thus \\dfrac{3}{4} of them", "\\dfrac{3}{4}", "latex"),
        ("thus -\\frac{1}{2}", "-\\frac{1}{2}", "latex"),
        ("thus 2\\sqrt{3}", "2\\sqrt{3}", "latex"),
        ("$1,234$ in all", "1234", "latex"),
        ("$\\frac{1}{2}$ then 7", "7", "last_number"),
        ("We get $3x = 6$, so x is 2", "2", "last_number"),
        ("costs $5 and $13", "13", "last_number"),
        ("a price of \\$5 or \\$7", "7", "last_number"),
        ("\\boxed{7", None, None),
        ("nothing", None, None),
    ],
)
def test_extract_answer(text, answer, source):
    assert extract_answer(text) == (answer, source)


def test_malformed_details_say_why():
    assert check_math("\\boxed{3", "3").details["reason"] == "unclosed \\boxed{"
    assert check_math("\\boxed{}", "3").details["reason"] == "empty \\boxed{}"
    assert check_math("words", "3").details["reason"] == "no answer found"


@pytest.mark.parametrize("reference", ["", "\\boxed{", "\\frac{"])
def test_unparsable_reference_is_an_error_not_a_zero(reference):
    r = check_math("\\boxed{1}", reference)
    assert not r.ok and r.score is None and "reference could not be parsed" in r.error


def test_bad_argument_types():
    with pytest.raises(ArgumentError, match="reference"):
        check_math("1", None)
    with pytest.raises(ArgumentError, match="response"):
        check_math(1, "1")
    with pytest.raises(ArgumentError, match="timeout"):
        MathReward(timeout=0)


@pytest.fixture(scope="module")
def reward():
    rw = MathReward(timeout=30.0, workers=2)  # generous: the CI machine is shared and may be heavily loaded
    yield rw
    rw.close()


def test_math_reward_in_workers_agrees_with_the_table(reward):
    async def main():
        return await asyncio.gather(*(reward(Sample(r, ref)) for r, ref, _ in TABLE))

    results = asyncio.run(main())
    assert [r.score for r in results] == [e for _, _, e in TABLE]
    bad = asyncio.run(reward(Sample("1", None)))  # the worker raised: an error result, the worker lives on
    assert not bad.ok and "ArgumentError" in bad.error and "reference" in bad.error


def test_pathological_input_is_stopped_by_the_timeout():
    # sympy builds 10**(10**10) in C code, where no signal reaches; only killing the worker stops it.
    reward = MathReward(timeout=2.0, workers=2)
    samples = [Sample("\\boxed{10^{10^{10}}}", "5"), Sample("\\boxed{2}", "2"), Sample("\\boxed{3}", "4")]
    before = reward.stats()
    t0 = time.perf_counter()
    with RewardPool(reward, max_concurrency=3, timeout=30) as pool:
        results = pool.score(samples)
    elapsed = time.perf_counter() - t0
    assert not results[0].ok and "RewardTimeout" in results[0].error and "killed" in results[0].error
    assert [r.score for r in results[1:]] == [1.0, 0.0]  # the other samples were not held up or lost
    assert elapsed < 60  # the 2 s timeout acted (the bound is generous for a loaded machine; unbounded, it hangs)
    after = reward.stats()
    assert after["timeouts"] == before["timeouts"] + 1
    # the killed worker was replaced: the next check works
    assert asyncio.run(reward(Sample("\\boxed{\\frac{6}{8}}", "3/4"))).score == 1.0
    reward.close()
