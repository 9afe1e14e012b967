"""The agent loops' update (``agent_task.grpo_backward``) is ``grpo.grpo_step`` on the trajectories' batch tensors:
the same gradients as ``grpo_step`` called on ``trajectory_tensors``, and the gradients of an independent float64
PPO-clip objective over the model's own tokens (tool tokens masked), written out from the episodes as they were
built."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")

EPS_LOW, EPS_HIGH = 0.1, 0.15


@pytest.fixture(scope="module")
def episodes():
    """A tiny Llama and multi-turn episodes of 2 groups × 3: per turn a generation (model tokens, engine log-probs
    near the model's own, so some ratios leave the clip range) then a tool result. Returns the model, the
    trajectories and, per episode, its token list and the positions and engine log-probs of its model tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlblocks.rollout import Generation
    from rlblocks.rollout.agents import Trajectory

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0))
    rng = random.Random(5)
    trajs, built = [], []
    for group, rewards in enumerate(([1.0, 0.0, 0.0], [0.0, 1.0, 0.5])):
        prompt = [rng.randint(1, 39) for _ in range(6)]
        for reward in rewards:
            t = Trajectory(prompt, group_id=group)
            seq, own, lps = list(prompt), [], []
            for _turn in range(2):
                out = [rng.randint(1, 39) for _ in range(rng.randint(2, 5))]
                lp = [-3.7 + 0.6 * (rng.random() - 0.5) for _ in out]  # ln(1/40) ≈ -3.69: ratios in ~[0.74, 1.35]
                t.append_generation(Generation("r", list(t.token_ids), out, lp, [0] * len(out), "stop"))
                own += range(len(seq), len(seq) + len(out))
                seq += out
                lps += lp
                tool = [rng.randint(1, 39) for _ in range(rng.randint(2, 4))]
                t.append_env(tool)
                seq += tool
            t.reward = reward
            trajs.append(t)
            built.append((seq, own, lps, reward, group))
    return lm, trajs, built


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys() and got
    for name, g in want.items():
        assert (got[name].double() - g.double()).abs().max().item() <= rel * max(1e-3, g.abs().max().item()), name


def reference(lm64, built):
    """PPO-clip GRPO in float64 from the episodes: ``A = (r − mean_g r) / (std_g r + 1e-6)`` (unbiased σ) per
    episode; per model token ``max(−A·ρ, −clip(ρ, 1 − ε_low, 1 + ε_high)·A)`` with ``ρ = π_θ / π_engine``; the
    mean over every model token of the batch (tool tokens and the prompt contribute nothing). Returns the loss
    (its gradients are left in ``lm64``)."""
    rewards = torch.tensor([b[3] for b in built], dtype=torch.float64)
    groups = torch.tensor([b[4] for b in built])
    adv = torch.empty_like(rewards)
    for g in groups.unique():
        sel = groups == g
        adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std(unbiased=True) + 1e-6)
    terms = []
    for (seq, own, lps, _r, _g), a in zip(built, adv):
        logits = lm64(input_ids=torch.tensor([seq])).logits[0].log_softmax(-1)
        pos = torch.tensor(own)
        lp = logits[pos - 1, torch.tensor(seq)[pos]]  # the state before token p predicts it
        ratio = torch.exp(lp - torch.tensor(lps, dtype=torch.float64))
        terms.append(torch.maximum(-a * ratio, -ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a))
    tok = torch.cat(terms)
    loss = tok.sum() / tok.numel()
    loss.backward()
    return loss.detach()


def test_trajectory_tensors_train_the_model_tokens_only(episodes):
    from plumbing import trajectory_tensors

    _lm, trajs, built = episodes
    bt = trajectory_tensors(trajs, 0)
    for row, (seq, own, lps, _r, _g) in enumerate(built):  # no branches: one row per episode
        assert bt["input_ids"][row, : len(seq)].tolist() == seq
        want = torch.zeros(bt["mask"].shape[1], dtype=torch.bool)
        want[torch.tensor(own) - 1] = True  # next-token position p − 1 holds token p
        assert torch.equal(bt["mask"][row], want)
        assert bt["labels"][row][want].tolist() == [seq[p] for p in own]
        torch.testing.assert_close(bt["old_logp"][row][want], torch.tensor(lps), rtol=0, atol=0)


def test_agent_update_is_grpo_step_and_the_float64_objective(episodes):
    import agent_task
    import grpo
    from plumbing import PolicyLogprobs, trajectory_tensors

    from tests.cookbook.test_grpo_step import cfg_of

    lm, trajs, built = episodes
    n_own = sum(len(b[1]) for b in built)

    # the agent loops' call, with a budget that cuts the batch into several micro-batches
    agent = copy.deepcopy(lm)
    forwards = []
    agent.model.register_forward_hook(lambda *_: forwards.append(1))
    m = agent_task.grpo_backward(agent, trajs, 0, eps_low=EPS_LOW, eps_high=EPS_HIGH, max_tokens=40)
    assert len(forwards) > 1 and m["tokens_trained"] == n_own
    assert m["clipfrac_low"] + m["clipfrac_high"] > 0  # the clip acts on these engine log-probs
    g_agent = _grads(agent)

    # grpo_step on the same tensors, whole batch in one forward (its gradients stay in .grad after the step)
    direct = copy.deepcopy(lm)
    cfg = cfg_of(eps_low=EPS_LOW, eps_high=EPS_HIGH)
    md = grpo.grpo_step(cfg, PolicyLogprobs(direct), torch.optim.SGD(direct.parameters(), lr=1.0),
                        trajectory_tensors(trajs, 0))
    _close(g_agent, _grads(direct), 1e-5)
    assert abs(m["loss"] - md["loss"]) <= 1e-6

    # the float64 objective over the model's own tokens
    lm64 = copy.deepcopy(lm).double()
    loss64 = reference(lm64, built)
    _close(g_agent, _grads(lm64), 1e-4)
    assert abs(m["loss"] - float(loss64)) <= 1e-6
