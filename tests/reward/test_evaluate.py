"""The evaluation block: pass@k against the closed form ``1 − C(n−c, k)/C(n, k)`` in exact rationals, mean@k and
the per-prompt results on hand-made scores, failures counted, and ``evaluate`` on a real engine against the same
samples generated and scored independently here."""

import asyncio
import math
import random
from fractions import Fraction

import pytest

from rlblocks.errors import ArgumentError
from rlblocks.reward import EvalResult, RewardPool, RewardResult, Sample, evaluate, pass_at_k, summarize


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_is_the_closed_form_for_every_small_case():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-14), (n, c, k)


@pytest.mark.parametrize(("n", "c", "k"), [(2000, 5, 100), (10_000, 1, 1000), (500, 250, 10), (1000, 3, 1)])
def test_pass_at_k_stays_accurate_where_the_binomials_are_huge(n, c, k):
    # C(10 000, 1000) has ~1400 digits: a float formula through the coefficients would overflow
    exact = float(closed_form(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n − c = 2 < k: every draw of 3 holds a correct one
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is the fraction correct
    for args, name in (((3, 1, 4), "k"), ((3, 4, 1), "c"), ((0, 0, 1), "n"), ((3, -1, 1), "c"), ((3, 1, 0), "k"),
                       ((3.0, 1, 1), "n"), ((3, True, 1), "c")):
        with pytest.raises(ArgumentError, match=name):
            pass_at_k(*args)


def test_summarize_hand_made_results():
    fail = RewardResult.failure("TimeoutError: slow")
    scores = [
        [1.0, 0.0, 0.0, 1.0],  # c = 2
        [0.0, 0.0, 0.0, 0.0],  # c = 0
        [0.5, 1.0, fail, RewardResult(1.0)],  # c = 2, one failure scoring 0
    ]
    r = summarize(scores, 2, prompts=["a", "b", "c"], references=[1, 2, 3],
                  responses=[["w", "x", "y", "z"]] * 3)
    assert isinstance(r, EvalResult) and (r.k, r.n) == (2, 4)
    want = [float(closed_form(4, 2, 2)), 0.0, float(closed_form(4, 2, 2))]
    assert [p.pass_at_k for p in r.prompts] == pytest.approx(want, abs=1e-15)
    assert [p.correct for p in r.prompts] == [2, 0, 2]
    assert [p.mean for p in r.prompts] == [0.5, 0.0, 2.5 / 4]
    assert r.pass_at_k == pytest.approx(sum(want) / 3, abs=1e-15)
    assert r.mean_at_k == pytest.approx((0.5 + 0.0 + 0.625) / 3, abs=1e-15)
    assert r.failures == 1 and r.prompts[2].failures == 1 and r.prompts[2].errors == ("TimeoutError: slow",)
    assert r.prompts[2].scores == (0.5, 1.0, 0.0, 1.0)
    assert r.metrics() == {"pass@2": r.pass_at_k, "mean@2": r.mean_at_k, "failures": 1}
    rec = r.prompts[0].record()
    assert rec["prompt"] == "a" and rec["reference"] == 1 and rec["scores"] == [1.0, 0.0, 0.0, 1.0]
    # a lower threshold: partial scores count as correct
    assert summarize(scores, 1, threshold=0.5).prompts[2].correct == 3


def test_summarize_refuses_bad_input():
    with pytest.raises(ArgumentError, match="k = 3"):
        summarize([[1.0, 0.0]], 3)
    with pytest.raises(ArgumentError, match=r"scores\[1\]"):
        summarize([[1.0, 0.0], [1.0]], 1)
    with pytest.raises(ArgumentError, match=r"scores\[0\]\[1\]"):
        summarize([[1.0, float("nan")]], 1)
    with pytest.raises(ArgumentError, match="prompts"):
        summarize([[1.0]], 1, prompts=["a", "b"])
    with pytest.raises(ArgumentError, match="scores"):
        summarize([], 1)


# ------------------------------------------------------------------------------------------------ on an engine
async def even_length(sample: Sample) -> RewardResult:
    """A reward any model can earn: 1 for an even number of characters; a failure for a response with a 'q'."""
    if "q" in sample.response:
        return RewardResult.failure("no q allowed")
    return RewardResult(float(len(sample.response) % 2 == 0))


def test_evaluate_matches_samples_generated_and_scored_independently(tiny_hf_dir):
    from transformers import AutoTokenizer

    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines import TorchEngine

    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    prompts = ["1+2=", "ab", "x y", "9*9="]
    ids = [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in prompts]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)
    k, n, seed = 2, 5, 77

    async def main():
        engine = TorchEngine.from_pretrained(tiny_hf_dir, device="cpu")
        try:
            state = random.getstate()
            r1 = await evaluate(engine, ids, [None] * 4, even_length, tok, k=k, n=n, sampling=sp, prompts=prompts,
                                seed=seed)
            assert random.getstate() == state  # seeded requests: the engine's own random source is untouched
            r2 = await evaluate(engine, ids, [None] * 4, RewardPool(even_length), tok, k=k, n=n, sampling=sp,
                                seed=seed)
            # the reference: the same requests by hand, scored with the rule written out, pass@k by the closed form
            gens = [await engine.generate(GenerationRequest(f"ref-{i}-{j}", ids[i], SamplingParams(
                temperature=1.0, max_new_tokens=5, seed=seed + i * n + j))) for i in range(4) for j in range(n)]
            return r1, r2, gens
        finally:
            await engine.aclose()

    r1, r2, gens = asyncio.run(main())
    texts = [tok.decode(g.output_ids, skip_special_tokens=True) for g in gens]
    want_pass, want_mean, failures = [], [], 0
    for i in range(4):
        row = texts[i * n:(i + 1) * n]
        assert list(r1.prompts[i].responses) == row
        s = [0.0 if "q" in t else float(len(t) % 2 == 0) for t in row]
        failures += sum("q" in t for t in row)
        c = sum(x == 1.0 for x in s)
        want_pass.append(float(closed_form(n, c, k)))
        want_mean.append(sum(s) / n)
    assert [p.pass_at_k for p in r1.prompts] == pytest.approx(want_pass, abs=1e-14)
    assert [p.mean for p in r1.prompts] == pytest.approx(want_mean, abs=1e-14)
    assert r1.pass_at_k == pytest.approx(sum(want_pass) / 4, abs=1e-14)
    assert r1.failures == failures
    assert [p.scores for p in r2.prompts] == [p.scores for p in r1.prompts]  # a pool gives the same, repeatably
    assert r1.prompts[1].prompt == "ab" and len(r1.prompts) == 4 and r1.n == n


def test_evaluate_refuses_bad_arguments(tiny_hf_dir):
    async def main(**kw):
        args = {"engine": None, "prompt_ids": [[1]], "references": [None], "reward": even_length,
                "tokenizer": None, **kw}
        return await evaluate(args.pop("engine"), args.pop("prompt_ids"), args.pop("references"),
                              args.pop("reward"), args.pop("tokenizer"), **args)

    for kw, name in (({"k": 2, "n": 1}, "n"), ({"references": []}, "references"), ({"k": 0}, "k"),
                     ({"sampling": "greedy"}, "sampling"), ({"prompts": ["a", "b"]}, "prompts"),
                     ({}, "tokenizer")):
        with pytest.raises(ArgumentError, match=name):
            asyncio.run(main(**kw))
