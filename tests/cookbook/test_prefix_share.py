"""--prefix-share in the cookbook: each role's outputs and gradients with the prefix-shared forward against the
one-row-per-sample forward, on the demo's tiny Llama (float32), through the loops' own modules."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def toy_lm():
    import toy

    tok = toy.build_tokenizer()
    return tok, toy.build_tiny_model(tok).eval()


def _groups(tok, n: int, k: int, seed: int = 0) -> list[dict]:
    """Group records as the GRPO loops queue them: ``k`` samples of each toy prompt, some identical, one empty."""
    import toy

    rng = random.Random(seed)
    out = []
    for g in range(n):
        prompt = toy.encode_prompt(tok, rng.randint(100, 999), rng.randint(100, 999))
        samples = []
        for j in range(k):
            ids = [rng.randint(4, len(tok) - 1) for _ in range(rng.randint(1, 6))] if j else []
            if j == 2:
                ids = list(samples[1]["output_ids"])
            samples.append({"output_ids": ids, "output_logprobs": [-1.0] * len(ids), "output_versions": [0] * len(ids),
                            "finish_reason": "stop", "reward": float(j % 2)})
        out.append({"uid": str(g), "prompt_ids": prompt, "samples": samples})
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got: dict, want: dict, atol: float = 2e-5) -> None:
    assert got.keys() == want.keys() and got
    for name, g in want.items():
        assert (got[name] - g).abs().max().item() <= atol * max(1.0, g.abs().max().item()), name


def test_policy_logprobs_prefix_share(toy_lm):
    from plumbing import PolicyLogprobs
    from plumbing.batches import batch_tensors

    tok, lm = toy_lm
    bt = batch_tensors(_groups(tok, 3, 5), tok.pad_token_id, torch.device("cpu"))
    coef = torch.randn(bt["labels"].shape, generator=torch.Generator().manual_seed(0))
    out = {}
    for share in (False, True):
        model = copy.deepcopy(lm)
        logp = PolicyLogprobs(model, 0.9, prefix_share=share)(bt["input_ids"], bt["attention_mask"], bt["labels"])
        (logp * coef).sum().backward()
        out[share] = (logp.detach(), _grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], atol=2e-5, rtol=0)
    assert (out[True][0][~bt["mask"]] == 0).all()
    _close(out[True][1], out[False][1])


def test_ppo_actor_and_critic_prefix_share(toy_lm):
    import ppo_roles

    tok, lm = toy_lm
    rows = [(g["prompt_ids"], s["output_ids"]) for g in _groups(tok, 2, 4) for s in g["samples"]]
    t_len = max(len(r) for _, r in rows)
    seq_len = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), seq_len), tok.pad_token_id)
    mask = torch.zeros(len(rows), t_len, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(r)] = True
    plens = torch.tensor([len(p) for p, _ in rows])
    coef = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    for make in (lambda m, s: ppo_roles.Actor(m, 1.0, s),
                 lambda m, s: ppo_roles.Critic(m.model, m.config.hidden_size, s)):
        out = {}
        for share in (False, True):
            role = make(copy.deepcopy(lm), share)
            if isinstance(role, ppo_roles.Critic):
                torch.nn.init.normal_(role.head.weight, generator=torch.Generator().manual_seed(2))
            y = role(ids, plens, mask)
            (y * coef).sum().backward()
            out[share] = (y.detach(), _grads(role))
        torch.testing.assert_close(out[True][0], out[False][0], atol=2e-5, rtol=0)
        _close(out[True][1], out[False][1])


def test_agent_grpo_backward_prefix_share(toy_lm):
    """Multi-turn trajectories of two groups (the turns of an episode and the episodes of a group share their
    prefix), with a micro-batch budget that cuts the tree into several packed rows."""
    import agent_task

    from rlblocks.rollout import Generation
    from rlblocks.rollout.agents import Trajectory

    tok, lm = toy_lm
    rng = random.Random(3)
    trajs = []
    for group in range(2):
        prompt = [rng.randint(4, len(tok) - 1) for _ in range(12)]
        for ep in range(3):
            t = Trajectory(prompt, group_id=group)
            for _turn in range(2):
                out = [rng.randint(4, len(tok) - 1) for _ in range(rng.randint(2, 5))]
                lps = [-0.3 - 0.1 * rng.random() for _ in out]
                t.append_generation(Generation("r", list(t.token_ids), out, lps, [0] * len(out), "stop"))
                t.append_env([rng.randint(4, len(tok) - 1) for _ in range(3)])
            t.reward = float(ep == 1)
            trajs.append(t)
    out = {}
    for share in (False, True):
        model = copy.deepcopy(lm).train()
        m = agent_task.grpo_backward(model, trajs, tok.pad_token_id, max_tokens=64, prefix_share=share)
        out[share] = (m, _grads(model))
    assert out[True][0]["tokens_trained"] == out[False][0]["tokens_trained"]
    assert abs(out[True][0]["loss"] - out[False][0]["loss"]) <= 1e-6
    _close(out[True][1], out[False][1])
