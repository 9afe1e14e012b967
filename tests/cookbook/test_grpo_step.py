"""The GRPO update (``cookbook/grpo.py``'s ``grpo_step``, the one both GRPO loops run) against an independent
float64 implementation of PPO-clip GRPO, and the policy-loss flags against direct calls of the library's losses."""

from __future__ import annotations

from types import SimpleNamespace

import grpo
import grpo_async
import grpo_sync
import pytest
import torch
from plumbing import POLICY_LOSSES, Stale, Stop, Weights, policy_loss, recv_control, send_control
from torch import nn

B, L, V = 8, 7, 5  # 2 groups × 4 samples, sequence length, vocabulary

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


class TablePolicy(nn.Module):
    """A policy whose next-token distribution depends on the position only: ``logp[b, t] = log_softmax(W[t])[y]``
    (the loops only need ``policy(input_ids, attention_mask, labels) -> [B, L-1]`` with 0 on ignored labels)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(L - 1, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, attention_mask, labels):
        return table_logp(self.w, labels)


def table_logp(w, labels):
    lp = w.log_softmax(-1).expand(labels.shape[0], -1, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(labels != -100, lp, 0.0)


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.full((B, L - 1), -100)
    for b in range(B):  # prompt of 2 tokens, responses of 1..5 tokens
        n = int(torch.randint(1, L - 2, (1,), generator=g))
        labels[b, 1 : 1 + n] = torch.randint(0, V, (n,), generator=g)
    mask = labels != -100
    return {
        "input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.ones(B, L, dtype=torch.long),
        "labels": labels, "mask": mask,
        "rollout_logp": torch.where(mask, -torch.rand(B, L - 1, generator=g, dtype=torch.float64) * 2, 0.0),
        "versions": torch.where(mask, 0, -1),
        "rewards": torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1], dtype=torch.float64),
        "group_ids": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
    }


def cfg_of(**kw) -> SimpleNamespace:
    base = dict(loss="ppo", eps_low=None, eps_high=None, rollout_weight_cap=None, correction="none",
                correction_cap=None, ppo_epochs=1, mini_batches=1, agg="token-mean", kl_coef=0.0, grad_clip=1e9,
                seed=3)
    return SimpleNamespace(**{**base, **kw})


def reference_update(cfg, w0, ref_w, bt, lr, step):
    """PPO-clip GRPO written out in float64: group-normalised advantages (unbiased σ, eps 1e-6), π_old fixed
    before the first update, epochs × mini-batches of plain SGD, tis weights min(π_old/π_rollout, cap), k3 KL
    penalty exp(ref − logp) − (ref − logp) − 1, token-mean over each mini-batch's valid tokens."""
    r, gid, mask = bt["rewards"], bt["group_ids"], bt["mask"]
    adv = torch.empty(B, dtype=torch.float64)
    for g in gid.unique():
        sel = gid == g
        adv[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(unbiased=True) + 1e-6)
    eps_low = 0.2 if cfg.eps_low is None else cfg.eps_low
    eps_high = 0.2 if cfg.eps_high is None else cfg.eps_high
    w = w0.detach().clone()
    old = table_logp(w, bt["labels"])
    ref = table_logp(ref_w, bt["labels"]) if ref_w is not None else None
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the loops' documented shuffle
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.mini_batches > 1 else torch.arange(B)
        for rows in order.tensor_split(cfg.mini_batches):
            wv = w.clone().requires_grad_(True)
            lp = table_logp(wv, bt["labels"])[rows]
            ratio = torch.exp(lp - old[rows])
            a = adv[rows][:, None]
            tok = torch.maximum(-a * ratio, -ratio.clamp(1 - eps_low, 1 + eps_high) * a)
            if cfg.correction == "tis":
                tok = tok * torch.exp(old[rows] - bt["rollout_logp"][rows]).clamp(max=cfg.correction_cap)
            if ref is not None:
                d = ref[rows] - lp
                tok = tok + cfg.kl_coef * (torch.exp(d) - d - 1)
            m = mask[rows]
            loss = torch.where(m, tok, 0.0).sum() / m.sum()
            (g,) = torch.autograd.grad(loss, wv)
            w = w - lr * g
    return w


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(ppo_epochs=3, mini_batches=2),
        dict(ppo_epochs=2, mini_batches=4, eps_low=0.1, eps_high=0.3, correction="tis", correction_cap=1.5),
        dict(ppo_epochs=2, mini_batches=2, kl_coef=0.5),
    ],
)
def test_grpo_step_matches_float64_reference(kw):
    cfg, bt, lr, step = cfg_of(**kw), make_batch(), 2.0, 5
    policy = TablePolicy(0)
    ref = TablePolicy(7).requires_grad_(False) if cfg.kl_coef else None
    w0 = policy.w.detach().clone()
    m = grpo.grpo_step(cfg, policy, torch.optim.SGD(policy.parameters(), lr=lr), bt, ref_policy=ref, step=step)
    expect = reference_update(cfg, w0, ref.w if ref is not None else None, bt, lr, step)
    torch.testing.assert_close(policy.w.detach(), expect, rtol=1e-10, atol=1e-12)
    assert m["ppo_updates"] == cfg.ppo_epochs * cfg.mini_batches
    if cfg.ppo_epochs * cfg.mini_batches == 1:  # on-policy: every ratio is exactly 1, nothing is clipped
        assert m["clipfrac_low"] == 0.0 and m["clipfrac_high"] == 0.0
    else:  # lr 2 moves the ratios well past 1 ± 0.2 after the first update
        assert m["clipfrac_low"] + m["clipfrac_high"] > 0.0


@pytest.mark.parametrize("kw", [dict(ppo_epochs=2, mini_batches=2, correction="tis", correction_cap=1.5),
                                dict(kl_coef=0.5, agg="seq-mean-token-mean")])
def test_micro_batches_match_the_whole_mini_batch(kw):
    # max_tokens 21 cuts each mini-batch into micro-batches of at most 3 rows (each row L = 7 padded tokens): their
    # losses, each over the mini-batch's global normalisers, add up to the mini-batch's, so the update is unchanged
    cfg, bt, lr, step = cfg_of(**kw), make_batch(), 2.0, 5
    ref = TablePolicy(7).requires_grad_(False) if cfg.kl_coef else None
    out = {}
    for max_tokens in (None, 21):
        policy = TablePolicy(0)
        m = grpo.grpo_step(cfg, policy, torch.optim.SGD(policy.parameters(), lr=lr), bt, ref_policy=ref, step=step,
                           max_tokens=max_tokens)
        out[max_tokens] = (policy.w.detach(), m)
    torch.testing.assert_close(out[21][0], out[None][0], rtol=1e-12, atol=1e-14)
    assert out[21][1]["loss"] == pytest.approx(out[None][1]["loss"], rel=1e-12)
    if cfg.agg == "token-mean":  # and the float64 reference of the whole update
        expect = reference_update(cfg, TablePolicy(0).w.detach(), None, bt, lr, step)
        torch.testing.assert_close(out[21][0], expect, rtol=1e-10, atol=1e-12)


def test_backward_only_needs_a_single_update():
    from rlblocks.errors import ArgumentError

    with pytest.raises(ArgumentError, match="optim"):
        grpo.grpo_step(cfg_of(ppo_epochs=2), TablePolicy(0), None, make_batch())


def test_both_loops_run_the_one_update():
    # one grpo_step, in cookbook/grpo.py: both loops call that function, not a copy of it
    assert grpo_sync.grpo_step is grpo.grpo_step and grpo_async.grpo_step is grpo.grpo_step


def _loss_inputs():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    old = logp + 0.4 * (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)  # ratios in ~[0.8, 1.2]
    rollout = logp + 0.6 * (torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[0, 4:] = False
    return logp, old, adv, mask, rollout


def _direct(name, logp, old, adv, mask, rollout, **kw):
    fn = POLICY_LOSSES[name]
    if name == "decoupled":
        return fn(logp, old, adv, mask, rollout_logp=rollout, **kw)
    return fn(logp, old, adv, mask, **kw)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_eps_flags_reach_every_loss(name):
    logp, old, adv, mask, rollout = _loss_inputs()
    own, _ = _direct(name, logp, old, adv, mask, rollout)
    default, _ = policy_loss(cfg_of(loss=name), logp, old, adv, mask, rollout_logp=rollout)
    torch.testing.assert_close(default, own, rtol=0, atol=0)  # no flag: the loss's own defaults
    given, _ = policy_loss(cfg_of(loss=name, eps_low=0.05, eps_high=0.07), logp, old, adv, mask,
                           rollout_logp=rollout)
    direct, _ = _direct(name, logp, old, adv, mask, rollout, eps_low=0.05, eps_high=0.07)
    torch.testing.assert_close(given, direct, rtol=0, atol=0)
    assert not torch.equal(given, own)  # the offsets change the loss on these ratios


def test_cispo_keeps_its_own_upper_clip():
    logp, old, adv, mask, rollout = _loss_inputs()
    own, _ = policy_loss(cfg_of(loss="cispo"), logp, old - 0.3, adv, mask, rollout_logp=rollout)  # r in ~[1.1, 1.6]
    ppo_like, _ = POLICY_LOSSES["cispo"](logp, old - 0.3, adv, mask, eps_high=0.2)
    expect, _ = POLICY_LOSSES["cispo"](logp, old - 0.3, adv, mask, eps_high=0.28)
    torch.testing.assert_close(own, expect, rtol=0, atol=0)
    assert not torch.equal(own, ppo_like)


def test_rollout_weight_cap_reaches_decoupled():
    logp, old, adv, mask, rollout = _loss_inputs()
    capped, _ = policy_loss(cfg_of(loss="decoupled", rollout_weight_cap=1.05), logp, old, adv, mask,
                            rollout_logp=rollout)
    direct, _ = POLICY_LOSSES["decoupled"](logp, old, adv, mask, rollout_logp=rollout, rollout_weight_cap=1.05)
    uncapped, _ = policy_loss(cfg_of(loss="decoupled"), logp, old, adv, mask, rollout_logp=rollout)
    torch.testing.assert_close(capped, direct, rtol=0, atol=0)
    assert not torch.equal(capped, uncapped)


def test_control_messages_round_trip():
    class Loopback:  # broadcast_bytes as the sync group does it: the source's bytes come back everywhere
        def broadcast_bytes(self, data, src):
            if data is not None:
                self.data = data
            return self.data

    g = Loopback()
    for msg in (Weights(version=3, kind="delta"), Weights(7, "full", True, {1: 2, 3: 0}), Stale({1: 4}), Stop()):
        send_control(g, msg)
        assert recv_control(g) == msg


def _records() -> list[dict]:
    """Two groups of varied prompt and output lengths, one output empty (a sample that ended at once)."""
    g = torch.Generator().manual_seed(4)

    def sample(n: int, v: int) -> dict:
        return {"output_ids": torch.randint(3, 60, (n,), generator=g).tolist(),
                "output_logprobs": (-torch.rand(n, generator=g)).tolist(), "output_versions": [v] * n,
                "finish_reason": "stop" if n else "abort", "reward": float(n % 2)}

    return [
        {"uid": "a", "prompt_ids": [1, 5, 6], "samples": [sample(4, 2), sample(0, 2), sample(2, 3)], "version": 2},
        {"uid": "b", "prompt_ids": [1, 7, 8, 9, 10], "samples": [sample(1, 1), sample(5, 0)], "version": 0},
    ]


def test_batch_tensors_next_token_layout():
    # reference: the layout written out element by element (token t of a row's output is the label at
    # position len(prompt) - 1 + t, whose input is position len(prompt) - 1 + t of prompt + output)
    from plumbing import batch_tensors

    recs, pad = _records(), 0
    bt = batch_tensors(recs, pad, torch.device("cpu"))
    rows = [(gi, r["prompt_ids"], s) for gi, r in enumerate(recs) for s in r["samples"]]
    width = max(len(p) + len(s["output_ids"]) for _, p, s in rows)
    assert bt["input_ids"].shape == (len(rows), width) and bt["labels"].shape == (len(rows), width - 1)
    for i, (gi, p, s) in enumerate(rows):
        seq = p + s["output_ids"]
        assert bt["input_ids"][i].tolist() == seq + [pad] * (width - len(seq))
        assert bt["attention_mask"][i].tolist() == [1] * len(seq) + [0] * (width - len(seq))
        for j in range(width - 1):
            t = j - (len(p) - 1)
            inside = 0 <= t < len(s["output_ids"])
            assert bt["labels"][i, j] == (s["output_ids"][t] if inside else -100)
            assert bt["mask"][i, j] == inside
            assert bt["rollout_logp"][i, j] == (torch.tensor(s["output_logprobs"][t]) if inside else 0.0)
            assert bt["versions"][i, j] == (s["output_versions"][t] if inside else -1)
        assert bt["group_ids"][i] == gi and bt["rewards"][i] == s["reward"]
    assert bt["attention_mask"].dtype == torch.long and bt["rollout_logp"].dtype == torch.float32


def test_policy_logprobs_match_the_models_own_logits():
    # reference: the HF model's full logits, log-softmax in float64, gathered at each label
    from plumbing import PolicyLogprobs, batch_tensors
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlblocks.errors import ArgumentError

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    bt = batch_tensors(_records(), 0, torch.device("cpu"))
    temp = 0.7
    logp = PolicyLogprobs(lm, temp)(bt["input_ids"], bt["attention_mask"], bt["labels"])
    with torch.no_grad():
        full = (lm(input_ids=bt["input_ids"], attention_mask=bt["attention_mask"]).logits[:, :-1].double()
                / temp).log_softmax(-1)
        expect = torch.where(bt["mask"], full.gather(-1, bt["labels"].clamp(min=0)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(logp.double(), expect, rtol=0, atol=1e-5)
    logp.sum().backward()
    assert lm.lm_head.weight.grad is not None and lm.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    wrong = torch.where(bt["mask"], (bt["labels"] + 1) % 64, -100)  # labels that are not the next tokens
    with pytest.raises(ArgumentError, match="labels"):
        PolicyLogprobs(lm)(bt["input_ids"], bt["attention_mask"], wrong)
