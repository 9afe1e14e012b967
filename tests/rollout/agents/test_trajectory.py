"""Trajectory: per-token roles/turns/versions, chat-template deltas on two real template styles, branching, the
training-tensor layout (checked against build_batch and against hand-built tensors) and zero gradient on
environment tokens through rlblocks.losses."""

from __future__ import annotations

import random

import pytest
import torch
from agent_testlib import ANSWER, CALL, QUESTION, RESULT, build_chat_tokenizer, calc_schema

from rlblocks.errors import ArgumentError, PrefixMismatchError
from rlblocks.losses import aggregate, grpo_advantages, ppo_clip_loss
from rlblocks.rollout import Generation, build_batch
from rlblocks.rollout.agents.chat_templates import HERMES_TEMPLATE
from rlblocks.rollout.agents.trajectory import Trajectory, render_chat, to_tensors, trajectory_rows
from rlblocks.rollout.resume import ResumableResult


def _gen(prompt, out, versions=None, lps=None, finish="stop"):
    versions = [0] * len(out) if versions is None else versions
    lps = [-0.5 - 0.01 * i for i in range(len(out))] if lps is None else lps
    return Generation("r", list(prompt), list(out), lps, versions, finish)


def test_roles_turns_versions_and_loss_mask():
    t = Trajectory([1, 2, 3])
    t.append_generation(_gen([1, 2, 3], [4, 5], [0, 0], [-0.1, -0.2]))
    t.append_env([6, 7])
    t.append_generation(_gen(t.token_ids, [8, 9, 10], [0, 1, 1], [-0.3, -0.4, -0.5]))
    assert t.token_ids == list(range(1, 11))
    assert t.roles == ["prompt"] * 3 + ["model"] * 2 + ["env"] * 2 + ["model"] * 3
    assert t.turn_ids == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert t.loss_mask == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 3
    assert t.logprobs == [0.0] * 3 + [-0.1, -0.2] + [0.0] * 2 + [-0.3, -0.4, -0.5]
    assert t.versions == [-1] * 3 + [0, 0] + [-1, -1] + [0, 1, 1]
    assert t.version_spans() == [(0, 3, 5), (0, 7, 8), (1, 8, 10)]
    assert t.num_turns == 2 and t.num_model_tokens == 5 and t.num_env_tokens == 2
    assert t.oldest_version == 0 and t.staleness(current_version=3) == 3
    assert Trajectory([1]).staleness(current_version=5) == 0 and Trajectory([1]).oldest_version is None


def test_append_generation_checks_what_the_engine_saw():
    t = Trajectory([1, 2, 3])
    with pytest.raises(PrefixMismatchError) as e:
        t.append_generation(_gen([1, 9, 3], [4]))
    assert e.value.position == 1 and e.value.expected == 2 and e.value.got == 9 and "position 1" in str(e.value)
    with pytest.raises(PrefixMismatchError) as e:  # the engine saw more than the trajectory
        t.append_generation(_gen([1, 2, 3, 4], [5]))
    assert e.value.position == 3
    assert t.token_ids == [1, 2, 3]  # nothing appended by a refused call
    with pytest.raises(ArgumentError):
        Trajectory([])


def test_generation_own_loss_mask_is_kept():
    t = Trajectory([1, 2])
    res = ResumableResult("r", [1, 2], [3, 4, 5], [-1.0, -2.0, -3.0], [0, 0, 1], "stop", final_version=1,
                          stale=[True, True, False], loss_mask=[False, False, True])
    t.append_generation(res)
    assert t.loss_mask == [False, False, False, False, True]


def test_to_tensors_equals_build_batch_for_single_turn():
    rng = random.Random(0)
    gens = []
    for _ in range(5):
        p = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        o = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))]
        gens.append(_gen(p, o, [rng.randrange(3) for _ in o], [rng.uniform(-3, 0) for _ in o]))
    trajs = []
    for g in gens:
        t = Trajectory(g.prompt_ids)
        t.append_generation(g)
        trajs.append(t)
    got = to_tensors(trajs, pad_id=0, group_ids=[0, 0, 1, 1, 2], rewards=[1.0, 0.0, 0.5, 0.5, 1.0])
    ref = build_batch(gens, pad_id=0, group_ids=[0, 0, 1, 1, 2], rewards=[1.0, 0.0, 0.5, 0.5, 1.0])
    for name in ("input_ids", "attention_mask", "prompt_lens", "response_ids", "response_mask", "loss_mask",
                 "rollout_logp", "versions", "group_ids", "rewards"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(got.turn_ids, torch.where(ref.response_mask, 0, -1))


def test_to_tensors_multi_turn_layout_by_hand():
    a = Trajectory([1, 2], group_id=7)
    a.append_generation(_gen([1, 2], [3], [0], [-0.25]))
    a.append_env([4, 5])
    a.append_generation(_gen([1, 2, 3, 4, 5], [6, 7], [1, 2], [-0.5, -0.75]))
    a.reward = 1.0
    b = Trajectory([9], group_id=7)
    b.append_generation(_gen([9], [8], [0], [-1.0]))
    b.append_env([7])
    b.extend_to([9, 1, 1], on_mismatch="branch")  # history rewritten: new segment with prompt [9, 1, 1]
    b.append_generation(_gen([9, 1, 1], [2], [3], [-2.0]))
    b.reward = 0.0
    batch = to_tensors([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 0, 0, 0, 0], [9, 1, 1, 2, 0, 0, 0]]
    assert batch.prompt_lens.tolist() == [2, 1, 3]
    assert batch.response_ids.tolist() == [[3, 4, 5, 6, 7], [8, 7, 0, 0, 0], [2, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1, 1], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert batch.rollout_logp.tolist() == [[-0.25, 0, 0, -0.5, -0.75], [-1.0, 0, 0, 0, 0], [-2.0, 0, 0, 0, 0]]
    assert batch.versions.tolist() == [[0, -1, -1, 1, 2], [0, -1, -1, -1, -1], [3, -1, -1, -1, -1]]
    assert batch.turn_ids.tolist() == [[0, 1, 1, 1, 1], [0, 1, -1, -1, -1], [1, -1, -1, -1, -1]]
    assert batch.group_ids.tolist() == [7, 7, 7] and batch.rewards.tolist() == [1.0, 0.0, 0.0]
    assert batch.attention_mask.sum(-1).tolist() == [7, 3, 4]
    assert trajectory_rows([a, b]).tolist() == [0, 1, 1]
    assert b.prefix_mismatches == 1 and len(b.branches) == 1 and b.num_turns == 2
    assert b.staleness(current_version=4) == 4  # over both segments
    with pytest.raises(ArgumentError, match="pad_id"):
        to_tensors([a], pad_id=None)
    with pytest.raises(ArgumentError, match="group_ids"):
        to_tensors([a, b], pad_id=0, group_ids=[1])
    with pytest.raises(ArgumentError, match="trajectories"):
        to_tensors(a, pad_id=0)


def _model_turn(tok, traj: Trajectory, text: str, *, eos: bool = True, version: int = 0) -> Generation:
    """What an engine would return for ``text``: its ids (plus the end-of-turn token)."""
    ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    return _gen(traj.token_ids, ids, [version] * len(ids))


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_chat_template_delta_is_token_faithful_turn_by_turn(style, hermes_tok, llama3_tok):
    tok = {"hermes": hermes_tok, "llama3": llama3_tok}[style]
    tools = calc_schema()
    msgs = [{"role": "system", "content": "be exact"}, {"role": "user", "content": QUESTION}]
    traj = Trajectory.from_messages(tok, msgs, tools=tools)
    assert traj.token_ids == render_chat(tok, msgs, tools=tools)
    engine_saw = []
    # turn 0: the model calls the tool (stopped by the closing tag: no end-of-turn token)
    g1 = _model_turn(tok, traj, CALL, eos=False)
    engine_saw.append(list(g1.prompt_ids))
    traj.append_generation(g1, message={"role": "assistant", "content": CALL})
    before = len(traj)
    delta = traj.append_messages(tok, [{"role": "tool", "name": "calc", "content": RESULT}])
    history = [*msgs, {"role": "assistant", "content": CALL}, {"role": "tool", "name": "calc", "content": RESULT}]
    full = render_chat(tok, history, tools=tools)
    assert traj.token_ids == full and delta == full[before:]  # only the suffix was appended
    # turn 1: the answer, ended by the end-of-turn token
    g2 = _model_turn(tok, traj, ANSWER, version=1)
    engine_saw.append(list(g2.prompt_ids))
    traj.append_generation(g2, message={"role": "assistant", "content": ANSWER})
    traj.append_messages(tok, [{"role": "user", "content": "thanks"}])
    history += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "thanks"}]
    assert traj.token_ids == render_chat(tok, history, tools=tools)
    # what the engine saw each turn is exactly the trajectory up to that turn's model tokens
    starts = [s for _, s, _ in traj.version_spans()]
    assert [traj.token_ids[:s] for s in starts] == engine_saw
    model_ids = [t for t, r in zip(traj.token_ids, traj.roles) if r == "model"]
    assert model_ids == g1.output_ids + g2.output_ids
    assert tok.decode(g1.output_ids) == CALL
    assert traj.loss_mask.count(True) == len(model_ids) and traj.num_turns == 2
    assert set(traj.turn_ids[traj.prompt_len:]) == {0, 1, 2}  # the closing user message opens turn 2
    assert traj.prefix_mismatches == 0 and not traj.branches


def test_llama3_trim_rewrites_history(llama3_tok):
    tok = llama3_tok
    msgs = [{"role": "user", "content": "what is 6*7?"}]
    traj = Trajectory.from_messages(tok, msgs)
    g = _model_turn(tok, traj, "  42")  # the template trims the content: the two spaces disappear on re-render
    traj.append_generation(g, message={"role": "assistant", "content": "  42"})
    kept = list(traj.token_ids)
    with pytest.raises(PrefixMismatchError) as e:
        traj.append_messages(tok, [{"role": "user", "content": "sure?"}])
    assert e.value.position == traj.prompt_len and e.value.role == "model" and e.value.turn == 0
    assert f"position {traj.prompt_len}" in str(e.value) and traj.token_ids == kept  # nothing appended
    rendered = traj.append_messages(tok, [{"role": "user", "content": "sure?"}], on_mismatch="branch")
    assert traj.prefix_mismatches == 1 and len(traj.branches) == 1
    assert traj.branches[0].token_ids == kept and traj.branches[0].loss_mask.count(True) == len(g.output_ids)
    assert traj.token_ids == rendered and traj.prompt_len == len(rendered) and traj.num_model_tokens == 0
    traj.append_generation(_model_turn(tok, traj, "yes"))
    batch = to_tensors([traj], pad_id=0)
    assert batch.input_ids.shape[0] == 2 and batch.loss_mask.sum(-1).tolist() == [5, 4]  # "  42" + eot, "yes" + eot
    assert batch.turn_ids[1, 0].item() == 1  # turn numbering continues in the new branch


THINK_STRIPPING = HERMES_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}",
    "{%- set c = message.content or '' %}"
    "{%- if message.role == 'assistant' and not loop.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + c + '<|im_end|>\\n' }}",
)


def test_template_that_strips_reasoning_fails_the_check():


    tok = build_chat_tokenizer("hermes")
    tok.chat_template = THINK_STRIPPING
    traj = Trajectory.from_messages(tok, [{"role": "user", "content": "6*7?"}])
    text = "<think>6*7 is 42</think>42"
    traj.append_generation(_model_turn(tok, traj, text), message={"role": "assistant", "content": text})
    with pytest.raises(PrefixMismatchError) as e:
        traj.append_messages(tok, [{"role": "user", "content": "and 6*8?"}])
    assert e.value.position == traj.prompt_len and e.value.role == "model"  # the stripped '<think>' token


def test_env_tokens_get_exactly_zero_gradient_through_the_losses(hermes_tok, random_chat_model):
    tok = hermes_tok
    trajs = []
    for k, (call, answer) in enumerate([(CALL, ANSWER), ("none", "7")]):
        t = Trajectory.from_messages(tok, [{"role": "user", "content": QUESTION}], tools=calc_schema(), group_id=0)
        t.append_generation(_model_turn(tok, t, call, eos=False), message={"role": "assistant", "content": call})
        t.append_messages(tok, [{"role": "tool", "name": "calc", "content": RESULT}])
        t.append_generation(_model_turn(tok, t, answer), message={"role": "assistant", "content": answer})
        t.reward = float(k == 0)
        trajs.append(t)
    batch = to_tensors(trajs, pad_id=tok.pad_token_id)
    model = random_chat_model
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    logits.retain_grad()
    b, t = batch.response_ids.shape
    # response position t of row b is predicted from sequence position P_b + t - 1
    pos = (batch.prompt_lens[:, None] - 1 + torch.arange(t)[None, :]).clamp(max=logits.shape[1] - 1)
    pred = logits.gather(1, pos[..., None].expand(b, t, logits.shape[-1]))
    logp = pred.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    adv = grpo_advantages(batch.rewards, batch.group_ids)
    per_tok, _ = ppo_clip_loss(logp, logp.detach(), adv, batch.loss_mask)  # ratio 1: no clipped token
    loss = aggregate(per_tok, batch.loss_mask, mode="token-mean")
    loss.backward()
    g = logits.grad.abs().sum(-1)  # [B, L]: gradient reaching the logits that predict each token
    for row in range(b):
        for j in range(t):
            p = int(pos[row, j])
            if not batch.response_mask[row, j]:
                continue
            if batch.loss_mask[row, j]:
                assert g[row, p] > 0, (row, j)
            else:  # environment tokens: no gradient at all
                assert g[row, p] == 0.0, (row, j)
    assert (~batch.loss_mask & batch.response_mask).sum() > 0  # there are env tokens in the responses
