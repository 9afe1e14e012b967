"""``cookbook/real.py`` (``make demo-real``): the warm start never reads a held-out item, renders prompts exactly as
the loops' ``--prompts rg:...`` do, and scores with ``--reward rg``'s verifier."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _recipe_task(tok, smollm2_dir):
    import grpo_sync
    import real
    from plumbing import load_task, parse_flags

    cfg = parse_flags(grpo_sync.Config, ["--model", smollm2_dir, *real.RECIPE], check=grpo_sync.check_flags)
    return load_task(tok, cfg)


def test_warm_start_items_are_disjoint_from_the_heldout_items(tok, smollm2_dir):
    import real

    task = _recipe_task(tok, smollm2_dir)
    sft = real.sft_items()
    assert len(task.heldout) == 256 and len(sft) > 1000
    held = {p.text for p in task.heldout}
    assert held.isdisjoint(e["question"] for e in sft)
    assert not held & {p.text for p in task.train}


def test_warm_start_prompts_are_the_loops_prompts(tok, smollm2_dir):
    import real
    import rgym

    task = _recipe_task(tok, smollm2_dir)
    _train, held, _dropped = rgym.split(rgym.parse_spec(real.SPEC))
    mine = real.prompts(tok, held)
    assert [p.ids for p in mine] == [p.ids for p in task.heldout]
    assert "<answer>" in tok.decode(list(mine[0].ids))  # the system prompt asks for the tags


def test_score_is_the_rg_reward(tok, smollm2_dir):
    import real
    import rgym

    from rlblocks.reward import Sample

    task = _recipe_task(tok, smollm2_dir)
    item = task.heldout[0]
    right = item.metadata["rg_entry"]["answer"]
    for text, want in [(f"<answer>{right}</answer>", 1.0), (f"The answer is {right}.", 0.0),
                       (f"<answer>{int(right) + 1}</answer>", 0.0)]:
        got = real.score(text, item.metadata["rg_entry"])
        ref = rgym.score(Sample(text, item.reference, item.text, metadata=item.metadata))
        assert got == want == ref.score, (text, got, ref)
