"""reasoning-gym as a prompt source and reward (``--prompts rg:...``, ``--reward rg``; ``cookbook/rgym.py``).

References are reasoning-gym's own: the items come from ``reasoning_gym.create_dataset`` and every reward is
compared with the dataset instance's ``score_answer`` on the answer cut out of the response by hand.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import pytest
import reasoning_gym
import rgym
from plumbing import Reward, check_task_flags, load_task, load_tokenizer
from plumbing.data import TaskFlags
from plumbing.evaluation import last_number, last_number_accuracy

from rlblocks.errors import ArgumentError
from rlblocks.reward import evaluate

# one-digit sums and differences repeat a lot: the split must deduplicate, a seed alone would share items
SMALL = "rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1&seed={seed}&size=300&eval_size=60"


@dataclass
class Flags(TaskFlags):
    pass


def test_split_never_shares_a_question():
    spec = rgym.parse_spec(SMALL.format(seed=3))
    train, held, dropped = rgym.split(spec)
    assert len(held) == 60 and len(train) + dropped == 300
    assert dropped > 0  # the generator repeated held-out questions among the next 300 items: they were removed
    assert {e["question"] for e in held}.isdisjoint(e["question"] for e in train)
    # items are the dataset's own: index i of one dataset of 360 items
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=360, min_terms=2, max_terms=2, min_digits=1,
                                      max_digits=1, seed=3)
    assert [e["question"] for e in held] == [ds[i]["question"] for i in range(60)]


def test_split_against_another_seed_drops_the_shared_items():
    train_spec, held_spec = rgym.parse_spec(SMALL.format(seed=1)), rgym.parse_spec(SMALL.format(seed=2), "x")
    naive = rgym.generate(train_spec, train_spec.size)
    held_q = {e["question"] for e in rgym.generate(held_spec, held_spec.eval_size)}
    shared = sum(e["question"] in held_q for e in naive)
    assert shared > 0  # a different seed alone is not a held-out set
    train, held, dropped = rgym.split(train_spec, held_spec)
    assert dropped == shared and len(train) == len(naive) - shared
    assert {e["question"] for e in held}.isdisjoint(e["question"] for e in train)


def test_flags_refused_before_anything_loads(tmp_path):
    with pytest.raises(ArgumentError, match="--prompts: expected a reasoning-gym dataset name"):
        check_task_flags(Flags(prompts="rg:no_such_task", reward="rg"))
    with pytest.raises(ArgumentError, match="reasoning-gym refused the settings"):
        check_task_flags(Flags(prompts="rg:basic_arithmetic?min_terms=banana", reward="rg"))
    with pytest.raises(ArgumentError, match="eval_size"):
        check_task_flags(Flags(prompts="rg:basic_arithmetic?eval_size=0", reward="rg"))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ArgumentError, match="--reward rg"):
        check_task_flags(Flags(prompts=str(f), reward="rg"))
    with pytest.raises(ArgumentError, match="--eval-prompts"):
        check_task_flags(Flags(prompts="rg:basic_arithmetic", eval_prompts=str(f), reward="rg"))
    with pytest.raises(ArgumentError, match="--rg-system"):
        check_task_flags(Flags(prompts="rg:basic_arithmetic", reward="rg", rg_system="nope"))


def _by_hand(response: str, fmt: str) -> str | None:
    """The answer in the requested format, cut out independently of rgym.extract."""
    if fmt == "answer":
        found = re.findall(r"<answer>(.*?)</answer>", response, flags=re.DOTALL)
    else:
        found = re.findall(r"\\boxed\{([^{}]*)\}", response)
    return found[-1].strip() if found else None


@pytest.mark.parametrize("fmt", ["answer", "boxed"])
def test_reward_is_the_datasets_own_score_answer(smollm2_dir, fmt):
    tok = load_tokenizer(smollm2_dir)
    cfg = Flags(prompts="rg:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&seed=5&size=20&eval_size=6",
                reward="rg", answer_format=fmt)
    task = load_task(tok, cfg)
    wrap = (lambda a: f"<answer>{a}</answer>") if fmt == "answer" else (lambda a: f"so \\boxed{{{a}}}")
    other = (lambda a: f"\\boxed{{{a}}}") if fmt == "answer" else (lambda a: f"<answer>{a}</answer>")
    cases = []
    for p in task.heldout:
        ans = p.reference
        cases += [(p, f"The result is {wrap(ans)}"), (p, wrap(str(int(ans) + 1))), (p, wrap(ans + "0")),
                  (p, f"{wrap('7')} then {wrap(ans)}"), (p, f"It is {ans}."), (p, other(ans)), (p, wrap(""))]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=26, min_terms=2, max_terms=2, max_digits=2, seed=5)
    reward = Reward("rg", tok)
    try:
        out = asyncio.run(reward.results([p for p, _ in cases], [tok.encode(text) for _, text in cases]))
    finally:
        reward.close()
    assert all(r.ok for r in out), [r.error for r in out if not r.ok]
    for (p, text), r in zip(cases, out):
        entry = p.metadata["rg_entry"]
        assert entry == ds[entry["metadata"]["source_index"]]
        answer = _by_hand(text, fmt)
        want = 0.0 if answer is None else ds.score_answer(answer, entry)
        assert r.score == want, (text, r)
    scores = [r.score for r in out]
    assert 1.0 in scores and 0.0 in scores and any(0 < s < 1 for s in scores)  # right, wrong or missing, partial


def test_exact_reward_pays_only_what_the_verifier_accepts_in_full(smollm2_dir):
    """``rg-exact``: an answer padded with digits that contain the right one (partial credit under ``rg``, the
    behaviour a policy learns when paid for it) earns 0; the right answer 1; the reference is ``score_answer == 1``
    computed here from the dataset."""
    tok = load_tokenizer(smollm2_dir)
    cfg = Flags(prompts="rg:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2&seed=5&size=20&eval_size=6",
                reward="rg-exact")
    check_task_flags(cfg)
    task = load_task(tok, cfg)
    cases = []
    for p in task.heldout:
        ans = p.reference
        cases += [(p, f"<answer>{ans}</answer>"), (p, f"<answer>{ans}0</answer>"), (p, f"<answer>1{ans}</answer>"),
                  (p, f"<answer>{int(ans) + 1}</answer>"), (p, f"It is {ans}.")]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=26, min_terms=2, max_terms=2, max_digits=2, seed=5)
    exact, partial = Reward("rg-exact", tok), Reward("rg", tok)
    try:
        ids = [tok.encode(text) for _, text in cases]
        got = asyncio.run(exact.results([p for p, _ in cases], ids))
        credit = asyncio.run(partial.results([p for p, _ in cases], ids))
    finally:
        exact.close()
        partial.close()
    for (p, text), r in zip(cases, got):
        answer = _by_hand(text, "answer")
        want = 0.0 if answer is None else float(ds.score_answer(answer, p.metadata["rg_entry"]) == 1.0)
        assert r.ok and r.score == want, (text, r)
    padded = [c.score for (_, text), c in zip(cases, credit) if text.endswith("0</answer>") or "<answer>1" in text]
    assert any(0 < s < 1 for s in padded)  # the gameable credit rg pays, and rg-exact does not
    with pytest.raises(ArgumentError, match="--reward rg-exact"):
        check_task_flags(Flags(prompts="p.jsonl", reward="rg-exact"))

def test_prompts_ask_for_the_format_through_the_chat_template(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    for fmt, needle in (("answer", "<answer>"), ("boxed", "\\boxed{")):
        task = load_task(tok, Flags(prompts="rg:leg_counting?seed=2&size=5&eval_size=3", reward="rg",
                                    answer_format=fmt))
        p = task.heldout[0]
        text = tok.decode(list(p.ids))
        assert needle in text and p.metadata["rg_entry"]["question"] in text
        assert text.endswith("<|im_start|>assistant\n")  # the generation prompt of SmolLM2's ChatML
        assert p.reference == p.metadata["rg_entry"]["answer"] and p.metadata["answer_format"] == fmt


def test_last_number_accuracy_beside_the_strict_score():
    assert last_number("23+58 = 141.") == 141.0 and last_number("-3.5 then -2") == -2.0 and last_number("x") is None

    async def reward(sample):
        return float(sample.response.strip() == f"<answer>{sample.reference}</answer>")

    class Fixed:  # an engine that answers from a table
        def __init__(self, texts):
            self.texts = texts

        async def generate(self, req):
            from rlblocks.rollout import Generation

            ids = [ord(c) for c in self.texts[req.prompt_ids[0]]]
            return Generation(req.request_id, list(req.prompt_ids), ids, [0.0] * len(ids), [0] * len(ids), "stop")

    texts = ["<answer>5</answer>", "it is 7", "so 3 + 4 = 8", "no number"]
    res = asyncio.run(evaluate(Fixed(texts), [[i] for i in range(4)], ["5", "7", "7", "7"], reward, None,
                               decode=lambda ids: "".join(map(chr, ids))))
    assert res.mean_at_k == 0.25  # strict: the format is there once
    assert last_number_accuracy(res) == 0.5  # lenient: 5 and 7
